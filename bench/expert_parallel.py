"""Benchmark expert parallelism (EP=2 on two gloo CPU ranks): bytes the token exchange moves, and step time.

Legend: N tokens per rank, D model width, F expert hidden width, E experts, K experts per token, L = E/EP experts
per rank, C capacity (assignments one expert accepts), b bytes per element.

Measured in one run of two spawned processes on 127.0.0.1, on the same per-rank inputs:
  1. Bytes our EP layer (`MoELayer` sharded by `moe_platform.parallel.expert_parallel.shard_model`) sends to the
     OTHER rank per step, counted at the collectives themselves: `torch.distributed.all_to_all_single` (the
     per-expert counts exchange) and `moe.expert_parallel.all_to_all_single_autograd` (the token exchanges), from
     their split sizes. The ideal moves each off-rank kept assignment's hidden vector once each way
     (dispatch + combine):
     2·(off-rank kept assignments)·D·b per forward; the goal is measured / ideal = 1.00. The backward sends the
     gradients of both exchanges back the same way (the same bytes again); it is counted separately.
  2. The same count for DeepSpeed's native MoE (`deepspeed.moe.layer.MoE`, ep_size=2, same D, E, K, tokens,
     capacity factor, and our router's weights with its random parts off, so the same top-K choices): each
     exchange sends its whole capacity-padded [E, C, D] buffer, (EP-1)/EP of it off-rank, whatever the routing
     kept. Its ideal is computed from its own kept assignments (read off its gate); its ratio is about
     cf / (fraction kept) when (EP-1)/EP of the assignments are off-rank.
  3. Step time, forward + backward (+ the gradient all-reduce that data parallelism needs), EP=2 against EP=1
     (each rank holds all experts and runs its own tokens: plain data parallelism), interleaved round-robin;
     a round's time is the slower rank's. On two shared CPU cores this is informative only.

    .venv/bin/python bench/expert_parallel.py            # N=2048 per rank, D=256, F=1024, E=8, K=2, cf=1.25
    .venv/bin/python bench/expert_parallel.py --quick    # N=512, F=512, 3 rounds
"""

from __future__ import annotations

import argparse
import copy
import io
import logging
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moe.expert_parallel as moe_ep
from moe.ffn import FeedForward
from moe.moe_config import MoEConfig
from moe.moe_layer import MoELayer
from moe_platform.testing import run_distributed

EP = 2  # = the world: two ranks, one EP group


