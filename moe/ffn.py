"""Position-wise feed-forward networks: the dense FFN of a block and of a shared expert.

Legend: B batch, T tokens, D model width, F hidden (feed-forward) width.

GELU:   FFN(x) = GELU(x W_up) W_down
SwiGLU: FFN(x) = (SiLU(x W_gate) ⊙ (x W_up)) W_down     (seed 000, "RMSNorm与门控前馈")
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("gelu", "swiglu")


def ffn_num_params(d_model: int, d_ff: int, activation: str, bias: bool = False) -> int:
    """Parameters of one dense FFN: 2·D·F weights for GELU, 3·D·F for SwiGLU (plus biases)."""
    n_up_projections = 2 if activation == "swiglu" else 1
    weights = (n_up_projections + 1) * d_model * d_ff
    biases = (n_up_projections * d_ff + d_model) if bias else 0
    return weights + biases


def ffn_matmul_flops_per_token(d_model: int, d_ff: int, activation: str) -> int:
    """Forward matmul FLOPs per token (one multiply + one add = 2 FLOPs): 2·D·F per projection."""
    n_projections = 3 if activation == "swiglu" else 2
    return n_projections * 2 * d_model * d_ff


class FeedForward(nn.Module):
    """A dense FFN; `activation` picks the two-projection GELU or the gated three-projection SwiGLU."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = False) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
        self.activation = activation
        self.w_gate = nn.Linear(d_model, d_ff, bias=bias) if activation == "swiglu" else None
        self.w_up = nn.Linear(d_model, d_ff, bias=bias)
        self.w_down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
        if self.w_gate is not None:
            hidden = F.silu(self.w_gate(x)) * self.w_up(x)  # (..., F)
        else:
            hidden = F.gelu(self.w_up(x))  # (..., F)
        return self.w_down(hidden)
