"""One rank of a layout built for real, on the meta device, to check what the ledger says a rank holds.

`simulate_rank` joins a fake process group of W ranks as rank r (torch's "fake" backend: every collective returns at
once, nothing is sent; Megatron's --fake-process-group idea), builds the model's structure on the meta device and
applies to it the functions the trainer applies (train/trainer.py, `_sharding` and `_parallelize`):
  * PP > 1: `PipelineTraining.split`: the (pp, shard) and (pp, ep, edp) meshes, the rank's stages kept, their
    expert block (EP), and FSDP2 inside the stage (`shard_stages`) when the strategy is fsdp;
  * FSDP2 without PP: `fsdp.build_meshes` and `fsdp.shard_model`, as `Trainer._shard_fsdp` calls them;
  * DDP without PP: `expert_parallel.attach`, the rank's expert block. torch's DDP wrapper is not built: it keeps
    the parameters and `.grad` as they are (its buckets are communication buffers: monitor/peak_memory.py).
Then every parameter is given a gradient the way the strategy allocates it, and AdamW takes one real step.

Gradients: a real backward cannot run on the meta device (the MoE dispatch reads its split sizes on the host,
moe/dispatch.py), so each gradient is allocated as the strategy leaves it: DDP's autograd `.grad` has the
parameter's shape and dtype (`pipeline.sync_gradients` is called under PP: it allocates them so itself), FSDP2's
reduce-scatter leaves a DTensor of the parameter's local shard in fp32 (its reduce dtype under bf16), which
`zeros_like` of the sharded parameter is. Optimizer state: the trainer's optimizer over its parameter groups
(train/optimizers.py: AdamW, or Muon and AdamW) takes `step()` on the meta tensors, so m and v (and Muon's momentum
buffers) are the ones it creates.

Counts. `held` is what this rank's tensors cover: a DTensor's local shard, unpadded (FSDP2 pads its storage to
⌈rows / shards⌉ rows a rank; the padding is not counted, as in monitor/footprint.py). FSDP2 splits dim 0 as
`torch.chunk` does, so with rows that the shard count does not divide the first ranks of a shard group hold
⌈rows / S⌉ rows and the last fewer, or none. `even` is Σ numel / S over the same tensors, the even split the ledger
counts; the two agree exactly when every S divides every tensor's rows, and in any case the ranks of a shard group
together hold S × `even` (each tensor once). `tensors` lists each parameter's split, for a planner to find the
group's most loaded rank. Only meta tensors are made: a 671B model's rank costs well under a second and no memory.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore

from moe_platform.config import TrainConfig
from moe_platform.parallel import expert_parallel, fsdp, pipeline
from moe_platform.train.materialize import build_meta
from moe_platform.train.optimizers import build_optimizer, param_groups
from moe_platform.train.pipeline_step import PipelineTraining


@dataclass(frozen=True)
class RankElements:
    """Elements and bytes of one rank's training state: ints as held, Fractions for the ledger's even split."""

    params: int | Fraction
    grads: int | Fraction
    optimizer_state: int | Fraction  # AdamW's m and v, Muon's momentum (tensors with a dimension; not the step counter)
    param_bytes: int | Fraction
    grad_bytes: int | Fraction
    optimizer_bytes: int | Fraction


@dataclass(frozen=True)
class TensorSplit:
    """How one parameter is split: its global shape, over how many ranks its dim 0 is cut (1: whole) and which
    piece this rank holds."""

    name: str
    shape: tuple[int, ...]
    shards: int
    index: int
    local_numel: int


@dataclass(frozen=True)
class SimulatedRank:
    rank: int
    pipeline_rank: int
    held: RankElements
    even: RankElements
    tensors: tuple[TensorSplit, ...]


@dataclass(frozen=True)
class _Launch:
    """The two attributes of Accelerate's `Accelerator` that the pipeline split reads. A real Accelerator would
    start a process group of its own from the launcher's environment; here the fake one is already there."""

    num_processes: int
    device: torch.device


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """Rank `rank` of `world_size` in torch's fake backend, destroyed on exit (also its sub-groups and meshes)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized: simulate_rank needs its own fake one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor's sharding propagation caches its output specs (in Python and in its C++ fast path) by the
        # mesh's value (ranks and names, not its groups): a second simulation in this process would get specs
        # holding the first one's meshes, whose group names no longer resolve.
        _clear_sharding_prop_cache()


def build_rank(config: TrainConfig, world_size: int) -> tuple[nn.Module, PipelineTraining | None]:
    """Collective (in the fake group): this rank's model on the meta device, split and sharded as the trainer does,
    with the pipeline split when PP > 1."""
    distributed = config.distributed
    model = build_meta(config)
    if distributed.pipeline_parallel_size > 1:
        split = PipelineTraining(config, _Launch(world_size, torch.device("cpu")))
        split.split(model)
        return model, split
    if distributed.strategy == "fsdp":  # Trainer._shard_fsdp
        meshes = fsdp.build_meshes("cpu", distributed.fsdp.replicate_size, distributed.expert_parallel_size)
        fsdp.shard_model(model, meshes, fsdp.sharding_policy(config))
    elif distributed.strategy == "ddp":
        expert_parallel.attach(model, distributed.expert_parallel_size, deepspeed=False)
    else:
        raise ValueError(
            f"distributed.strategy={distributed.strategy!r} is not simulated: DeepSpeed's engine needs real "
            "communication to build; simulate ddp or fsdp (hsdp)"
        )
    return model, None


def give_gradients(model: nn.Module, split: PipelineTraining | None) -> None:
    """Every parameter's gradient as the strategy leaves it before the optimizer step (module docstring)."""
    if split is not None and not split.fsdp:
        pipeline.sync_gradients(model, split.meshes)  # allocates every gradient (zeros like the parameter)
        return
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def optimizer_state(model: nn.Module, config: TrainConfig) -> list[torch.Tensor]:
    """The optimizer's state after one real step over the trainer's parameter groups: AdamW's m and v, and under
    optim.name=muon Muon's momentum buffers (the step counters left out)."""
    optimizer = build_optimizer(_chunked(param_groups(model, config.optim)), config.optim)
    optimizer.step()
    return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim > 0]


