"""Routed experts: E feed-forward networks stored as stacked weight tensors.

Legend: A assignments (tokens already grouped by expert), c the rows of one expert's slice, D model width,
F expert hidden width, E experts.

GELU expert:   y = GELU(x w_up[e]) w_down[e]
SwiGLU expert: y = (SiLU(x w_gate[e]) ⊙ x w_up[e]) w_down[e]
Stacked [E, D, F] / [E, F, D] tensors (not E nn.Linear modules) keep one parameter per projection, which is
what expert parallelism shards along E and what checkpoint converters expect (Mixtral, OLMoE, torchtitan).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe.ffn import ACTIVATIONS


class GroupedExperts(nn.Module):
    """Runs expert e on the e-th contiguous slice of its input; slice lengths come from the dispatch plan."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, activation: str, init_std: float = 0.02):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
        self.activation = activation
        self.init_std = init_std
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, d_ff)) if activation == "swiglu" else None
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            if w is not None:
                nn.init.normal_(w, mean=0.0, std=self.init_std)

    def forward(self, x_AD: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        # unbind once: indexing w[e] per expert would make autograd build E full-size zero gradients.
        w_up_EDF = self.w_up.unbind(0)
        w_down_EFD = self.w_down.unbind(0)
        w_gate_EDF = self.w_gate.unbind(0) if self.w_gate is not None else None
        y_pieces = []
        for e, x_cD in enumerate(torch.split(x_AD, tokens_per_expert)):
            if x_cD.shape[0] == 0:
                continue  # an idle expert costs nothing (its weight gradient is zero)
            if w_gate_EDF is not None:
                h_cF = F.silu(x_cD @ w_gate_EDF[e]) * (x_cD @ w_up_EDF[e])
            else:
                h_cF = F.gelu(x_cD @ w_up_EDF[e])
            y_pieces.append(h_cF @ w_down_EFD[e])
        if not y_pieces:
            return x_AD.new_zeros(0, self.w_down.shape[-1])
        return torch.cat(y_pieces, dim=0)
