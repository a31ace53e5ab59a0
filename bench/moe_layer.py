"""Benchmark the top-k routed expert layer against its physical limit and two peer implementations.

Legend: N tokens, D model width, F expert hidden width, E experts, K experts per token, C capacity.

All timings are forward + backward on the same N×D input, same shapes, in one process, interleaved round-robin
(so load from other processes hits every contender alike). Each ratio is taken of the contenders' median rounds;
`--repeats R` repeats the whole interleaved measurement R times and prints every ratio's median and spread
(min, max) over the repeats, beside the ratio of the fastest rounds (interference only ever adds time).
  (a) ours, dropless            / (K × dense FFN of the same activation)   the limit; goal <= 1.00
  (b) DeepSpeed MoE, cf=1.25    / ours, cf=1.25 (GELU)                      goal >= 1.25, and ours' time per kept
                                                                            row <= 1.0 × DeepSpeed's
  (c) transformers Mixtral block / ours, dropless (SwiGLU, same weights)    goal >= 1.15
"ours gelu experts only" runs just the expert matmuls on the already-dispatched K·N rows of the dropless layer,
so (ours - experts only) is what routing, dispatch, combine, losses and statistics cost.

(b) is a like-for-like comparison: DeepSpeed's layer is built with use_rts=False and
top2_2nd_expert_sampling=False (no random token selection, no Gumbel-sampled 2nd expert) and holds our capped
layer's router and expert weights; our capped layer uses DeepSpeed's drop order (drop_policy="choice": every
token's 1st choice before any 2nd, then token order) and its min_capacity. The script checks that both keep the
same (token, expert) pairs and prints the rows each computes: DeepSpeed runs all E·C capacity slots, we run only
the kept rows. One difference remains and is printed: DeepSpeed renormalises a token's gates over its *kept*
experts (a token that loses its 2nd expert gets gate 1 on its 1st), we keep the top-k gates as routed (the lost
share rides the residual, as in Switch/Megatron); it changes those tokens' outputs, not the work.

    .venv/bin/python bench/moe_layer.py                      # the issue's shapes, 2 threads
    .venv/bin/python bench/moe_layer.py --rounds 5 --repeats 3
    .venv/bin/python bench/moe_layer.py --threads 1 --clock cpu --repeats 3   # on a busy machine: CPU time
    .venv/bin/python bench/moe_layer.py --tokens 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.ffn import FeedForward
from moe.moe_config import MoEConfig
from moe.moe_layer import MoELayer

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def fwd_bwd_step(
    run: Callable[[torch.Tensor], list[torch.Tensor]], params: list[nn.Parameter], x_BTD, grad_out, clock="wall"
):
    """One timed forward+backward; `run` returns [output, *scalar losses] and the backward seeds them all."""
    now = CLOCKS[clock]

    def step() -> float:
        for p in params:
            p.grad = None
        x = x_BTD.detach().requires_grad_(True)
        start = now()
        outputs = run(x)
        torch.autograd.backward(outputs, [grad_out] + [torch.ones_like(o) for o in outputs[1:]])
        return now() - start

    return step


def build_ours(d_model: int, config: MoEConfig, activation: str) -> tuple[MoELayer, Callable]:
    layer = MoELayer(d_model, config, activation).train()

    def run(x):
        out = layer(x)
        return [out.output, out.aux_loss + out.z_loss]

    return layer, run


@torch.no_grad()
def build_experts_only(layer: MoELayer, x_BTD: torch.Tensor) -> tuple[nn.Module, Callable, torch.Tensor]:
    """The layer's expert matmuls alone, on the rows its routing of x_BTD dispatches (fixed, precomputed)."""
    x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
    _, plan, _ = layer.route_and_plan(x_ND)  # the dropless layer: every assignment kept
    x_AD, sizes = x_ND[plan.token_ids_A], plan.tokens_per_expert_after
    layer.router.zero_grad(set_to_none=True)
    return layer.experts, lambda x: [layer.experts(x_AD.requires_grad_(), sizes)], torch.randn_like(x_AD)


def build_dense(d_model: int, d_ff: int, activation: str) -> tuple[nn.Module, Callable]:
    ffn = FeedForward(d_model, d_ff, activation).train()
    return ffn, lambda x: [ffn(x)]


def build_deepspeed(ours: MoELayer, d_model: int, d_ff: int, num_experts: int, top_k: int, capacity_factor: float):
    """DeepSpeed's MoE with deterministic top-2 routing, holding exactly `ours`' router and expert weights."""
    # DeepSpeed's expert-parallel setup asserts a process group even at ep_size=1: make a one-rank gloo world.
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29517")
    import deepspeed
    from deepspeed.moe.layer import MoE

    from moe_platform.parallel.accelerator import no_shared_memory_inference_op

    if not torch.distributed.is_initialized():
        no_shared_memory_inference_op()  # as the trainer does: no ~45 s compile of an op training never calls
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    moe = MoE(
        hidden_size=d_model,
        expert=FeedForward(d_model, d_ff, "gelu"),
        num_experts=num_experts,
        ep_size=1,
        k=top_k,
        capacity_factor=capacity_factor,
        eval_capacity_factor=capacity_factor,
        min_capacity=ours.config.min_capacity,
        use_rts=False,  # its default picks which tokens to keep at random
        top2_2nd_expert_sampling=False,  # its default samples the 2nd expert with Gumbel noise
    ).train()
    moe.set_deepspeed_parallelism()
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for e, ffn in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            ffn.w_up.weight.copy_(ours.experts.w_up[e].t())
            ffn.w_down.weight.copy_(ours.experts.w_down[e].t())

    def run(x):
        output, l_aux, _ = moe(x)
        return [output, l_aux]

    return moe, run


