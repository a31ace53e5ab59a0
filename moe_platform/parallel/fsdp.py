"""Fully sharded data parallelism (PyTorch FSDP2, `fully_shard`), alone, as HSDP, and composed with expert parallelism.

Meshes, with W ranks, R = `distributed.fsdp.replicate_size` and EP = `distributed.expert_parallel_size`:
  * the dense mesh shards every parameter that is not a routed expert: 1-D (shard = W) under FSDP, 2-D
    (replicate = R, shard = W/R) under HSDP, whose shard groups are consecutive ranks;
  * under EP the routed experts live on the expert mesh, 2-D (ep = EP, edp = W/EP) with mesh[j, i] = i·EP + j: its
    ep groups are the EP groups of parallel/groups.py (consecutive ranks, the all-to-all stays inside them) and its
    edp groups the ranks holding one expert block, over which `fully_shard` shards that block again. A rank then
    holds 1/(EP · W/EP) = 1/W of every expert tensor and 1/W (1/(W/R) under HSDP) of everything else.

Gradients. Every rank's loss L_r is a mean over its own tokens, and the reduce-scatter of a mesh of size M divides
by M, which is right for the dense mesh (g = (1/W) Σ_r ∂L_r/∂θ, as DDP). An expert block's local gradient already
sums the losses of its EP group's ranks (the backward all-to-all brings them home), so the edp reduce-scatter must
divide by W, not by W/EP: `set_gradient_divide_factor(W)` (expert_parallel.py derives the same 1/W for DDP).

Why `fully_shard` is called here and not through Accelerate's FSDP2 plugin: the plugin shards the whole model over
one mesh with one wrap policy, so it cannot put the experts on a second mesh with their own divide factor, and it
runs on GPUs only, while these strategies are tested on CPU over gloo. The model is therefore not handed to
`accelerator.prepare` (which would wrap it in DDP); Accelerate still keeps accumulation, the loss scaling of
`backward` and the RNG states of checkpoints. Mixed precision is FSDP's own policy: bf16 parameters and compute,
fp32 gradient reduction and fp32 sharded master weights, so AdamW's state is fp32 too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from moe import MoELayer
from moe.expert_parallel import ExpertParallel
from moe_platform.config import TrainConfig
from moe_platform.parallel.expert_parallel import shard_experts
from moe_platform.parallel.groups import ExpertParallelGroups


@dataclass(frozen=True)
class ShardingMeshes:
    """The dense mesh every non-expert parameter is sharded on, and under EP the experts' (ep, edp) mesh."""

    dense: DeviceMesh
    experts: DeviceMesh | None
    world_size: int

    @property
    def expert_groups(self) -> ExpertParallelGroups | None:
        """The expert mesh's groups, in the form the EP dispatch and the checkpoint parts take."""
        if self.experts is None:
            return None
        ep_size, edp_size = self.experts.shape
        return ExpertParallelGroups(
            expert_parallel=ExpertParallel(
                size=ep_size, rank=self.experts.get_local_rank("ep"), group=self.experts.get_group("ep")
            ),
            data_group=self.experts.get_group("edp"),
            data_size=edp_size,
            world_size=self.world_size,
        )


