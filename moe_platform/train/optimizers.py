"""The optimizer the trainer steps: torch's AdamW (optim.name=adamw), or Muon for the hidden weight matrices with AdamW
for everything else (optim.name=muon, `MuonAdamW`).

Legend: E experts (the local ones under EP), A×B one matrix as stored (nn.Linear [out, in]; an expert [in, out]),
μ momentum, η the group's scheduled lr, λ its weight decay, g the gradient.

Muon, per matrix W with gradient G (torch.optim.Muon's math, which `test_muon` checks step for step):
    B ← μ·B + (1 − μ)·G                                  (B: the one momentum buffer, fp32 like W)
    U = (1 − μ)·G + μ·B  (nesterov)  or  U = B
    O = NS_k(U): X₀ = U/‖U‖_F in bf16 (optim.muon.ns_dtype: or fp32), transposed so that A ≤ B,
        X ← a·X + (b·XXᵀ + c·(XXᵀ)²)·X, k times,
        (a, b, c) = (3.4445, −4.7750, 2.0315): O ≈ U's orthogonal factor, singular values in about [0.7, 1.2]
    W ← W·(1 − η·λ) − η·s·O,  s = 0.2·√max(A, B) (match_rms_adamw, Moonlight) or √max(1, fan_out/fan_in) (original)
Routed experts are stored as [E, in, out] tensors: each expert is its own matrix, orthogonalised alone (a batched
NS over E, bitwise equal on CPU to E separate ones), never the stacked tensor.

Which parameters: Muon takes every nn.Linear weight and every stacked expert weight inside a transformer block
(attention projections, MLA's down/up projections, dense FFNs, routed and shared experts); AdamW takes the rest:
embeddings, the LM head, norms, biases and the routers (the aux-loss-free balancing bias is a buffer, stepped by the
router itself). Each group has its own peak lr and weight decay; the trainer schedules every group's lr by the same
warmup and decay (`OptimConfig.lr_at`).

Layouts. One process, DDP and expert parallelism hold whole matrices (an expert's matrix lives on one EP rank, and
DDP's all-reduce leaves every rank the same gradient), so each rank orthogonalises locally and alike. Under FSDP2 a
parameter is a DTensor sharded along dim 0: an expert tensor's shard is whole experts (dim 0 is E), orthogonalised
locally with no communication; a 2-D matrix is split by rows, so Muon all-gathers U (cast to NS's dtype first,
which NS does anyway: the same bits) and every rank of the shard group runs NS on the whole matrix, then keeps its
rows of O. That costs per step an all-gather of 2 B (bf16; fp32: 4 B) for every element of the non-expert matrices
(half, or all, the bytes of FSDP's fp32 gradient reduce-scatter of them; the expert matrices send nothing), one
whole matrix and its NS
temporaries at a time in memory, and NS FLOPs ≈ k·(4·A²·B + 2·A³) per matrix repeated on each rank of the shard
group instead of divided among them. DeepSpeed is refused at start-up (config.py): its ZeRO optimizer steps flat
partitions that cut across matrices, and the Muon DeepSpeed 0.19 built into it is another optimizer (it clips the
orthogonalised updates, not the gradients; nesterov and 5 NS steps fixed; measured in bench/deepspeed_muon.py).

State: one fp32 momentum buffer (`momentum_buffer`, as torch.optim.Muon names it) per Muon parameter; AdamW's
`step`, `exp_avg`, `exp_avg_sq` per AdamW parameter, in the same `state` dict, so Accelerate's optimizer file, DCP
and the expert checkpoints (checkpoint/) save and restore both, and `load_state_dict` is torch's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim.adam import adam

from moe.experts import GroupedExperts
from moe_platform.config import OptimConfig
from moe_platform.train.model_build import full_shape

# Keller Jordan's quintic Newton–Schulz coefficients and norm floor, as torch.optim.Muon has them
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
MUON, ADAMW = "muon", "adamw"


def hidden_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every matrix Muon steps: nn.Linear weights and stacked expert weights in the blocks, and
    in the MTP modules (their blocks and projections M_k; moe/mtp.py)."""
    found = []
    for module_name, module in model.named_modules():
        if not module_name.startswith(("blocks.", "mtp.")):
            continue
        if isinstance(module, nn.Linear):
            found.append((f"{module_name}.weight", module.weight))
        elif isinstance(module, GroupedExperts):
            found += [(f"{module_name}.{short}", p) for short, p in module.named_parameters(recurse=False)]
    return [(name, p) for name, p in found if p.requires_grad]


