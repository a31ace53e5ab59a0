"""Will the run fit? The ledger's training-state bytes against this machine's memory, checked before anything is
built, so a model that cannot fit fails in one sentence instead of allocating for minutes until the OOM killer.

Where the bytes live (per rank, from `moe.ledger.training_state_bytes_per_rank`; experts split over EP ranks):
  * with a GPU: weights, gradients and optimizer state on the GPU, except what ZeRO offload moves to host memory
    (`offload_optimizer`: the fp32 master copy and AdamW's m and v; `offload_params`: the weights);
  * on CPU: everything in host memory, shared by every rank on this node.
Host memory also holds, on every rank, the whole model in fp32 while it is built (4 B/param): ZeRO shards it only
when Accelerate prepares the engine. Activations, buffers and allocator slack are not counted, so a run that
passes can still run out of memory; one that fails cannot fit.
"""

import dataclasses
import math
import os
from dataclasses import dataclass

import psutil
import torch

from moe.ledger import training_state_bytes_per_rank
from moe_platform.config import ConfigError, TrainConfig

FP32_BYTES = 4


@dataclass(frozen=True)
class Memory:
    """What this node offers one rank's device and all its ranks' host memory, in bytes."""

    gpu: str | None  # the GPU's name; None on CPU
    device_bytes: float  # free memory of this rank's GPU; on CPU the host's available memory
    host_bytes: float  # the host's available memory, shared by the ranks of this node


@dataclass(frozen=True)
class Demand:
    """Bytes per rank placed on the device and in host memory, and host bytes while the model is built."""

    device_bytes: float
    host_bytes: float
    build_host_bytes: float


def this_machine_memory(local_rank: int) -> Memory:
    available = float(psutil.virtual_memory().available)
    if not torch.cuda.is_available():
        return Memory(None, available, available)
    # A rank sees all of the node's GPUs (index = local rank) or, under some Slurm set-ups, only its own (index 0).
    device = local_rank if local_rank < torch.cuda.device_count() else 0
    free, _ = torch.cuda.mem_get_info(device)
    return Memory(torch.cuda.get_device_name(device), float(free), available)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size(world_size: int) -> int:
    """Ranks on this node: the launcher says (torchrun/accelerate set LOCAL_WORLD_SIZE), else assume all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def training_state_demand(config: TrainConfig, world_size: int, has_gpu: bool) -> Demand:
    """Per-rank bytes by place: the ledger's training state, split by GPU presence and ZeRO offload."""
    num_params = config.model.num_params()
    dist = config.distributed
    state = training_state_bytes_per_rank(
        config.model, config.trainer.precision, dist.zero_stage, world_size, dist.expert_parallel_size
    )
    offloaded = (state.optimizer if dist.offload_optimizer else 0.0) + (state.weights if dist.offload_params else 0.0)
    build = num_params * FP32_BYTES
    if not has_gpu:
        return Demand(device_bytes=0.0, host_bytes=state.total, build_host_bytes=build)
    return Demand(device_bytes=state.total - offloaded, host_bytes=offloaded, build_host_bytes=build)


def check_training_state_fits(config: TrainConfig, world_size: int, local_ranks: int, memory: Memory) -> None:
    """Raise a one-sentence ConfigError when the training state, or building the model, cannot fit this machine."""
    if not config.distributed.check_memory:
        return
    has_gpu = memory.gpu is not None
    demand = training_state_demand(config, world_size, has_gpu)
    # What ZeRO-3 would spread over N ranks: bytes at N ranks are these divided by N.
    zero3 = training_state_demand(_with_zero3(config), 1, has_gpu)
    model = f"this model ({config.model.num_params() / 1e9:.2f} B parameters, {config.trainer.precision})"
    layout = f"{_layout(config, world_size)}; activations not counted"
    override = "or set distributed.check_memory=false if you know better"
    if has_gpu and demand.device_bytes > memory.device_bytes:
        gpus = math.ceil(zero3.device_bytes / memory.device_bytes)
        remedies = [f"shard it with distributed=zero3 over at least {gpus} GPUs"]
        if not config.distributed.offload_params:
            remedies.append("offload it to host memory with distributed=zero3_offload")
        raise ConfigError(
            f"{model} needs {_gb(demand.device_bytes)} of training state per GPU ({layout}) but the {memory.gpu} has "
            f"{_gb(memory.device_bytes)} free: {', '.join([*remedies, SMALLER_PRESET])}, {override}"
        )
    host_per_rank = max(demand.host_bytes, demand.build_host_bytes)
    if host_per_rank * local_ranks > memory.host_bytes:
        what = "training state" if demand.host_bytes >= demand.build_host_bytes else "fp32 weights while it is built"
        on_ranks = f" on each of the {local_ranks} ranks of this node" if local_ranks > 1 else ""
        remedies = []
        if demand.build_host_bytes * local_ranks <= memory.host_bytes:  # sharding the state can still make it fit
            if has_gpu:
                gpus = math.ceil(zero3.host_bytes * local_ranks / memory.host_bytes)
                remedies.append(f"shard it with distributed=zero3 over at least {gpus} GPUs")
            else:
                machines = math.ceil(zero3.host_bytes / memory.host_bytes)
                remedies.append(f"shard it with distributed=zero3 over at least {machines} machines like this one")
        elif local_ranks > 1:
            remedies.append("start fewer ranks per node (every rank builds the whole model before ZeRO shards it)")
        raise ConfigError(
            f"{model} needs {_gb(host_per_rank)} of host memory for its {what}{on_ranks} ({layout}) but this machine "
            f"has {_gb(memory.host_bytes)} available: {', '.join([*remedies, SMALLER_PRESET])}, {override}"
        )


SMALLER_PRESET = "pick a smaller preset such as model=moe_small"


def _with_zero3(config: TrainConfig) -> TrainConfig:
    return dataclasses.replace(
        config,
        distributed=dataclasses.replace(config.distributed, strategy="deepspeed", zero_stage=3, expert_parallel_size=1),
        trainer=dataclasses.replace(config.trainer, compile=False),  # ZeRO-3 refuses it; memory does not depend on it
    )


def _layout(config: TrainConfig, world_size: int) -> str:
    dist = config.distributed
    offload = " with offload" if dist.offload_optimizer or dist.offload_params else ""
    return f"ZeRO-{dist.zero_stage}{offload} over {world_size} rank{'s' if world_size > 1 else ''}"


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:,.1f} GB"
