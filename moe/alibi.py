"""ALiBi: attention with linear biases (Press et al., 2022; seed 001 on position encodings).

No position is added to the embeddings. Head h adds -m_h · (i - j) to the score of query position i on key j ≤ i,
so a score depends on the distance i - j only, never on where the pair sits in the sequence:

    A_h = softmax(q_i · k_j / √d - m_h · (i - j) + M)

Slopes: for H a power of two, m_h = 2^(-8h/H), h = 1 … H (the geometric sequence starting at 2^(-8/H)). For other H
the paper takes the H' = 2^⌊log₂ H⌋ slopes of H' heads, then the first H - H' of the odd-indexed slopes of 2H'
heads (those that fall between the first set's).
"""

import math

import torch


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The H slopes m_h (float64), as in the paper's reference implementation."""

    def power_of_two_slopes(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if n_heads & (n_heads - 1) == 0:
        slopes = power_of_two_slopes(n_heads)
    else:
        base = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two_slopes(base) + power_of_two_slopes(2 * base)[0::2][: n_heads - base]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_bias(
    query_positions_T: torch.Tensor, key_length: int, n_heads: int, dtype: torch.dtype, allowed: torch.Tensor | None
) -> torch.Tensor:
    """Additive score bias (B or 1, H, T, S): -m_h · (p_i - j) where `allowed` (the boolean mask of
    `build_attention_mask`, or plain causal when None) permits, -inf elsewhere."""
    key_positions_S = torch.arange(key_length, device=query_positions_T.device)
    distance_TS = (query_positions_T[:, None] - key_positions_S[None, :]).to(torch.float64)
    slopes_H = alibi_slopes(n_heads).to(query_positions_T.device)
    bias_HTS = (-slopes_H[:, None, None] * distance_TS[None]).to(dtype)
    if allowed is None:
        allowed = (distance_TS >= 0)[None, None]
    return bias_HTS[None].masked_fill(~allowed, float("-inf"))
