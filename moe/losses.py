"""Auxiliary router losses of one MoE layer, each already multiplied by its coefficient.

Legend: N tokens, E experts, K experts per token, G balancing groups (1 per micro-batch, or one per sequence),
W data-parallel ranks.

Load balancing (Switch, normalised so that perfectly balanced routing gives exactly coef):
    L_bal = coef · E / (K · N²) · Σ_i (Σ_t p_ti) · c_i
with p the full fp32 router distribution before top-k and c_i the assignments routed to expert i before any
capacity drop (under aux-loss-free bias balancing: by the router's unbiased top-k, see router.py). c_i comes
from the discrete top-k, so it carries no gradient; the router learns only through p.
Balanced: Σ_t p_ti = N/E and c_i = K·N/E for every i, so the sum is K·N²/E and L_bal = coef.
Each layer's loss uses that layer's own p and c: pooling logits across layers is a different (and, per
users of that form, wrong) objective.

Global scope (Megatron-Core's global_aux_loss): balance is enforced on the tokens of all W ranks, not on each
rank's few. Per micro-batch, c_i and N are summed over the ranks (an all-reduce; no gradient) while P_i = Σ_t p_ti
stays each rank's own, and rank r's loss is its share
    L_r = W · coef · E / (K · N²) · Σ_i P_i^r · c_i,   so that   mean_r L_r = L_bal(the W micro-batches pooled)
and the data-parallel gradient average optimises exactly the pooled loss. Why per micro-batch, not summed over the
step's micro-batches so far as Megatron does: a micro-batch's loss is complete when it is computed, every
micro-batch is weighted alike whatever its place in the accumulation, and the value equals the 1-process loss on
the concatenated batch; a running sum would weigh the first micro-batch's probabilities against fewer counts than
the last's.

Router z-loss (ST-MoE): L_z = coef · mean_t (logsumexp_j x_tj)², which keeps logits small for fp32 stability.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def load_balancing_loss(
    probs_NE: torch.Tensor,
    topk_ids_NK: torch.Tensor,
    *,
    coef: float,
    group_ids_N: torch.Tensor | None = None,
    num_groups: int = 1,
) -> torch.Tensor:
    """L_bal over the micro-batch, or (with group_ids_N) the mean over groups of each group's own L_bal.

    Groups are sequences for DeepSeek-style sequence-wise balance: group g uses only its own tokens, so N
    in the formula is that sequence's token count. Empty groups are left out of the mean.
    """
    num_tokens, num_experts = probs_NE.shape
    top_k = topk_ids_NK.shape[1]
    if group_ids_N is None:  # one group: the same formula without the per-group scatter and gathers
        with torch.no_grad():
            counts_E = _histogram(topk_ids_NK.reshape(-1), num_experts).to(probs_NE.dtype)
        scale = num_experts / (top_k * max(num_tokens, 1) ** 2)
        return coef * scale * (probs_NE.sum(dim=0) * counts_E).sum()
    prob_mass_GE = probs_NE.new_zeros(num_groups, num_experts).index_add(0, group_ids_N, probs_NE)
    with torch.no_grad():  # histograms by index_add, counts kept on the device: nothing here reads to the host
        flat_GE = group_ids_N.repeat_interleave(top_k) * num_experts + topk_ids_NK.reshape(-1)
        counts_GE = _histogram(flat_GE, num_groups * num_experts).view(num_groups, num_experts)
        tokens_G = _histogram(group_ids_N, num_groups)
        scale_G = num_experts / (top_k * tokens_G.clamp(min=1).to(probs_NE.dtype) ** 2)
        num_nonempty = (tokens_G > 0).sum().clamp(min=1)
    per_group_G = scale_G * (prob_mass_GE * counts_GE.to(probs_NE.dtype)).sum(dim=-1)  # empty groups give 0
    return coef * per_group_G.sum() / num_nonempty


def _histogram(ids_I: torch.Tensor, size: int) -> torch.Tensor:
    """bincount(ids, minlength=size) for ids < size, without bincount's read of max(ids) to the host on CUDA."""
    return ids_I.new_zeros(size).index_add_(0, ids_I, torch.ones_like(ids_I))


def global_load_balancing_loss(
    probs_NE: torch.Tensor, topk_ids_NK: torch.Tensor, *, coef: float, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's share L_r of the balancing loss over the micro-batches of every rank in `group` (default: all
    ranks). Collective: every rank of the group must call it once per training micro-batch. Without an initialised
    process group it is `load_balancing_loss` on the local micro-batch."""
    if not (dist.is_available() and dist.is_initialized()) or coef == 0:
        return load_balancing_loss(probs_NE, topk_ids_NK, coef=coef)
    num_tokens, num_experts = probs_NE.shape
    top_k = topk_ids_NK.shape[1]
    with torch.no_grad():
        counts_and_tokens = torch.cat(
            [
                _histogram(topk_ids_NK.reshape(-1), num_experts),
                torch.full((1,), num_tokens, dtype=topk_ids_NK.dtype, device=probs_NE.device),
            ]
        )
        dist.all_reduce(counts_and_tokens, group=group)
        counts_E = counts_and_tokens[:num_experts].to(probs_NE.dtype)
        # Kept on the device (no host read); with no tokens anywhere every count is 0, so the loss is 0.
        total_tokens = counts_and_tokens[num_experts].clamp(min=1).to(probs_NE.dtype)
        world = dist.get_world_size(group)
    prob_mass_E = probs_NE.sum(dim=0)
    return world * coef * num_experts / top_k * (prob_mass_E * counts_E).sum() / total_tokens**2


def router_z_loss(logits_NE: torch.Tensor, *, coef: float) -> torch.Tensor:
    """L_z = coef · mean over tokens of logsumexp(logits)²; zero for an empty micro-batch."""
    squared_N = torch.logsumexp(logits_NE, dim=-1).square()
    return coef * squared_N.sum() / max(logits_NE.shape[0], 1)
