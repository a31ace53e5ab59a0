"""Routed experts: E feed-forward networks stored as stacked weight tensors.

Legend: A assignments (tokens already grouped by expert), c the rows of one expert's slice, D model width,
F expert hidden width, E experts (the local ones under expert parallelism), I/O in/out width of one projection.

GELU expert:   y = GELU(x w_up[e]) w_down[e]
SwiGLU expert: y = (SiLU(x w_gate[e]) ⊙ x w_up[e]) w_down[e]
Stacked [E, D, F] / [E, F, D] tensors (not E nn.Linear modules) keep one parameter per projection, which is
what expert parallelism shards along E and what checkpoint converters expect (Mixtral, OLMoE, torchtitan).

Two ways to run the experts, with the same result (bitwise on CPU): the grouped path (`use_grouped_mm`, config
`moe.experts_impl="grouped_mm"`) and a Python loop of E autograd-tracked FFNs ("loop"). The grouped path is one
`F.grouped_mm` per projection (offsets = int32 end row of each expert's slice) on GPUs and when traced; eagerly on
CPU it is `_ExpertSlices`, the same products expert by expert in one autograd node. See `GroupedExperts.forward`.
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

    # False runs torch's grouped_mm kernel on CPU too (the tests use it to check the GPU's code path here).
    cpu_mm_slices: bool = True

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
        # Auto prefers the grouped path wherever it can run, CPU included. On CPU it runs expert by expert in one
        # autograd node (results bitwise equal to the loop), without the loop's E autograd nodes per projection,
        # cat of outputs and stack of per-expert weight gradients; whole-layer CPU time (1 thread, bench shape)
        # measured ~5% below the loop's, a tie at the experts alone. On CUDA torch runs grouped_mm in bf16 on
        # SM90+ as one kernel instead of E launches and other cases as its own loop (not measured here).
        dtype = self._grouped_mm_dtype(x_AD) if self.use_grouped_mm is not False else None
        if self.use_grouped_mm and dtype is None:
            raise ValueError(
                f"use_grouped_mm=True, but grouped_mm cannot run on {x_AD.dtype} input with d_model={d_model}, "
                f"d_ff={d_ff}: it needs float32/bfloat16/float16 (bfloat16 under torch.compile, fake or meta "
                "tensors) and both widths a multiple of 16 bytes; "
                "use use_grouped_mm=None (moe.experts_impl='auto') to fall back to the per-expert loop"
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
        # Built on the host and sent without waiting (a blocking copy would be a second host sync on CUDA).
        offs_E = torch.tensor(list(itertools.accumulate(tokens_per_expert)), dtype=torch.int32)
        offs_E = offs_E.to(x_AD.device, non_blocking=True)
        # On CPU, eagerly, the experts run expert by expert in one autograd node (`_ExpertSlices`): torch 2.13's
        # CPU grouped_mm forward measured 1.8x slower than the same mm calls at the bench shape (58 vs 32 ms, 1
        # thread, A=8192, D=256, F=1024, E=8), and expert-major order keeps each slice's hidden in cache.
        # Traced (compile, fake, meta) and on GPUs it is the grouped_mm op; results are equal either way.
        traced = torch.compiler.is_compiling() or any(t.is_meta or isinstance(t, FakeTensor) for t in (x_AD, self.w_up))
        use_slices = self.cpu_mm_slices and x_AD.device.type == "cpu" and not traced
        sizes = tuple(tokens_per_expert) if use_slices else None
        x_AD = x_AD.to(dtype)
        w_gate_EDF = self.w_gate.to(dtype) if self.w_gate is not None else None
        if sizes is not None:
            return _ExpertSlices.apply(x_AD, w_gate_EDF, self.w_up.to(dtype), self.w_down.to(dtype), sizes)
        if w_gate_EDF is not None:
            gate_AF = _GroupedMatmul.apply(x_AD, w_gate_EDF, offs_E)
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


class _ExpertSlices(torch.autograd.Function):
    """y_c = act(x_c w_up[e] [, x_c w_gate[e]]) w_down[e], expert by expert, as one autograd node (CPU).

    The same products as the grouped path, ordered expert-major instead of projection-major: each slice's [c, F]
    hidden is still in cache when its activation and its second matmul (or, in backward, the activation's
    gradient and the products that follow) read it, and outputs and weight gradients are written in place (no
    per-expert autograd nodes, no cat of outputs, no stack of per-expert weight gradients). Hiddens are
    allocated per slice: one [A, F] buffer would be large enough (32 MB at the bench shape) for the C allocator
    to map it fresh from the OS on every step, and its page faults cost as much as the activation itself.
    Backward, per slice: g_h = g_y w_downᵀ; g_w_down = hᵀ g_y; g_a = act'(a) ⊙ g_h per pre-activation a;
    g_w = xᵀ g_a; g_x = Σ_a g_a wᵀ. SwiGLU recomputes SiLU(gate) rather than saving it.
    """

    @staticmethod
    def forward(ctx, x_AD, w_gate_EDF, w_up_EDF, w_down_EFD, sizes):
        y_AD = x_AD.new_empty(x_AD.shape[0], w_down_EFD.shape[2])
        hidden = []  # per busy expert: gate pre-activation (SwiGLU) or None, up pre-activation, hidden
        for e, rows in _slices(sizes):
            x_cD = x_AD[rows]
            up_cF = x_cD @ w_up_EDF[e]
            if w_gate_EDF is not None:
                gate_cF = x_cD @ w_gate_EDF[e]
                h_cF = F.silu(gate_cF).mul_(up_cF)
            else:
                gate_cF, h_cF = None, F.gelu(up_cF)
            torch.mm(h_cF, w_down_EFD[e], out=y_AD[rows])
            hidden += [gate_cF, up_cF, h_cF]
        ctx.save_for_backward(x_AD, w_gate_EDF, w_up_EDF, w_down_EFD, *hidden)
        ctx.sizes = sizes
        return y_AD

    @staticmethod
    def backward(ctx, grad_AD):
        x_AD, w_gate_EDF, w_up_EDF, w_down_EFD, *hidden = ctx.saved_tensors
        grad_x_AD = torch.empty_like(x_AD) if ctx.needs_input_grad[0] else None  # every row is written below
        grad_up_EDF, grad_down_EFD = torch.empty_like(w_up_EDF), torch.empty_like(w_down_EFD)
        grad_gate_EDF = torch.empty_like(w_gate_EDF) if w_gate_EDF is not None else None
        for e, count in enumerate(ctx.sizes):
            if count == 0:  # an idle expert's weight gradient is exactly zero
                for grad_EIO in (grad_gate_EDF, grad_up_EDF, grad_down_EFD):
                    if grad_EIO is not None:
                        grad_EIO[e].zero_()
        # Last expert first: its hidden and weights are the ones forward left in cache (autograd's own order).
        for i, (e, rows) in reversed(list(enumerate(_slices(ctx.sizes)))):
            gate_cF, up_cF, h_cF = hidden[3 * i : 3 * i + 3]
            x_cD, g_y_cD = x_AD[rows], grad_AD[rows]
            g_h_cF = g_y_cD @ w_down_EFD[e].t()
            torch.mm(h_cF.t(), g_y_cD, out=grad_down_EFD[e])
            if gate_cF is not None:
                g_up_cF = g_h_cF * F.silu(gate_cF)
                g_gate_cF = torch.ops.aten.silu_backward(g_h_cF * up_cF, gate_cF)
                torch.mm(x_cD.t(), g_gate_cF, out=grad_gate_EDF[e])
            else:
                g_up_cF = torch.ops.aten.gelu_backward(g_h_cF, up_cF)
            torch.mm(x_cD.t(), g_up_cF, out=grad_up_EDF[e])
            if grad_x_AD is not None:
                torch.mm(g_up_cF, w_up_EDF[e].t(), out=grad_x_AD[rows])
                if gate_cF is not None:  # mm then add (not addmm): the same rounding as autograd's sum
                    grad_x_AD[rows] += g_gate_cF @ w_gate_EDF[e].t()
        return grad_x_AD, grad_gate_EDF, grad_up_EDF, grad_down_EFD, None


def _slices(sizes: tuple[int, ...]):
    """(expert, row slice) of every expert with rows, in order."""
    start = 0
    for e, count in enumerate(sizes):
        if count:
            yield e, slice(start, start + count)
        start += count


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