class OffRankBytes:
    """Bytes this rank hands to OTHER ranks through all-to-all while `counting()` is active, by (phase, what).

    The caller sets `phase` ("forward" / "backward") around each half of the step.
    """

    def __init__(self) -> None:
        self.sent: Counter[tuple[str, str]] = Counter()
        self.phase = "forward"

    def add(self, what: str, t: torch.Tensor, split_sizes: list[int] | None, group) -> None:
        size, me = dist.get_world_size(group), dist.get_rank(group)
        rows = split_sizes if split_sizes is not None else [t.shape[0] // size] * size  # even: equal chunks
        row_bytes = math.prod(t.shape[1:]) * t.element_size()
        self.sent[(self.phase, what)] += row_bytes * sum(r for p, r in enumerate(rows) if p != me)

    @contextmanager
    def counting(self) -> Iterator[OffRankBytes]:
        plain, functional = dist.all_to_all_single, moe_ep.all_to_all_single_autograd

        # Integer tensors through the plain collective are split counts; floating ones are hidden vectors
        # (DeepSpeed's exchanges, whose autograd backward calls this same function again).
        def counted_plain(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            self.add("tokens" if input.is_floating_point() else "counts", input, input_split_sizes, group)
            return plain(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def counted_functional(x, output_split_sizes, input_split_sizes, group, tag=""):
            self.add("tokens", x, input_split_sizes, group)
            y = functional(x, output_split_sizes, input_split_sizes, group, tag)
            if y.requires_grad:  # its backward (the reverse exchange) is C++ autograd: count the gradient it sends
                y.register_hook(lambda g: self.add("tokens", g, output_split_sizes, group))
            return y

        dist.all_to_all_single, moe_ep.all_to_all_single_autograd = counted_plain, counted_functional
        try:
            yield self
        finally:
            dist.all_to_all_single, moe_ep.all_to_all_single_autograd = plain, functional


def off_rank(expert_ids: torch.Tensor, ep_rank: int, num_experts: int) -> torch.Tensor:
    """Whether each assignment's expert lives on another rank (rank p holds the block [p·L, (p+1)·L))."""
    return expert_ids.div(num_experts // EP, rounding_mode="floor") != ep_rank


@torch.no_grad()
def our_routing(layer: MoELayer, x_BTD: torch.Tensor, ep_rank: int) -> tuple[int, int, int]:
    """(off-rank kept assignments, distinct off-rank (token, destination rank) pairs, kept assignments) on x."""
    cfg = layer.config
    _, plan, _ = layer.route_and_plan(x_BTD.reshape(-1, x_BTD.shape[-1]))
    expert_A = torch.arange(cfg.num_experts).repeat_interleave(plan.tokens_per_expert_after_E)
    away_A = off_rank(expert_A, ep_rank, cfg.num_experts)
    dest_A = expert_A.div(cfg.num_experts // EP, rounding_mode="floor")
    pairs = torch.unique(plan.token_ids_A[away_A] * EP + dest_A[away_A]).numel()
    return int(away_A.sum()), pairs, expert_A.numel()


def build_deepspeed(ours: MoELayer, d_model: int, d_ff: int, capacity_factor: float) -> nn.Module:
    """DeepSpeed's MoE at ep_size=EP with our router's weights; Gumbel 2nd expert and random token selection off."""
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import logger

    from moe_platform.parallel.accelerator import no_shared_memory_inference_op

    logger.setLevel(logging.WARNING)
    no_shared_memory_inference_op()  # as the trainer does: no ~45 s compile of an op training never calls
    with redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # adopts our gloo process group
    cfg = ours.config
    layer = MoE(
        hidden_size=d_model,
        expert=FeedForward(d_model, d_ff, ours.activation),
        num_experts=cfg.num_experts,
        ep_size=EP,
        k=cfg.top_k,
        capacity_factor=capacity_factor,
        eval_capacity_factor=capacity_factor,
        min_capacity=cfg.min_capacity,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    ).train()
    with redirect_stdout(io.StringIO()):  # "No existing process group found, creating a new group named: …"
        layer.set_deepspeed_parallelism()  # the EP and expert-data-parallel groups, from deepspeed.utils.groups
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
    return layer


def deepspeed_kept(layer: nn.Module, ep_rank: int, num_experts: int) -> Callable[[], tuple[int, int, int]]:
    """(off-rank kept, kept, capacity C) of the last forward, from its gate's routes (-1 marks a dropped one)."""
    seen = []

    def hook(module, inputs, output):
        routes_KS = output[3]
        kept_KS = routes_KS >= 0
        away = int((off_rank(routes_KS.long(), ep_rank, num_experts) & kept_KS).sum())
        seen.append((away, int(kept_KS.sum()), int(output[1])))

    layer.deepspeed_moe.gate.register_forward_hook(hook)
    return lambda: seen[-1]


def train_step(
    forward: Callable[[torch.Tensor], list[torch.Tensor]], params: list[nn.Parameter], sync: Callable[[], None]
) -> Callable[[torch.Tensor, torch.Tensor, OffRankBytes | None], tuple[float, float]]:
    """One forward + backward (output · grad_out + losses), then the gradient sync; (fwd+bwd, total) seconds."""

    def step(x_BTD, grad_BTD, counter=None) -> tuple[float, float]:
        for p in params:
            p.grad = None
        x = x_BTD.detach().requires_grad_(True)
        dist.barrier()  # both ranks start together: a round's time is then the slower rank's
        start = time.perf_counter()
        if counter is not None:
            counter.phase = "forward"
        outputs = forward(x)
        if counter is not None:
            counter.phase = "backward"
        torch.autograd.backward(outputs, [grad_BTD] + [torch.ones_like(o) for o in outputs[1:]])
        middle = time.perf_counter()
        sync()
        return middle - start, time.perf_counter() - start

    return step


def all_reduce_mean(grads: list[torch.Tensor]) -> None:
    """Data parallelism's gradient average, as one flat all-reduce (one DDP bucket)."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    torch._foreach_copy_(
        grads, [p.view_as(g) for p, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
    )


def worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from moe_platform.parallel.expert_parallel import reduce_expert_gradients, shard_model
    from moe_platform.parallel.groups import build_expert_groups

    torch.set_num_threads(1)
    D, F, E, K, N = args.d_model, args.d_ff, args.experts, args.top_k, args.tokens
    config = MoEConfig(
        num_experts=E,
        top_k=K,
        expert_d_ff=F,
        capacity_factor=args.capacity_factor,
        router={"renormalize_topk": K > 1},  # top-1 keeps the raw gate (Switch), as DeepSpeed's top-1 does
    )
    torch.manual_seed(0)
    whole = MoELayer(D, config, "gelu").train()  # EP=1: every expert on every rank
    sharded = copy.deepcopy(whole)  # EP=2: the same weights, this rank's block of experts kept
    groups = build_expert_groups(EP)
    shard_model(sharded, groups)
    ep_rank = groups.expert_parallel.rank
    generator = torch.Generator().manual_seed(1000 + rank)
    x_BTD = torch.randn(args.batch, N // args.batch, D, generator=generator)
    grad_BTD = torch.randn(x_BTD.shape, generator=generator)

    def ours(layer):
        def forward(x):
            out = layer(x)
            return [out.output, out.aux_loss + out.z_loss]

        return forward

    def sync_ep():
        all_reduce_mean([p.grad for n, p in sharded.named_parameters() if not moe_ep.is_expert_parameter(n)])
        reduce_expert_gradients(sharded, groups)  # the expert-data-parallel group has one rank here: a scale only

    steps = {
        "ours EP=1 (data parallel)": train_step(
            ours(whole), list(whole.parameters()), lambda: all_reduce_mean([p.grad for p in whole.parameters()])
        ),
        "ours EP=2": train_step(ours(sharded), list(sharded.parameters()), sync_ep),
    }
    result: dict = {"bytes": {}, "kept_off_rank": {}, "kept": {}}

    # 1. our bytes
    counter = OffRankBytes()
    with counter.counting():
        steps["ours EP=2"](x_BTD, grad_BTD, counter)
    result["bytes"]["ours"] = dict(counter.sent)
    result["kept_off_rank"]["ours"], result["off_rank_pairs"], result["kept"]["ours"] = our_routing(
        sharded, x_BTD, ep_rank
    )

    # 2. DeepSpeed's bytes
    result["deepspeed_error"] = None
    try:
        ds = build_deepspeed(whole, D, F, args.capacity_factor)
    except Exception as error:  # reported in the output instead of a comparison
        result["deepspeed_error"] = f"{type(error).__name__}: {error}"
    if result["deepspeed_error"] is None:
        last_kept = deepspeed_kept(ds, ep_rank, E)
        expert_names = {n for n, p in ds.named_parameters() if not getattr(p, "allreduce", True)}

        def forward_ds(x):
            output, l_aux, _ = ds(x)
            return [output, l_aux]

        def sync_ds():  # the gate is replicated; each expert lives on one rank (expert-data-parallel size 1)
            all_reduce_mean([p.grad for n, p in ds.named_parameters() if n not in expert_names])

        steps["deepspeed EP=2"] = train_step(forward_ds, list(ds.parameters()), sync_ds)
        counter = OffRankBytes()
        with counter.counting():
            steps["deepspeed EP=2"](x_BTD, grad_BTD, counter)
        result["bytes"]["deepspeed"] = dict(counter.sent)
        result["kept_off_rank"]["deepspeed"], result["kept"]["deepspeed"], result["deepspeed_capacity"] = last_kept()

    # 3. step times, round-robin; round 0 warms up
    times = {name: [] for name in steps}
    for round_idx in range(args.rounds + 1):
        for name, step in steps.items():
            elapsed = step(x_BTD, grad_BTD)
            if round_idx > 0:
                times[name].append(elapsed)
    slowest = torch.tensor([times[name] for name in steps], dtype=torch.float64)  # [contenders, rounds, 2]
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    result["times"] = {name: slowest[i].tolist() for i, name in enumerate(steps)}
    return result


def total(ranks: list[dict], key: str, phase: str, what: str = "tokens") -> int:
    """Bytes sent to the other rank, summed over both ranks."""
    return sum(r["bytes"][key].get((phase, what), 0) for r in ranks)


def report_bytes(ranks: list[dict], args: argparse.Namespace) -> None:
    D, E = args.d_model, args.experts
    row_bytes = D * 4  # float32
    print("\n1-2. bytes sent to the other rank per step, both ranks summed (MB = 1e6 B)")
    print("     ideal = each off-rank kept assignment's row once each way = 2 · (off-rank kept) · D · 4 B")
    print(f"  {'':<10s} {'off-rank kept':>13s} {'ideal':>10s} {'forward':>10s} {'fwd/ideal':>10s} {'backward':>10s}")
    contenders = ["ours"] + (["deepspeed"] if ranks[0]["deepspeed_error"] is None else [])
    for key in contenders:
        kept = sum(r["kept_off_rank"][key] for r in ranks)
        ideal = 2 * kept * row_bytes
        forward = total(ranks, key, "forward") + total(ranks, key, "forward", "counts")
        backward = total(ranks, key, "backward")
        print(
            f"  {key:<10s} {kept:>13d} {ideal / 1e6:>8.3f}MB {forward / 1e6:>8.3f}MB {forward / ideal:>10.4f} "
            f"{backward / 1e6:>8.3f}MB"
        )
    ours_kept = sum(r["kept_off_rank"]["ours"] for r in ranks)
    pairs = sum(r["off_rank_pairs"] for r in ranks)
    print(
        f"  ours: {total(ranks, 'ours', 'forward') / 1e6:.3f} MB of token rows + "
        f"{total(ranks, 'ours', 'forward', 'counts')} B of int64 counts (one even all-to-all of [EP, E/EP])"
    )
    print(
        f"  ours: the {ours_kept} off-rank assignments are {pairs} distinct (token, rank) pairs: sending a token once "
        f"per rank\n        (de-duplicating its K rows) would move {pairs / ours_kept:.3f} of this ideal"
    )
    if ranks[0]["deepspeed_error"] is not None:
        print(f"  deepspeed: not measured: {ranks[0]['deepspeed_error']}")
    else:
        capacity = ranks[0]["deepspeed_capacity"]
        padded = 2 * E * (EP - 1) * capacity * row_bytes
        ds_forward = total(ranks, "deepspeed", "forward")
        ds_kept = sum(r["kept_off_rank"]["deepspeed"] for r in ranks)
        ds_all, ours_all = (sum(r["kept"][key] for r in ranks) for key in ("deepspeed", "ours"))
        print(
            f"  deepspeed: each exchange sends its whole [E={E}, C={capacity}, D={D}] buffer, (EP-1)/EP of it "
            f"off-rank, whatever\n             the routing kept: 2 · E · (EP-1) · C · D · 4 B = {padded / 1e6:.3f} MB "
            f"(measured {ds_forward / 1e6:.3f} MB)"
        )
        print(
            f"  deepspeed: same router weights, its own drops (first choices before second ones; ours by position):\n"
            f"             kept {ds_all} vs ours {ours_all}"
            f" of {EP * args.tokens * args.top_k} assignments, off-rank {ds_kept} vs ours {ours_kept}; "
            f"its forward / our ideal = {ds_forward / (2 * ours_kept * row_bytes):.4f}"
        )
    print("  backward: both send the gradients of both exchanges back along the same splits, i.e. the same bytes again")


def report_times(ranks: list[dict], args: argparse.Namespace) -> None:
    times = ranks[0]["times"]
    baseline = "ours EP=1 (data parallel)"
    print(f"\n3. step time, slower rank of each round, {args.rounds} rounds: median (min-max) ms")
    print("   fwd+bwd: forward + backward, EP=2's all-to-alls included; + sync: then the gradient all-reduce that data")
    print("   parallelism needs (EP=1: router + all E experts; EP=2: router only, each expert block lives on one rank)")
    for name, rounds in times.items():
        cells = []
        for i in (0, 1):
            ms = [r[i] * 1e3 for r in rounds]
            cells.append(f"{statistics.median(ms):7.1f} ({min(ms):6.1f}-{max(ms):6.1f})")
        print(f"  {name:<26s} fwd+bwd {cells[0]}   + sync {cells[1]}")
    for name in [n for n in times if n != baseline]:
        for i, label in ((0, "fwd+bwd"), (1, "+ sync")):
            a, b = [r[i] for r in times[name]], [r[i] for r in times[baseline]]
            ratio, fastest = statistics.median(a) / statistics.median(b), min(a) / min(b)
            print(f"  {name} / {baseline}, {label:<7s}: median {ratio:.3f}, fastest rounds {fastest:.3f}")
    print("  (two CPU cores shared with other jobs, one thread per rank: these times are informative only)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--batch", type=int, default=4, help="a rank's tokens as [batch, tokens/batch, D]")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2, choices=(1, 2), help="DeepSpeed's MoE supports 1 or 2")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="N=512, F=512, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.d_ff, args.rounds = 512, 512, 3
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    print("Expert parallelism on 2 gloo ranks (127.0.0.1, 1 thread each): the bytes our token exchange and")
    print("DeepSpeed's send to the other rank against the ideal, then the step time of EP=2 against EP=1.")
    print(
        f"D={args.d_model} F={args.d_ff} E={args.experts} K={args.top_k} N={args.tokens} tokens/rank, "
        f"capacity factor {args.capacity_factor}, float32, gelu experts, EP={EP}"
    )
    print(f"reproduce: .venv/bin/python bench/expert_parallel.py {' '.join(sys.argv[1:])}".rstrip())
    started = time.perf_counter()
    ranks = run_distributed(worker, 2, args, timeout=600)
    elapsed = time.perf_counter() - started
    report_bytes(ranks, args)
    report_times(ranks, args)
    print(f"\n{elapsed:.1f} s for the two ranks (spawn, imports, measurement)")


if __name__ == "__main__":
    main()
