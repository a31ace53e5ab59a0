"""Dispatch: group the (token, expert) assignments by expert, apply capacity, and combine expert outputs back.

Legend: N tokens, D model width, E experts, K experts per token, A kept assignments (N·K when nothing is
dropped), C capacity (assignments one expert accepts per micro-batch).

Instead of GShard's dense [N, E, C] one-hot dispatch/combine einsums, the N·K assignments are sorted by expert
id, so each expert sees one contiguous slice of gathered tokens and only real assignments are computed.
Capacity is a cut of each expert's slice after ordering it by priority. A dropped assignment has no row: its
slot points at a zero row, so it contributes exactly zero and, if all K are dropped, the token rides the
residual unchanged.

Both data movements are gathers in forward *and* backward (custom autograd functions below): autograd's own
backward of an index gather is a scatter-add, which on CPU costs several times a gather of the same rows.
The combine's weighted sum is elementwise (no [1, K] x [K, D] bmm per token), so the layer's forward FLOPs are
matmuls only, as `MoEConfig.matmul_flops_per_token` and the ledger count them.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import torch


def expert_capacity(
    num_tokens: int, *, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int = 0
) -> int:
    """C = max(ceil(K · capacity_factor · N / E), min_capacity), the Switch/GShard static capacity."""
    # The factor is read as the decimal the user wrote (1.1, not 1.100000000000000089) so that e.g.
    # K=2, cf=1.1, N=10, E=2 gives exactly 11 rather than ceil(11.000000000000002) = 12.
    slots = Fraction(top_k * num_tokens, num_experts) * Fraction(repr(float(capacity_factor)))
    return max(math.ceil(slots), min_capacity)


class DispatchPlan(NamedTuple):
    """Where every assignment goes. Kept assignments are grouped by expert (expert 0's slice first)."""

    token_ids_A: torch.Tensor  # int64 token of each kept assignment
    slot_NK: torch.Tensor  # int64 row of assignment (n, k) among the kept ones, or A if it was dropped
    assignment_ids_A: torch.Tensor  # int64 flat index n·K + k of each kept assignment (inverse of slot_NK)
    tokens_per_expert_before_E: torch.Tensor  # int64 assignments routed to each expert, before capacity
    tokens_per_expert_after_E: torch.Tensor  # int64 assignments each expert computes (= slice lengths)
    tokens_per_expert_after: list[int]  # the same on the host: the plan's one device-to-host read


@torch.no_grad()
def plan_dispatch(
    topk_ids_NK: torch.Tensor,
    gates_NK: torch.Tensor,
    *,
    num_experts: int,
    capacity: int | None = None,
    drop_policy: str = "position",
) -> DispatchPlan:
    """Sort assignments by expert; with a capacity keep each expert's first C by priority, drop the rest.

    Priority within an expert: "position" keeps the earliest tokens of the flattened micro-batch (Switch,
    Megatron); "probs" keeps the assignments with the largest gates (ties: earlier token first); "choice" keeps
    every token's k-th choice before any token's (k+1)-th, earlier tokens first within a choice (GShard's top-2,
    DeepSpeed's top2gating).
    """
    num_tokens, top_k = topk_ids_NK.shape
    expert_ids_A = topk_ids_NK.reshape(-1)  # assignment a = n·K + k
    if capacity is not None and drop_policy == "probs":
        by_gate_A = torch.argsort(gates_NK.reshape(-1), descending=True, stable=True)
        order_A = by_gate_A[torch.argsort(expert_ids_A[by_gate_A], stable=True)]
    elif capacity is not None and drop_policy == "choice":
        by_choice_J = torch.argsort(topk_ids_NK.t().reshape(-1), stable=True)  # j = k·N + n, grouped by expert
        order_A = (by_choice_J % num_tokens) * top_k + by_choice_J.div(num_tokens, rounding_mode="floor")
    else:  # no capacity, or "position" (MoEConfig admits no other drop_policy)
        order_A = torch.argsort(expert_ids_A, stable=True)  # stable: token order within an expert

    # A histogram by index_add, not bincount: on CUDA bincount reads its input's max to the host first.
    before_E = expert_ids_A.new_zeros(num_experts).index_add_(0, expert_ids_A, torch.ones_like(expert_ids_A))
    after_E = before_E if capacity is None else before_E.clamp(max=capacity)
    # The one device-to-host read of the layer: the experts' split sizes (and so the number of kept rows) must be
    # Python ints. Everything else stays on the device (no boolean-mask indexing, no bincount, no .item()).
    after = after_E.tolist()
    num_kept = sum(after)
    if capacity is not None:
        start_E = torch.cumsum(before_E, dim=0) - before_E
        rank_A = torch.arange(order_A.numel(), device=order_A.device) - start_E[expert_ids_A[order_A]]
        order_A = order_A[torch.nonzero_static(rank_A < capacity, size=num_kept).squeeze(1)]

    slot_flat = torch.full((num_tokens * top_k,), num_kept, dtype=torch.long, device=order_A.device)
    slot_flat[order_A] = torch.arange(num_kept, device=order_A.device)
    token_ids_A = order_A.div(top_k, rounding_mode="floor")
    return DispatchPlan(token_ids_A, slot_flat.view(num_tokens, top_k), order_A, before_E, after_E, after)


def dispatch(x_ND: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """x_AD: each kept assignment's token, grouped by expert."""
    return _DispatchRows.apply(x_ND, plan.token_ids_A, plan.slot_NK)


def combine(y_AD: torch.Tensor, gates_NK: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """out_n = Σ_k g_nk · y[slot_nk]; a dropped (n, k) reads a zero row, so it contributes exactly 0."""
    return _Combine.apply(y_AD, gates_NK, plan.slot_NK, plan.token_ids_A, plan.assignment_ids_A)


class _Combine(torch.autograd.Function):
    """out_n = Σ_k g_nk · y[slot_nk], with a hand-written backward.

    Backward: grad_y for kept assignment a is g_a · grad_out[token_a] (a gather: each kept row feeds exactly one
    (n, k)), and grad_g_nk = <y[slot_nk], grad_out_n> (a batched mat-vec). Autograd's version of the same sum
    broadcasts two [N, K, D] products and reduces them, which measured ~5% of the whole layer's step here.
    """

    @staticmethod
    def forward(ctx, y_AD, gates_NK, slot_NK, token_ids_A, assignment_ids_A):
        num_tokens, top_k = slot_NK.shape
        if y_AD.shape[0] < num_tokens * top_k:
            y_AD = _with_zero_row(y_AD)
        y_NKD = y_AD.index_select(0, slot_NK.reshape(-1)).view(num_tokens, top_k, y_AD.shape[-1])
        g_NK = gates_NK.to(y_NKD.dtype)
        out_ND = y_NKD[:, 0] * g_NK[:, :1]
        for k in range(1, top_k):
            out_ND.addcmul_(y_NKD[:, k], g_NK[:, k : k + 1])
        ctx.save_for_backward(y_NKD, g_NK, token_ids_A, assignment_ids_A)
        ctx.gates_dtype = gates_NK.dtype
        return out_ND

    @staticmethod
    def backward(ctx, grad_ND):
        y_NKD, g_NK, token_ids_A, assignment_ids_A = ctx.saved_tensors
        grad_gates_NK = (y_NKD @ grad_ND.unsqueeze(-1)).squeeze(-1).to(ctx.gates_dtype)
        grad_y_AD = grad_ND.index_select(0, token_ids_A)
        grad_y_AD.mul_(g_NK.reshape(-1).index_select(0, assignment_ids_A).unsqueeze(-1))
        return grad_y_AD, grad_gates_NK, None, None, None


def _with_zero_row(t_RD: torch.Tensor) -> torch.Tensor:
    return torch.cat([t_RD, t_RD.new_zeros(1, t_RD.shape[1])])


class _DispatchRows(torch.autograd.Function):
    """out_A = x[token_ids_A]; the gradient of token n is Σ_k grad[slot_nk], itself a gather (then a sum)."""

    @staticmethod
    def forward(ctx, x_ND, token_ids_A, slot_NK):
        ctx.save_for_backward(slot_NK)
        return x_ND.index_select(0, token_ids_A)

    @staticmethod
    def backward(ctx, grad_AD):
        (slot_NK,) = ctx.saved_tensors
        num_tokens, top_k = slot_NK.shape
        if grad_AD.shape[0] < num_tokens * top_k:  # some assignments were dropped: they read the zero row
            grad_AD = _with_zero_row(grad_AD)
        # K gathers added in place: cheaper than one [N, K, D] gather reduced over its middle dimension.
        grad_ND = grad_AD.index_select(0, slot_NK[:, 0].contiguous())
        for k in range(1, top_k):
            grad_ND.add_(grad_AD.index_select(0, slot_NK[:, k].contiguous()))
        return grad_ND, None, None
