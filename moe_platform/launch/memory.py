"""Will the run fit? The ledger's training-state bytes against this machine's memory, checked before anything is
built, so a model that cannot fit fails in one sentence instead of allocating for minutes until the OOM killer.

Where the bytes live (per rank, from `moe.ledger.training_state_bytes_per_rank`; experts split over EP ranks, FSDP
and HSDP shards as the ledger says; under pipeline parallelism the pieces of the worst pipeline rank's stages):
  * with a GPU: weights, gradients, master copy and optimizer state on the GPU, except what offload moves to host
    memory (ZeRO `offload_optimizer`: the fp32 master copy, AdamW's m and v and at stage >= 2 the fp32 gradient
    partitions; `offload_params`: the weights; FSDP `fsdp.cpu_offload`: every shard); FSDP's gathered units and
    reduce-scatter input stay on the GPU;
  * on CPU: everything in host memory, shared by every rank on this node.
Host memory also holds, on every rank, the model in fp32 while it is built (4 B/param): the whole model under DDP
and ZeRO-1/2, which shard it only when Accelerate prepares the engine; under ZeRO-3 (zero.Init), FSDP and pipeline
parallelism (train/materialize.py, which fills a stage's pieces) one piece at a time, at most a block. Activations,
buffers and allocator slack are not counted, so a run that passes can still run out of memory; one that fails
cannot fit. A refusal names the sharded layout, ZeRO-3 or FSDP2 (with EP for a MoE model), that fits on the fewest
GPUs.
"""

import dataclasses
import math
import os
from dataclasses import dataclass

import psutil
import torch

from moe.ledger import fsdp_unit_params, sharding_transient_bytes, training_state_bytes_per_rank
from moe_platform.config import ConfigError, DistributedConfig, FSDPConfig, TrainConfig

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
    """Per-rank bytes by place: the ledger's training state, split by GPU presence and offload (ZeRO's, or FSDP's
    cpu_offload, which moves all its shards), plus what FSDP gathers and reduce-scatters, which stays on the device.
    Under pipeline parallelism the worst pipeline rank's, on the device and in host memory each."""
    dist = config.distributed
    run = config.run_shape(world_size)
    if run.fsdp or run.zero_stage == 3 or run.pipeline_size > 1:
        # Built in pieces (FSDP and PP: on the meta device, filled block by block, train/materialize.py; ZeRO-3:
        # inside zero.Init, one module's weights at a time, train/model_build.py): at most the largest block whole.
        build = max(fsdp_unit_params(config.model, ep_size=1)) * FP32_BYTES
    else:
        build = config.model.num_params() * FP32_BYTES
    device_bytes = host_bytes = 0.0
    for pipeline_rank in range(run.pipeline_size):
        state = training_state_bytes_per_rank(config.model, run, pipeline_rank)
        transient = sharding_transient_bytes(config.model, run, pipeline_rank).total
        if run.fsdp:
            offloaded = state.total if dist.fsdp.cpu_offload else 0.0
        else:
            # ZeRO-Offload keeps the fp32 master, m, v and (stage >= 2) the fp32 gradient partitions in host memory.
            partitions = state.master + state.optimizer + (state.gradients if dist.zero_stage >= 2 else 0.0)
            offloaded = partitions if dist.offload_optimizer else 0.0
            offloaded += state.weights if dist.offload_params else 0.0
        if not has_gpu:
            host_bytes = max(host_bytes, state.total + transient)
        else:
            device_bytes = max(device_bytes, state.total - offloaded + transient)
            host_bytes = max(host_bytes, offloaded)
    return Demand(device_bytes=device_bytes, host_bytes=host_bytes, build_host_bytes=build)


def check_training_state_fits(config: TrainConfig, world_size: int, local_ranks: int, memory: Memory) -> None:
    """Raise a one-sentence ConfigError when the training state, or building the model, cannot fit this machine;
    it names the layout that fits on the fewest GPUs (or machines), ZeRO-3 or FSDP2 (with EP for a MoE model)."""
    if not config.distributed.check_memory:
        return
    has_gpu = memory.gpu is not None
    demand = training_state_demand(config, world_size, has_gpu)
    model = f"this model ({config.model.num_params() / 1e9:.2f} B parameters, {config.trainer.precision})"
    layout = f"{_layout(config, world_size)}; activations not counted"
    override = "or set distributed.check_memory=false if you know better"
    if has_gpu and demand.device_bytes > memory.device_bytes:
        remedies = _shard_remedy(config, local_ranks, memory)
        dist = config.distributed
        if dist.strategy == "fsdp" and not dist.fsdp.cpu_offload:
            remedies.append("offload its shards to host memory with distributed.fsdp.cpu_offload=true")
        elif dist.strategy != "fsdp" and not dist.offload_params:
            remedies.append("offload it to host memory with distributed=zero3_offload")
        raise ConfigError(
            f"{model} needs {_gb(demand.device_bytes)} of training state per GPU ({layout}) but the {memory.gpu} has "
            f"{_gb(memory.device_bytes)} free: {', '.join([*remedies, SMALLER_PRESET])}, {override}"
        )
    host_per_rank = max(demand.host_bytes, demand.build_host_bytes)
    if host_per_rank * local_ranks > memory.host_bytes:
        what = "training state" if demand.host_bytes >= demand.build_host_bytes else "fp32 weights while it is built"
        on_ranks = f" on each of the {local_ranks} ranks of this node" if local_ranks > 1 else ""
        remedies = _shard_remedy(config, local_ranks, memory)
        if not remedies and local_ranks > 1:
            remedies.append("start fewer ranks per node (every rank builds at least one whole block in fp32)")
        raise ConfigError(
            f"{model} needs {_gb(host_per_rank)} of host memory for its {what}{on_ranks} ({layout}) but this machine "
            f"has {_gb(memory.host_bytes)} available: {', '.join([*remedies, SMALLER_PRESET])}, {override}"
        )


