"""Blocked ("online") softmax attention for one query row at a time (seed 000, "在线softmax").

Reads the keys in blocks and keeps three running quantities — the running max m, the rescaled denominator
a = Σ e^(s_i - m) and the rescaled numerator o = Σ e^(s_i - m) v_i — so the full row of probabilities is never
stored. When a block raises the max to m', the old a and o are multiplied by e^(m - m') before the block's terms
are added, which keeps the invariant exact; o / a at the end is the dense attention output.

This is a reference of the mechanism (what FlashAttention tiles on a GPU), used by the tests to check it against
the dense softmax; the model itself calls scaled_dot_product_attention.
"""

import math

import torch


def online_softmax_attention(
    scores_TS: torch.Tensor, values_SD: torch.Tensor, allowed_TS: torch.Tensor | None = None, block_size: int = 4
) -> torch.Tensor:
    """softmax(scores over allowed keys) @ values, computed block by block over S. Returns (T, D)."""
    T, S = scores_TS.shape
    if allowed_TS is None:
        allowed_TS = torch.ones(T, S, dtype=torch.bool, device=scores_TS.device)
    if not bool(allowed_TS.any(dim=-1).all()):
        raise ValueError("a query row has no allowed key: its softmax is undefined, so the mask must allow one key")
    # Disallowed keys enter as -inf scores: e^(-inf - m) = 0 for any finite running max m.
    scores_TS = scores_TS.masked_fill(~allowed_TS, -math.inf)
    running_max_T = torch.full((T,), -math.inf, dtype=scores_TS.dtype, device=scores_TS.device)
    denominator_T = torch.zeros(T, dtype=scores_TS.dtype, device=scores_TS.device)
    numerator_TD = torch.zeros(T, values_SD.shape[1], dtype=scores_TS.dtype, device=scores_TS.device)
    for start in range(0, S, block_size):
        block_TB = scores_TS[:, start : start + block_size]
        new_max_T = torch.maximum(running_max_T, block_TB.max(dim=-1).values)
        # Rows that have seen only disallowed keys so far keep max -inf; their rescale is 0 and terms are 0.
        safe_max_T = torch.where(torch.isinf(new_max_T), torch.zeros_like(new_max_T), new_max_T)
        rescale_T = torch.exp(running_max_T - safe_max_T)
        weights_TB = torch.exp(block_TB - safe_max_T[:, None])
        denominator_T = rescale_T * denominator_T + weights_TB.sum(dim=-1)
        numerator_TD = rescale_T[:, None] * numerator_TD + weights_TB @ values_SD[start : start + block_size]
        running_max_T = new_max_T
    return numerator_TD / denominator_T[:, None]