@torch.no_grad()
def kept_pairs_ours(layer: MoELayer, x_BTD: torch.Tensor) -> tuple[set[tuple[int, int]], int]:
    """The (token, expert) pairs our capped layer computes, and the rows it computes (= kept assignments)."""
    route, plan, _ = layer.route_and_plan(x_BTD.reshape(-1, x_BTD.shape[-1]))
    experts_A = route.topk_ids_NK.reshape(-1)[plan.assignment_ids_A]
    pairs = set(zip(plan.token_ids_A.tolist(), experts_A.tolist(), strict=True))
    return pairs, sum(plan.tokens_per_expert_after)


@torch.no_grad()
def kept_pairs_deepspeed(moe: nn.Module, x_BTD: torch.Tensor) -> tuple[set[tuple[int, int]], int]:
    """The (token, expert) pairs DeepSpeed's gate keeps, and the rows its experts compute (E · C slots)."""
    x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
    _, capacity, num_experts, indices_KN, _, _, _ = moe.deepspeed_moe.gate(x_ND, None, True, False)
    pairs = set()
    for expert_ids_N in indices_KN.tolist():  # -1: dropped by capacity
        pairs |= {(n, e) for n, e in enumerate(expert_ids_N) if e >= 0}
    return pairs, int(capacity) * int(num_experts)


def build_mixtral(ours: MoELayer, d_model: int, d_ff: int, num_experts: int, top_k: int):
    """A transformers MixtralSparseMoeBlock holding exactly `ours`' router and expert weights (eager experts)."""
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=d_model,
        intermediate_size=d_ff,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        router_jitter_noise=0.0,
        hidden_act="silu",
        experts_implementation="eager",  # "batched_mm" materialises a [N·K, D, F]-sized tensor (~17 GB here)
    )
    block = MixtralSparseMoeBlock(config).train()
    copy_into_mixtral(ours, block)
    return block, lambda x: [block(x)]


@torch.no_grad()
def copy_into_mixtral(ours: MoELayer, block: nn.Module) -> None:
    """Mixtral (transformers >= 5) stores gate_up_proj [E, 2F, D] (gate rows first) and down_proj [E, D, F]."""
    experts = ours.experts
    block.gate.weight.copy_(ours.router.weight)
    block.experts.gate_up_proj.copy_(torch.cat([experts.w_gate, experts.w_up], dim=2).transpose(1, 2))
    block.experts.down_proj.copy_(experts.w_down.transpose(1, 2))


