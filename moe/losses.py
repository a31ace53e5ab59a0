"""Auxiliary router losses of one MoE layer, each already multiplied by its coefficient.

Legend: N tokens, E experts, K experts per token, G balancing groups (1 per micro-batch, or one per sequence).

Load balancing (Switch, normalised so that perfectly balanced routing gives exactly coef):
    L_bal = coef · E / (K · N²) · Σ_i (Σ_t p_ti) · c_i
with p the full fp32 router distribution before top-k and c_i the assignments routed to expert i before any
capacity drop (under aux-loss-free bias balancing: by the router's unbiased top-k, see router.py). c_i comes
from the discrete top-k, so it carries no gradient; the router learns only through p.
Balanced: Σ_t p_ti = N/E and c_i = K·N/E for every i, so the sum is K·N²/E and L_bal = coef.
Each layer's loss uses that layer's own p and c: pooling logits across layers is a different (and, per
users of that form, wrong) objective.

Router z-loss (ST-MoE): L_z = coef · mean_t (logsumexp_j x_tj)², which keeps logits small for fp32 stability.
"""

from __future__ import annotations

import torch


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
    if group_ids_N is None:
        group_ids_N = torch.zeros(num_tokens, dtype=torch.long, device=probs_NE.device)
    prob_mass_GE = probs_NE.new_zeros(num_groups, num_experts).index_add(0, group_ids_N, probs_NE)
    with torch.no_grad():
        flat_GE = group_ids_N.repeat_interleave(top_k) * num_experts + topk_ids_NK.reshape(-1)
        counts_GE = torch.bincount(flat_GE, minlength=num_groups * num_experts).view(num_groups, num_experts)
        tokens_G = torch.bincount(group_ids_N, minlength=num_groups)
        scale_G = num_experts / (top_k * tokens_G.clamp(min=1).to(probs_NE.dtype) ** 2)
        num_nonempty = int((tokens_G > 0).sum())
    per_group_G = scale_G * (prob_mass_GE * counts_GE.to(probs_NE.dtype)).sum(dim=-1)  # empty groups give 0
    return coef * per_group_G.sum() / max(num_nonempty, 1)


def router_z_loss(logits_NE: torch.Tensor, *, coef: float) -> torch.Tensor:
    """L_z = coef · mean over tokens of logsumexp(logits)²; zero for an empty micro-batch."""
    squared_N = torch.logsumexp(logits_NE, dim=-1).square()
    return coef * squared_N.sum() / max(logits_NE.shape[0], 1)
