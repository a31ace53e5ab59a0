"""Expert parallelism in the runtime: each rank keeps its block of every MoE layer's experts, their gradients are
reduced over the ranks holding the same block, and the global norm counts every block once. The process groups are
in groups.py (EP groups of consecutive ranks, EDP groups of the ranks that hold one block); DeepSpeed's side of it in
deepspeed_experts.py. Non-expert weights stay data-parallel over all W ranks (DDP or ZeRO as configured).

Gradients under DDP. Every rank's loss L_r is a mean over its own tokens and DDP averages the replicated weights'
gradients: g = (1/W) Σ_r ∂L_r/∂θ. An expert's local gradient already sums the losses of the EP group's ranks (the
backward all-to-all brings them home), so summing it over the EDP group covers all W ranks once:
    g_expert = (1/W) Σ_{q in EDP} local_grad_q
which `reduce_expert_gradients` computes; DDP is told to leave the expert weights alone.
The global gradient norm adds each distinct expert block once: ‖g‖² = ‖g_replicated‖² + Σ_{p in EP} ‖g_block p‖².
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from moe import MoELayer
from moe.expert_parallel import ExpertParallel, expert_parameters, is_expert_parameter
from moe_platform.parallel.groups import ExpertParallelGroups, build_expert_groups


def shard_experts(model: nn.Module, expert_parallel: ExpertParallel) -> None:
    """Keep only this rank's block of every MoE layer's experts and route their work through `expert_parallel`.

    The model was built whole, so its weights are the EP=1 weights whatever the EP size (the same run at any EP
    starts from the same point); the other blocks are freed here. The router and shared experts stay replicated.
    """
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        num_experts = module.config.num_experts
        if num_experts % expert_parallel.size != 0:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {expert_parallel.size} EP ranks")
        block = expert_parallel.local_experts(num_experts)
        for name, weight in list(module.experts.named_parameters(recurse=False)):
            local = weight.detach()[block.start : block.stop].clone()
            setattr(module.experts, name, nn.Parameter(local, requires_grad=weight.requires_grad))
        module.expert_parallel = expert_parallel


def shard_model(model: nn.Module, groups: ExpertParallelGroups) -> None:
    """Keep this rank's expert block, and keep DDP's all-reduce (over all W ranks) off the expert weights."""
    shard_experts(model, groups.expert_parallel)
    # DDP reads this attribute of the module it wraps when it is built.
    model._ddp_params_and_buffers_to_ignore = [name for name, _ in expert_parameters(model)]


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, groups: ExpertParallelGroups) -> None:
    """g_expert = (1/W) Σ_{EDP} local_grad: call after the step's last backward, before clipping."""
    grads = [p.grad for _, p in expert_parameters(model) if p.grad is not None]
    sum_and_divide(grads, groups.data_group if groups.data_size > 1 else None, groups.world_size)


@torch.no_grad()
def sum_and_divide(grads: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: int) -> None:
    """g ← (Σ_group g) / divisor for every tensor of `grads`, in one all-reduce of one flat buffer (none when
    `group` is None: a group of one)."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.div_(divisor)
    pieces = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(pieces, grads, strict=True)])


@torch.no_grad()
def clip_grad_norm(
    model: nn.Module,
    max_norm: float,
    groups: ExpertParallelGroups | None,
    stages_group: dist.ProcessGroup | None = None,
    uncounted: frozenset[str] = frozenset(),
) -> float:
    """Scale all gradients so the global norm is at most `max_norm` (torch's clipping rule, as without EP);
    returns the norm before clipping. Under pipeline parallelism the model holds one stage's weights, and
    `stages_group` (one rank per stage) adds the stages' squares:
        ‖g‖² = Σ_stages (‖g_replicated‖² + Σ_EP blocks ‖g_block‖²);
    the parameters named in `uncounted` are another stage's copies (the embedding under MTP): clipped, not counted."""
    replicated, experts = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (experts if is_expert_parameter(name) else replicated).append(p)
    device = next(model.parameters()).device
    copies = {id(p) for name, p in model.named_parameters() if name in uncounted}
    replicated_sq = _sum_of_squares([p for p in replicated if id(p) not in copies], device)
    expert_sq = _sum_of_squares(experts, device)
    if groups is not None and groups.expert_parallel.size > 1:
        dist.all_reduce(expert_sq, group=groups.expert_parallel.group)
    total_sq = replicated_sq + expert_sq
    if stages_group is not None:
        dist.all_reduce(total_sq, group=stages_group)
    total = total_sq.sqrt()
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(replicated + experts, max_norm, total)
    return float(total)


def _sum_of_squares(parameters: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    if not parameters:  # a rank whose expert block got no gradient this step still joins the all-reduce
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([p.grad.double().pow(2).sum() for p in parameters]).sum()


def reduce_and_clip(model: nn.Module, max_norm: float, groups: ExpertParallelGroups) -> float:
    """The step's gradient sync for the experts (DDP did the rest), then global-norm clipping; the norm before."""
    reduce_expert_gradients(model, groups)
    return clip_grad_norm(model, max_norm, groups)


def attach(model: nn.Module, ep_size: int, deepspeed: bool) -> ExpertParallelGroups | None:
    """Collective, before the model is wrapped: build the groups and keep this rank's experts (None without EP)."""
    if ep_size == 1:
        return None
    if deepspeed:
        from moe_platform.parallel import deepspeed_experts

        groups = deepspeed_experts.build_groups(ep_size)
        shard_experts(model, groups.expert_parallel)
        deepspeed_experts.mark_experts(model, ep_size)
        return groups
    groups = build_expert_groups(ep_size)
    shard_model(model, groups)
    return groups