def measure(steps: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Seconds per round of every step, interleaved round-robin, after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_idx in range(rounds + 1):
        for name, step in steps.items():
            elapsed = step()
            if round_idx > 0:  # round 0 warms up allocators and caches
                times[name].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="tokens are laid out as [batch, tokens/batch, D]")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per repeat (after one warm-up round)")
    parser.add_argument("--repeats", type=int, default=1, help="repeat the whole interleaved measurement R times")
    parser.add_argument(
        "--clock",
        default="wall",
        choices=sorted(CLOCKS),
        help="wall: elapsed time; cpu: this process's CPU time, which other jobs on a busy machine barely move "
        "(meaningful with --threads 1: with more, threads waiting on each other count too)",
    )
    parser.add_argument("--experts-impl", default="auto", choices=["auto", "grouped_mm", "loop"])
    parser.add_argument("--skip-deepspeed", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    D, F, E, K, cf = args.d_model, args.d_ff, args.experts, args.top_k, args.capacity_factor
    x_BTD = torch.randn(args.batch, args.tokens // args.batch, D)
    grad_BTD = torch.randn_like(x_BTD)
    common = dict(num_experts=E, top_k=K, expert_d_ff=F, experts_impl=args.experts_impl)
    dropless = MoEConfig(**common, capacity_factor=None)
    capped = MoEConfig(**common, capacity_factor=cf, drop_policy="choice")  # DeepSpeed's top-2 drop order

    contenders: dict[str, tuple[nn.Module, Callable]] = {
        "dense gelu": build_dense(D, F, "gelu"),
        "dense swiglu": build_dense(D, F, "swiglu"),
        "ours gelu dropless": build_ours(D, dropless, "gelu"),
        "ours swiglu dropless": build_ours(D, dropless, "swiglu"),
        f"ours gelu cf={cf}": build_ours(D, capped, "gelu"),
    }
    if not args.skip_deepspeed:
        ours_capped = contenders[f"ours gelu cf={cf}"][0]
        contenders[f"deepspeed gelu cf={cf}"] = build_deepspeed(ours_capped, D, F, E, K, cf)
    if not args.skip_transformers:
        ours_swiglu = contenders["ours swiglu dropless"][0]
        contenders["transformers mixtral (eager)"] = build_mixtral(ours_swiglu, D, F, E, K)

    steps = {
        name: fwd_bwd_step(run, list(module.parameters()), x_BTD, grad_BTD, args.clock)
        for name, (module, run) in contenders.items()
    }
    experts, run, grad_AD = build_experts_only(contenders["ours gelu dropless"][0], x_BTD)
    steps["ours gelu experts only"] = fwd_bwd_step(run, list(experts.parameters()), x_BTD, grad_AD, args.clock)

    print(
        f"N={args.tokens} D={D} F={F} E={E} K={K} threads={args.threads} clock={args.clock} "
        f"experts_impl={args.experts_impl} "
        f"fwd+bwd, {args.repeats} repeat(s) x {args.rounds} rounds"
    )
    kept_rows = {}
    if not args.skip_deepspeed:
        ours_pairs, ours_rows = kept_pairs_ours(contenders[f"ours gelu cf={cf}"][0], x_BTD)
        ds_pairs, ds_rows = kept_pairs_deepspeed(contenders[f"deepspeed gelu cf={cf}"][0], x_BTD)
        agree = len(ours_pairs & ds_pairs) / max(len(ours_pairs | ds_pairs), 1)
        kept_rows = {f"ours gelu cf={cf}": len(ours_pairs), f"deepspeed gelu cf={cf}": len(ds_pairs)}
        kept_per_token = Counter(n for n, _ in ours_pairs)
        one_kept = sum(1 for count in kept_per_token.values() if 0 < count < K)
        print(f"(b) capacity {cf}: of {args.tokens * K} routed (token, expert) assignments")
        print(f"    ours       keeps {len(ours_pairs):6d}, computes {ours_rows:6d} rows")
        print(f"    deepspeed  keeps {len(ds_pairs):6d}, computes {ds_rows:6d} rows (E x capacity slots)")
        print(f"    kept pairs agree: {agree:.4f} (|ours & ds| / |ours | ds|)")
        print(f"    tokens that kept some but not all K experts (deepspeed renormalises their gates): {one_kept}")

    ratio_defs = [
        ("(a) ours gelu dropless / (K x dense gelu)", "ours gelu dropless", "dense gelu", K, "<= 1.00"),
        ("(a) ours swiglu dropless / (K x dense swiglu)", "ours swiglu dropless", "dense swiglu", K, "<= 1.00"),
        ("    ours gelu experts only / (K x dense gelu)", "ours gelu experts only", "dense gelu", K, ""),
    ]
    if not args.skip_deepspeed:
        ds, ours = f"deepspeed gelu cf={cf}", f"ours gelu cf={cf}"
        ratio_defs.append((f"(b) deepspeed cf={cf} / ours cf={cf}", ds, ours, 1, ">= 1.25"))
        # time per kept row, ours / deepspeed: (t_ours / kept_ours) / (t_ds / kept_ds)
        scale = kept_rows[ds] / kept_rows[ours]
        ratio_defs.append(("(b) ours / deepspeed, time per kept row", ours, ds, scale, "<= 1.00"))
    if not args.skip_transformers:
        ratio_defs.append(
            (
                "(c) transformers mixtral / ours swiglu dropless",
                "transformers mixtral (eager)",
                "ours swiglu dropless",
                1,
                ">= 1.15",
            )
        )

    by_median: dict[str, list[float]] = {label: [] for label, *_ in ratio_defs}
    by_min: dict[str, list[float]] = {label: [] for label, *_ in ratio_defs}
    for repeat in range(args.repeats):
        times = measure(steps, args.rounds)
        print(f"repeat {repeat + 1}: ms per fwd+bwd (min / median / max over {args.rounds} rounds)")
        for name, t in times.items():
            line = f"  {name:<34s} {1e3 * min(t):7.1f} / {1e3 * statistics.median(t):7.1f} / {1e3 * max(t):7.1f}"
            if name in kept_rows:
                per_row_us = 1e6 * statistics.median(t) / kept_rows[name]
                line += f"   {per_row_us:6.2f} us per kept row (median)"
            print(line)
        for label, num, den, scale, _ in ratio_defs:
            by_median[label].append(statistics.median(times[num]) / (scale * statistics.median(times[den])))
            by_min[label].append(min(times[num]) / (scale * min(times[den])))

    print(f"ratios: median over {args.repeats} repeat(s) of the ratio of median rounds [min, max over repeats];")
    print("        the ratio of fastest rounds likewise")
    for label, *_, goal in ratio_defs:
        med, fast = by_median[label], by_min[label]
        print(
            f"  {label:<48s} {statistics.median(med):6.3f} [{min(med):5.3f}, {max(med):5.3f}]"
            f"   fastest {statistics.median(fast):6.3f} [{min(fast):5.3f}, {max(fast):5.3f}]"
            f"   {'goal ' + goal if goal else ''}"
        )


if __name__ == "__main__":
    main()