def build_meshes(device_type: str, replicate_size: int, ep_size: int) -> ShardingMeshes:
    """Collective: every rank builds both meshes (and their process groups) in the same order."""
    world_size = dist.get_world_size()
    if replicate_size > 1:
        dense = init_device_mesh(
            device_type, (replicate_size, world_size // replicate_size), mesh_dim_names=("replicate", "shard")
        )
    else:
        dense = init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    experts = None
    if ep_size > 1:
        ranks_ep_edp = torch.arange(world_size).view(world_size // ep_size, ep_size).t()  # [j, i] = i·EP + j
        experts = DeviceMesh(device_type, ranks_ep_edp, mesh_dim_names=("ep", "edp"))
    return ShardingMeshes(dense=dense, experts=experts, world_size=world_size)


@dataclass(frozen=True)
class ShardingPolicy:
    """How `fully_shard` treats every unit: when it reshards, in which dtypes it computes, and where shards live."""

    reshard_after_forward: bool
    bf16: bool
    cpu_offload: bool

    def kwargs(self) -> dict:
        precision = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if self.bf16 else None, reduce_dtype=torch.float32 if self.bf16 else None
        )
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()
        return {"reshard_after_forward": self.reshard_after_forward, "mp_policy": precision, "offload_policy": offload}


def sharding_policy(config: TrainConfig) -> ShardingPolicy:
    """The run's policy: distributed.fsdp's resharding and offload, bf16 compute under trainer.precision=bf16."""
    fsdp = config.distributed.fsdp
    return ShardingPolicy(fsdp.reshard_after_forward, config.trainer.precision == "bf16", fsdp.cpu_offload)


def shard_model(model: nn.Module, meshes: ShardingMeshes, policy: ShardingPolicy) -> None:
    """Under EP keep this rank's expert block and shard it over its edp group; then shard each transformer block,
    each MTP module and the root (embeddings, final norm, head) over the dense mesh. A parameter already sharded by
    an inner unit is left to it, so the experts stay on their mesh."""
    kwargs = policy.kwargs()
    groups = meshes.expert_groups
    if groups is not None:
        shard_experts(model, groups.expert_parallel)
        for module in model.modules():
            if isinstance(module, MoELayer):
                fully_shard(module.experts, mesh=meshes.experts["edp"], **kwargs)
                module.experts.set_gradient_divide_factor(float(meshes.world_size))
                # The factor makes the reduce-scatter a PREMUL_SUM, which gloo lacks: sum, then divide. (Not with one
                # edp rank, where nothing is sent: torch 2.13 would then divide by the factor twice.)
                if dist.get_backend() == "gloo" and meshes.experts["edp"].size() > 1:
                    module.experts.set_force_sum_reduction_for_comms(True)
    for block in model.blocks:
        fully_shard(block, mesh=meshes.dense, **kwargs)
    for module in model.mtp or ():  # an MTP module (norms, M_k, its block) is a unit like a block
        fully_shard(module, mesh=meshes.dense, **kwargs)
    # The root's parameters are gathered for the whole step: there is no later unit to reshard them for.
    fully_shard(model, mesh=meshes.dense, **{**kwargs, "reshard_after_forward": False})


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, uncounted: frozenset[str] = frozenset()) -> float:
    """Scale all gradients so the global norm is at most `max_norm` (torch's rule); returns the norm before.

    ‖g‖² = Σ_ranks Σ_local ‖shard‖² / copies: each rank's shards, divided by how many ranks hold the same shard
    (R on the dense mesh under HSDP, 1 otherwise: expert shards are distinct on every rank), in one all-reduce.
    The parameters named in `uncounted` are copies another pipeline stage counts (the embedding under MTP):
    clipped, not counted.
    """
    grads, sum_sq = [], None
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        grad = parameter.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        grads.append(local)
        if name in uncounted:
            continue
        part = local.double().pow(2).sum() / _copies(grad)
        sum_sq = part if sum_sq is None else sum_sq + part
    device = next(model.parameters()).device
    total_sq = sum_sq if sum_sq is not None else torch.zeros((), dtype=torch.float64, device=device)
    dist.all_reduce(total_sq)
    total = float(total_sq.sqrt())
    if math.isfinite(max_norm) and math.isfinite(total):
        coefficient = min(1.0, max_norm / (total + 1e-6))  # torch.nn.utils.clip_grads_with_norm_'s
        if coefficient < 1.0:
            torch._foreach_mul_(grads, coefficient)
    return total


def _copies(tensor: torch.Tensor) -> int:
    """How many ranks hold the same local shard of `tensor`: the product of its mesh's replicated dimensions."""
    if not isinstance(tensor, DTensor):
        return dist.get_world_size()
    return math.prod(
        tensor.device_mesh.size(dim)
        for dim, placement in enumerate(tensor.placements)
        if isinstance(placement, Replicate)
    )