def param_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """AdamW's groups (weight decay only on matrices: embeddings, projections, experts, routers; not on norms or
    biases), and under optim.name=muon the hidden matrices moved out of them into a Muon group, last."""
    muon = hidden_matrices(model) if optim.name == MUON else []
    muon_ids = {id(p) for _, p in muon}
    # full_shape: a parameter built partitioned (ZeRO-3) is an empty placeholder until gathered.
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in muon_ids]
    groups = [
        {"name": "decay", "params": [p for p in rest if len(full_shape(p)) >= 2], "weight_decay": optim.weight_decay},
        {"name": "no_decay", "params": [p for p in rest if len(full_shape(p)) < 2], "weight_decay": 0.0},
    ]
    if optim.name == MUON:
        for group in groups:
            group.update(algorithm=ADAMW, lr=optim.lr)
        groups.append(
            {"name": MUON, "algorithm": MUON, "params": [p for _, p in muon], "lr": optim.muon_lr,
             "weight_decay": optim.muon_weight_decay}
        )  # fmt: skip
    return groups


def adamw_kernel(implementation: str, params: list[torch.Tensor]) -> dict[str, bool]:
    """torch.optim.AdamW's keyword for optim.implementation; "auto" is fused where every parameter's device has the
    fused kernel (CPU and CUDA do in torch >= 2.4), else foreach."""
    if implementation == "auto":
        fused_devices = torch.utils._foreach_utils._get_fused_kernels_supported_devices()
        implementation = "fused" if all(p.device.type in fused_devices for p in params) else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]


def build_optimizer(groups: list[dict[str, Any]], optim: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer of optim.name over `groups` (from `param_groups`, or DeepSpeed's split of them)."""
    kernel = adamw_kernel(optim.implementation, [p for group in groups for p in group["params"]])
    adamw = {"lr": optim.lr, "betas": (optim.beta1, optim.beta2), "eps": optim.eps}
    if optim.name == ADAMW:
        return torch.optim.AdamW(groups, **adamw, **kernel)
    muon = optim.muon
    return MuonAdamW(
        groups, **adamw, weight_decay=optim.weight_decay, momentum=muon.momentum, nesterov=muon.nesterov,
        ns_steps=muon.ns_steps, adjust_lr=muon.adjust_lr, ns_dtype=muon.ns_dtype, **kernel,
    )  # fmt: skip


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups whose "algorithm" is "muon" (2-D matrices and [E, A, B] stacks of them), torch's AdamW
    (its functional kernel, so the same update) for the "adamw" groups; see the module docstring."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        adjust_lr: str,
        ns_dtype: str = "bfloat16",
        fused: bool | None = None,
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            "algorithm": ADAMW, "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps, "adjust_lr": adjust_lr,
            "ns_dtype": ns_dtype, "fused": fused, "foreach": foreach,
        }  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["algorithm"] not in (MUON, ADAMW):
                raise ValueError(f"parameter group {group.get('name')!r} has algorithm {group['algorithm']!r}")
            if group["algorithm"] == MUON and any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError("Muon steps matrices and [E, A, B] stacks of them: a Muon parameter is not 2-D/3-D")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == MUON:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = _orthogonalised(p, update, group["ns_steps"], getattr(torch, group["ns_dtype"]))
            weight = _local(p)
            weight.mul_(1 - lr * group["weight_decay"])
            weight.add_(ortho, alpha=-lr * lr_scale(group["adjust_lr"], p.shape))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's step of this group (its state created as AdamW creates it)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                on_device = group["fused"]  # the fused kernel reads its step counts where the parameters are
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else None)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group["foreach"], fused=group["fused"],
            decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip


def lr_scale(adjust_lr: str, shape: torch.Size) -> float:
    """s of W ← W − η·s·O for a matrix of `shape` (a stack [E, in, out]: one expert's matrix; else [out, in])."""
    if len(shape) == 3:
        _, fan_in, fan_out = shape
    else:
        fan_out, fan_in = shape
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    return math.sqrt(max(1, fan_out / fan_in))


def newton_schulz(u: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NS_k(U) in `dtype` of a matrix [A, B] or of each matrix of a stack [E, A, B] alone (module docstring); the 2-D
    case in bf16 is torch.optim.Muon's operation for operation."""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype)
    tall = u.size(-2) > u.size(-1)
    if tall:  # XXᵀ is then the smaller Gram matrix
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:  # ‖·‖_F per expert, and baddbmm: the same products expert by expert
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _orthogonalised(p: torch.Tensor, update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """NS of this rank's `update` (a local tensor): where its shard of `p` holds only whole matrices (a plain
    tensor; an expert stack sharded along E), here; else gathered whole, orthogonalised, and this rank's rows kept."""
    if not isinstance(p, DTensor) or _whole_matrices(p):
        return newton_schulz(update, steps, dtype)
    mesh, placements = p.device_mesh, p.placements
    whole = DTensor.from_local(update.to(dtype), mesh, placements, shape=p.shape, stride=p.stride()).full_tensor()
    return distribute_tensor(newton_schulz(whole, steps, dtype), mesh, placements, src_data_rank=None).to_local()


def _whole_matrices(p: DTensor) -> bool:
    """A stack [E, A, B] split only along E: each rank's shard is whole experts."""
    return p.ndim == 3 and all(isinstance(x, Replicate) or x == Shard(0) for x in p.placements)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view: in-place ops write into it), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
