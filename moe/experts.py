"""Routed experts: E feed-forward networks stored as stacked weight tensors.

Legend: A assignments (tokens already grouped by expert), c the rows of one expert's slice, D model width,
F expert hidden width, E experts (the local ones under expert parallelism), I/O in/out width of one projection.

GELU expert:   y = GELU(x w_up[e]) w_down[e]
SwiGLU expert: y = (SiLU(x w_gate[e]) ⊙ x w_up[e]) w_down[e]
Stacked [E, D, F] / [E, F, D] tensors (not E nn.Linear modules) keep one parameter per projection, which is
what expert parallelism shards along E and what checkpoint converters expect (Mixtral, OLMoE, torchtitan).

Two ways to run the E matmuls of one projection, with the same result: one `F.grouped_mm` over all slices
(offsets = int32 end row of each expert's slice), or a Python loop of E matmuls. See `GroupedExperts.forward`.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import flop_counter

from moe.ffn import ACTIVATIONS

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GroupedExperts(nn.Module):
    """Runs expert e on the e-th contiguous slice of its input; slice lengths come from the dispatch plan.

    `use_grouped_mm`: True runs every projection as one `F.grouped_mm` (and raises where it cannot run), False
    runs the per-expert loop, None (auto) uses grouped_mm wherever it can run (see `_grouped_mm_dtype`).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        activation: str,
        init_std: float = 0.02,
        use_grouped_mm: bool | None = None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
        self.activation = activation
        self.init_std = init_std
        self.use_grouped_mm = use_grouped_mm
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, d_ff)) if activation == "swiglu" else None
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            if w is not None:
                nn.init.normal_(w, mean=0.0, std=self.init_std)

    def forward(self, x_AD: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        num_experts, d_model, d_ff = self.w_up.shape
        if len(tokens_per_expert) != num_experts or sum(tokens_per_expert) != x_AD.shape[0]:
            # grouped_mm would leave rows past the last offset uninitialised rather than fail, so check here.
            raise ValueError(
                f"tokens_per_expert has {len(tokens_per_expert)} counts summing to {sum(tokens_per_expert)}: "
                f"pass one count per local expert ({num_experts}) summing to x_AD's {x_AD.shape[0]} rows"
            )
        # Auto prefers grouped_mm wherever it can run, CPU included: on CPU torch runs it as the same mm per slice
        # (results are bitwise equal to the loop), minus E autograd nodes per projection and the loop's stack of
        # per-expert weight gradients. Forward+backward CPU time (1 thread, median), grouped vs loop: moe_tiny-like
        # (D=96, F=128, E=4, A=4096) 32.0 vs 30.2 ms fp32 and 20.6 vs 20.8 ms bf16, ties within this shared
        # machine's noise; moe_small-like (D=512, F=1408, E=8, A=512) 141 vs 175 ms. On CUDA torch's source runs
        # bf16 on SM90+ as one kernel instead of E launches and other cases as its own loop (not measured here).
        dtype = self._grouped_mm_dtype(x_AD) if self.use_grouped_mm is not False else None
        if self.use_grouped_mm and dtype is None:
            raise ValueError(
                f"use_grouped_mm=True, but grouped_mm cannot run on {x_AD.dtype} input with d_model={d_model}, "
                f"d_ff={d_ff}: it needs float32/bfloat16/float16 (bfloat16 under torch.compile, fake or meta "
                "tensors) and both widths a multiple of 16 bytes; "
                "use use_grouped_mm=None to fall back to the per-expert loop"
            )
        if dtype is not None:
            return self._forward_grouped(x_AD, tokens_per_expert, dtype)
        return self._forward_loop(x_AD, tokens_per_expert)

    def _grouped_mm_dtype(self, x_AD: torch.Tensor) -> torch.dtype | None:
        """The dtype the loop's matmuls would run in, if grouped_mm can run in it too; None where it cannot."""
        if not hasattr(F, "grouped_mm"):  # torch < 2.9
            return None
        device = x_AD.device.type
        dtypes = {x_AD.dtype, self.w_up.dtype}
        # grouped_mm is not on autocast's cast list, so do by hand what autocast does to the loop's matmuls:
        # cast fp32/fp16/bf16 operands to its dtype (fp64 it leaves alone).
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # False on meta
        if autocast and torch.float64 not in dtypes:
            dtypes = {torch.get_autocast_dtype(device)}
        dtype = dtypes.pop()
        if dtypes or dtype not in _GROUPED_MM_DTYPES:
            return None
        # grouped_mm's kernels read every row stride as a multiple of 16 bytes ("strides should be multiple of
        # 16 bytes"); the operands here and in backward have row strides D and F.
        if (self.w_up.shape[1] * dtype.itemsize) % 16 or (self.w_up.shape[2] * dtype.itemsize) % 16:
            return None
        # Its meta kernel, which torch.compile, fake and meta tensors run instead of the real one, accepts only bf16.
        traced = torch.compiler.is_compiling() or any(t.is_meta or isinstance(t, FakeTensor) for t in (x_AD, self.w_up))
        if traced and dtype != torch.bfloat16:
            return None
        return dtype

    def _forward_grouped(self, x_AD: torch.Tensor, tokens_per_expert: list[int], dtype: torch.dtype):
        # offs_E: the end row of each expert's slice; an idle expert's end equals the previous one.
        offs_E = torch.tensor(list(itertools.accumulate(tokens_per_expert)), dtype=torch.int32, device=x_AD.device)
        x_AD = x_AD.to(dtype)
        if self.w_gate is not None:
            gate_AF = _GroupedMatmul.apply(x_AD, self.w_gate.to(dtype), offs_E)
            h_AF = F.silu(gate_AF) * _GroupedMatmul.apply(x_AD, self.w_up.to(dtype), offs_E)
        else:
            h_AF = F.gelu(_GroupedMatmul.apply(x_AD, self.w_up.to(dtype), offs_E))
        return _GroupedMatmul.apply(h_AF, self.w_down.to(dtype), offs_E)

    def _forward_loop(self, x_AD: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        # unbind once: indexing w[e] per expert would make autograd build E full-size zero gradients.
        w_up_EDF = self.w_up.unbind(0)
        w_down_EFD = self.w_down.unbind(0)
        w_gate_EDF = self.w_gate.unbind(0) if self.w_gate is not None else None
        y_pieces = []
        for e, x_cD in enumerate(torch.split(x_AD, tokens_per_expert)):
            # An idle expert costs nothing (its weight gradient is zero). With no rows at all every expert runs on
            # its empty slice, so the [0, D] output stays in the graph and backward works, as in the grouped path.
            if x_cD.shape[0] == 0 and x_AD.shape[0] > 0:
                continue
            if w_gate_EDF is not None:
                h_cF = F.silu(x_cD @ w_gate_EDF[e]) * (x_cD @ w_up_EDF[e])
            else:
                h_cF = F.gelu(x_cD @ w_up_EDF[e])
            y_pieces.append(h_cF @ w_down_EFD[e])
        return torch.cat(y_pieces, dim=0)


class _GroupedMatmul(torch.autograd.Function):
    """y_c = x_c w[e] for every expert e and its slice c of rows; offs_E holds each slice's int32 end row.

    Backward is two more grouped matmuls: grad_x_c = grad_y_c w[e]ᵀ and grad_w[e] = x_cᵀ grad_y_c (zero for an
    idle expert). Written out, not left to grouped_mm's own backward, because that one rejects an incoming
    gradient whose rows are not 16-byte strided, such as the stride-0 expanded gradient of y.sum().
    """

    @staticmethod
    def forward(ctx, x_AI, w_EIO, offs_E):
        x_AI = _row_major(x_AI)
        ctx.save_for_backward(x_AI, w_EIO, offs_E)
        return F.grouped_mm(x_AI, w_EIO, offs=offs_E)

    @staticmethod
    def backward(ctx, grad_AO):
        x_AI, w_EIO, offs_E = ctx.saved_tensors
        grad_AO = _row_major(grad_AO)
        grad_x_AI = grad_w_EIO = None
        if ctx.needs_input_grad[0]:
            grad_x_AI = F.grouped_mm(grad_AO, w_EIO.transpose(1, 2), offs=offs_E)
        if ctx.needs_input_grad[1]:
            grad_w_EIO = F.grouped_mm(x_AI.t(), grad_AO, offs=offs_E)  # [I, A] x [A, O], A split by offs_E
        return grad_x_AI, grad_w_EIO, None


def _row_major(t_RC: torch.Tensor) -> torch.Tensor:
    """t with strides (C, 1), copied only if it has other strides: grouped_mm needs 16-byte row strides.

    Not `.contiguous()`: torch calls an empty tensor, or a one-row one, contiguous whatever its strides, and the
    stride-0 gradient of an empty y.sum() would then reach grouped_mm unchanged.
    """
    if t_RC.stride() == (t_RC.shape[1], 1):
        return t_RC
    return t_RC.clone(memory_format=torch.contiguous_format)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Σ_groups 2·M·K·N. With one operand jagged (2D×3D here in forward, 2D×2D for a weight gradient, where the
    groups split K) that is 2 · numel(a) · N; 3D×2D splits N instead, 3D×3D is G full products."""
    if len(a_shape) == 3 and len(b_shape) == 2:
        a_shape = a_shape[1:]
    return 2 * math.prod(a_shape) * b_shape[-1]


# torch's FlopCounterMode (this repo's tests check the analytic FLOP counts against it) has no formula for
# grouped_mm in torch 2.13 and would count the experts as 0 FLOPs; a formula torch ships later wins.
if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_counter.flop_registry:
    flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)