SMALLER_PRESET = "pick a smaller preset such as model=moe_small"


def _shard_remedy(config: TrainConfig, local_ranks: int, memory: Memory) -> list[str]:
    """["shard it with <layout> over at least N GPUs"] for the sharded layout that fits this machine's GPU and host
    memory (`local_ranks` ranks per node) on the fewest ranks, or [] when none does. Without a GPU the ranks are
    machines like this one, one rank each."""
    has_gpu = memory.gpu is not None
    fits = {}
    for overrides, candidate in _sharded_layouts(config):
        ranks = _fewest_ranks(candidate, local_ranks if has_gpu else 1, memory)
        if ranks is not None:
            fits.setdefault(ranks, overrides)  # a tie goes to the earlier layout: ZeRO-3, then fewer EP ranks
    if not fits:
        return []
    ranks = min(fits)
    unit = (
        ("GPU" if has_gpu else "machine like this one")
        if ranks == 1
        else ("GPUs" if has_gpu else "machines like this one")
    )
    return [f"shard it with {fits[ranks]} over at least {ranks} {unit}"]


def _sharded_layouts(config: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """ZeRO-3 (no EP: DeepSpeed 0.19 refuses it) and FSDP2 at every EP size that divides the experts, with the
    offload the run asked for."""
    dist = config.distributed
    offload_optimizer = dist.offload_optimizer or dist.fsdp.cpu_offload
    offload_params = dist.offload_params or dist.fsdp.cpu_offload
    zero3 = DistributedConfig(
        strategy="deepspeed", zero_stage=3, offload_optimizer=offload_optimizer, offload_params=offload_params
    )
    layouts = [("distributed=zero3", zero3)]
    num_experts = config.model.moe.num_experts if config.model.moe is not None else 1
    for ep in (ep for ep in range(1, num_experts + 1) if num_experts % ep == 0):
        fsdp = DistributedConfig(strategy="fsdp", expert_parallel_size=ep, fsdp=FSDPConfig(cpu_offload=offload_params))
        layouts.append((f"distributed=fsdp{f' distributed.expert_parallel_size={ep}' if ep > 1 else ''}", fsdp))
    candidates = []
    for overrides, distributed in layouts:
        try:  # ZeRO-3 refuses trainer.compile; memory does not depend on it
            trainer = dataclasses.replace(config.trainer, compile=False)
            candidates.append((overrides, dataclasses.replace(config, distributed=distributed, trainer=trainer)))
        except ConfigError:  # a layout this config cannot take (an EP size its routing refuses)
            continue
    return candidates


def _fewest_ranks(config: TrainConfig, local_ranks: int, memory: Memory) -> int | None:
    """The fewest ranks, a multiple of the EP size, at which `config` fits `memory`. Per-rank bytes are a/N + b in
    the rank count N (shards, plus what FSDP gathers, which does not shrink), fitted from N = EP and 2·EP, and the
    fit's answer is then checked against `_fits` itself; None when no N fits (b, or the build, too large)."""
    has_gpu = memory.gpu is not None
    ep = config.distributed.expert_parallel_size
    one, two = (training_state_demand(config, n, has_gpu) for n in (ep, 2 * ep))
    if one.build_host_bytes * local_ranks > memory.host_bytes:
        return None
    limits = [("host_bytes", memory.host_bytes / local_ranks)] + (
        [("device_bytes", memory.device_bytes)] if has_gpu else []
    )
    ranks = ep
    for place, limit in limits:
        b = 2 * getattr(two, place) - getattr(one, place)
        a = (getattr(one, place) - b) * ep
        if b >= limit:
            return None
        ranks = max(ranks, math.ceil(a / (limit - b) / ep) * ep)
    while ranks > ep and _fits(config, ranks - ep, local_ranks, memory):  # the fit's rounding, either way
        ranks -= ep
    while not _fits(config, ranks, local_ranks, memory):
        ranks += ep
    return ranks


def _fits(config: TrainConfig, world_size: int, local_ranks: int, memory: Memory) -> bool:
    """The two checks `check_training_state_fits` makes: the GPU's share, and the host's for every rank of a node."""
    demand = training_state_demand(config, world_size, memory.gpu is not None)
    on_device = memory.gpu is None or demand.device_bytes <= memory.device_bytes
    return on_device and max(demand.host_bytes, demand.build_host_bytes) * local_ranks <= memory.host_bytes


def _layout(config: TrainConfig, world_size: int) -> str:
    dist = config.distributed
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    ep = f", experts over EP={dist.expert_parallel_size}" if dist.expert_parallel_size > 1 else ""
    if dist.pipeline_parallel_size > 1:
        ep += f", {dist.pipeline_parallel_size} pipeline stages (the worst counted)"
    if dist.strategy == "fsdp":
        replicas = dist.fsdp.replicate_size
        kind = f"HSDP ({replicas} replicas)" if replicas > 1 else "FSDP2"
        return f"{kind}{' with CPU offload' if dist.fsdp.cpu_offload else ''} over {ranks}{ep}"
    if dist.strategy != "deepspeed":
        return f"DDP over {ranks}{ep}" if world_size > 1 else "one process"
    offload = " with offload" if dist.offload_optimizer or dist.offload_params else ""
    return f"ZeRO-{dist.zero_stage}{offload} over {ranks}{ep}"


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:,.1f} GB"
