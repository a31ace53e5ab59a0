"""Rotary position embedding (seed 000, "RoPE：把相对位置写进查询与键的点积").

Coordinate pair i of a head is rotated by the angle m·ω_i at absolute position m, with ω_i = θ^(-2i/d_h).
Because R(a)ᵀR(b) = R(b - a), the score (R_m q)·(R_n k) depends only on n - m.

Pairing convention: coordinate i is paired with i + d_h/2 (the GPT-NeoX / Llama "rotate half" layout), so
weights move between this model and Llama-style checkpoints without permuting Q/K rows. Only Q and K are
rotated, never V.
"""

import torch


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """ω_i = θ^(-2i/d_h) for i = 0 … d_h/2 - 1, in float64 so long positions keep their precision."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis: multiplication by the 90° rotation."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(
    positions_T: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of m·ω_i for each position m, laid out as (T, d_h) to match `rotate_half`.

    Computed per forward from integer positions rather than stored as a buffer: `module.bfloat16()` would round
    a stored table to 8 bits of mantissa, and the angles need at least fp32 (fp64 when the model runs in fp64).
    """
    compute_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    frequencies = rope_frequencies(head_dim, theta).to(device=positions_T.device, dtype=compute_dtype)
    angles_TP = positions_T.to(compute_dtype)[:, None] * frequencies[None, :]
    angles_Td = torch.cat((angles_TP, angles_TP), dim=-1)  # both halves of a pair share one angle
    return angles_Td.cos().to(dtype), angles_Td.sin().to(dtype)


def apply_rope(x_BHTd: torch.Tensor, cos_Td: torch.Tensor, sin_Td: torch.Tensor) -> torch.Tensor:
    """Rotate every coordinate pair of every head of Q or K by its position's angle."""
    return x_BHTd * cos_Td + rotate_half(x_BHTd) * sin_Td
