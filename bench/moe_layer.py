"""Benchmark the top-k routed expert layer against its physical limit and two peer implementations.

Legend: N tokens, D model width, F expert hidden width, E experts, K experts per token.

All timings are forward + backward on the same N×D input, same shapes, in one process, interleaved round-robin
(so load from other processes hits every contender alike). Ratios use each contender's fastest round: on a shared
machine interference only ever adds time, so the minimum is the steadiest estimate; medians are printed too.
  (a) ours, dropless            / (K × dense FFN of the same activation)   the limit is 1.0; goal <= 1.05
  (b) DeepSpeed MoE, cf=1.25    / ours, cf=1.25 (GELU)                      goal >= 1.25
  (c) transformers Mixtral block / ours, dropless (SwiGLU, same weights)    goal >= 1.10
"ours gelu experts only" runs just the expert matmuls on the already-dispatched K·N rows of the dropless layer,
so (ours - experts only) is what routing, dispatch, combine, losses and statistics cost.

    .venv/bin/python bench/moe_layer.py                      # the issue's shapes, 2 threads
    .venv/bin/python bench/moe_layer.py --tokens 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.dispatch import plan_dispatch
from moe.ffn import FeedForward
from moe.moe_config import MoEConfig
from moe.moe_layer import MoELayer


def fwd_bwd_step(run: Callable[[torch.Tensor], list[torch.Tensor]], params: list[nn.Parameter], x_BTD, grad_out):
    """One timed forward+backward; `run` returns [output, *scalar losses] and the backward seeds them all."""

    def step() -> float:
        for p in params:
            p.grad = None
        x = x_BTD.detach().requires_grad_(True)
        start = time.perf_counter()
        outputs = run(x)
        torch.autograd.backward(outputs, [grad_out] + [torch.ones_like(o) for o in outputs[1:]])
        return time.perf_counter() - start

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
    route = layer.router(x_ND)
    plan = plan_dispatch(route.topk_ids_NK, route.gates_NK, num_experts=layer.config.num_experts)
    x_AD, sizes = x_ND[plan.token_ids_A], plan.tokens_per_expert_after_E.tolist()
    layer.router.zero_grad(set_to_none=True)
    return layer.experts, lambda x: [layer.experts(x_AD.requires_grad_(), sizes)], torch.randn_like(x_AD)


def build_dense(d_model: int, d_ff: int, activation: str) -> tuple[nn.Module, Callable]:
    ffn = FeedForward(d_model, d_ff, activation).train()
    return ffn, lambda x: [ffn(x)]


def build_deepspeed(d_model: int, d_ff: int, num_experts: int, top_k: int, capacity_factor: float):
    # DeepSpeed's expert-parallel setup asserts a process group even at ep_size=1: make a one-rank gloo world.
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29517")
    import deepspeed
    from deepspeed.moe.layer import MoE

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    moe = MoE(
        hidden_size=d_model,
        expert=FeedForward(d_model, d_ff, "gelu"),
        num_experts=num_experts,
        ep_size=1,
        k=top_k,
        capacity_factor=capacity_factor,
        eval_capacity_factor=capacity_factor,
        min_capacity=4,
    ).train()
    moe.set_deepspeed_parallelism()

    def run(x):
        output, l_aux, _ = moe(x)
        return [output, l_aux]

    return moe, run


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
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--skip-deepspeed", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    D, F, E, K = args.d_model, args.d_ff, args.experts, args.top_k
    x_BTD = torch.randn(args.batch, args.tokens // args.batch, D)
    grad_BTD = torch.randn_like(x_BTD)
    dropless = MoEConfig(num_experts=E, top_k=K, expert_d_ff=F, capacity_factor=None)
    capped = MoEConfig(num_experts=E, top_k=K, expert_d_ff=F, capacity_factor=args.capacity_factor)

    contenders: dict[str, tuple[nn.Module, Callable]] = {
        "dense gelu": build_dense(D, F, "gelu"),
        "dense swiglu": build_dense(D, F, "swiglu"),
        "ours gelu dropless": build_ours(D, dropless, "gelu"),
        "ours swiglu dropless": build_ours(D, dropless, "swiglu"),
        f"ours gelu cf={args.capacity_factor}": build_ours(D, capped, "gelu"),
    }
    if not args.skip_deepspeed:
        contenders[f"deepspeed gelu cf={args.capacity_factor}"] = build_deepspeed(D, F, E, K, args.capacity_factor)
    if not args.skip_transformers:
        ours_swiglu = contenders["ours swiglu dropless"][0]
        contenders["transformers mixtral (eager)"] = build_mixtral(ours_swiglu, D, F, E, K)

    steps = {
        name: fwd_bwd_step(run, list(module.parameters()), x_BTD, grad_BTD)
        for name, (module, run) in contenders.items()
    }
    experts, run, grad_AD = build_experts_only(contenders["ours gelu dropless"][0], x_BTD)
    steps["ours gelu experts only"] = fwd_bwd_step(run, list(experts.parameters()), x_BTD, grad_AD)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_idx in range(args.rounds + 1):
        for name, step in steps.items():
            elapsed = step()
            if round_idx > 0:  # round 0 warms up allocators and caches
                times[name].append(elapsed)
    ms = {name: 1e3 * min(t) for name, t in times.items()}

    print(f"N={args.tokens} D={D} F={F} E={E} K={K} threads={args.threads} fwd+bwd, {args.rounds} rounds")
    for name, value in ms.items():
        print(f"  {name:<34s} min {value:7.1f} ms   median {1e3 * statistics.median(times[name]):7.1f} ms")
    cf = args.capacity_factor
    rows = [
        ("(a) ours gelu dropless / (K x dense gelu)", ms["ours gelu dropless"] / (K * ms["dense gelu"]), "<= 1.05"),
        ("    ours swiglu dropless / (K x dense swiglu)", ms["ours swiglu dropless"] / (K * ms["dense swiglu"]), ""),
        ("    ours gelu experts only / (K x dense gelu)", ms["ours gelu experts only"] / (K * ms["dense gelu"]), ""),
    ]
    if not args.skip_deepspeed:
        ratio = ms[f"deepspeed gelu cf={cf}"] / ms[f"ours gelu cf={cf}"]
        rows.append((f"(b) deepspeed cf={cf} / ours cf={cf}", ratio, ">= 1.25"))
    if not args.skip_transformers:
        ratio = ms["transformers mixtral (eager)"] / ms["ours swiglu dropless"]
        rows.append(("(c) transformers mixtral / ours swiglu dropless", ratio, ">= 1.10"))
    print("ratios (of the fastest rounds):")
    for label, value, goal in rows:
        print(f"  {label:<48s} {value:6.3f}   {'goal ' + goal if goal else ''}")


if __name__ == "__main__":
    main()