def _chunked(groups: list[dict], size: int = 64) -> list[dict]:
    """The same groups in pieces of at most `size` parameters: DTensor's sharding propagation of one foreach op is
    quadratic in its list's length (3,300 expert and block parameters of Qwen3-235B: 45 s in one group, 2 s in
    pieces), and the state AdamW creates for a parameter does not depend on its group's size."""
    return [
        {**group, "params": group["params"][start : start + size]}
        for group in groups
        for start in range(0, len(group["params"]), size)
    ]


def simulate_rank(config: TrainConfig, world_size: int, rank: int) -> SimulatedRank:
    """Build rank `rank` of `world_size` on the meta device with a fake process group, give it gradients and
    AdamW's state, and count what it holds (module docstring). The process group is destroyed before returning."""
    with fake_process_group(world_size, rank):
        model, split = build_rank(config, world_size)
        give_gradients(model, split)
        state = optimizer_state(model, config)
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        held = _elements(params, grads, state, _local_numel)
        even = _elements(params, grads, state, _even)
        tensors = tuple(_split(name, p) for name, p in model.named_parameters())
        pipeline_rank = split.meshes.pipeline_rank if split is not None else 0
    return SimulatedRank(rank, pipeline_rank, held, even, tensors)


def _elements(params, grads, state, count) -> RankElements:
    """Elements and bytes of the three kinds of tensors, each tensor's elements counted by `count`."""
    return RankElements(
        params=sum((count(p) for p in params), 0),
        grads=sum((count(g) for g in grads), 0),
        optimizer_state=sum((count(t) for t in state), 0),
        param_bytes=sum((count(p) * p.element_size() for p in params), 0),
        grad_bytes=sum((count(g) * g.element_size() for g in grads), 0),
        optimizer_bytes=sum((count(t) * t.element_size() for t in state), 0),
    )


def _local_numel(tensor: torch.Tensor) -> int:
    return _local(tensor).numel()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shards(tensor: torch.Tensor) -> tuple[int, int]:
    """(ranks dim 0 is cut over, this rank's piece): the mesh dimensions a DTensor is Shard(0) on; (1, 0) else."""
    if not isinstance(tensor, DTensor):
        return 1, 0
    shards, index = 1, 0
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise NotImplementedError(f"a Shard({placement.dim}) placement: only dim-0 sharding is counted")
            size = tensor.device_mesh.size(dim)
            shards, index = shards * size, index * size + tensor.device_mesh.get_local_rank(dim)
    return shards, index


def _even(tensor: torch.Tensor) -> Fraction:
    return Fraction(tensor.numel(), _shards(tensor)[0])


def _split(name: str, p: torch.Tensor) -> TensorSplit:
    shards, index = _shards(p)
    return TensorSplit(name, tuple(p.shape), shards, index, _local(p).numel())


def chunk_rows(rows: int, shards: int, index: int) -> int:
    """The rows `torch.chunk` (FSDP2's split) gives piece `index` of `shards`: ⌈rows / shards⌉ while they last."""
    per = math.ceil(rows / shards)
    return max(0, min(per, rows - index * per))
