"""Will the run fit? The planner's peak memory per rank against this machine, checked before anything is built, so a
layout that cannot fit fails in one sentence instead of allocating for minutes until the OOM killer or CUDA does.

The demand is moe-plan's (plan/memory.py `rank_memory`: weights, gradients, optimizer state, activations at the
peak, what FSDP or ZeRO-3 gathers, communication buffers; under pipeline parallelism the worst pipeline rank):
  * with a GPU: all of it on the GPU except what offload moves to host memory (ZeRO `offload_optimizer` and
    `offload_params`, FSDP `fsdp.cpu_offload`);
  * on CPU: everything in host memory, shared by every rank on this node.
Host memory also holds, on every rank, the model in fp32 while it is built (4 B/param): the whole model under DDP
and ZeRO-1/2, which shard it only when Accelerate prepares the engine; under ZeRO-3 (zero.Init), FSDP and pipeline
parallelism (train/materialize.py, which fills a stage's pieces) one piece at a time, at most a block.

A refusal names what moe-plan would launch instead: the fastest layout that fits these ranks (plan/layouts.py, the
same model), or, when none does, the fewest nodes on which one fits. moe-submit makes the same check for the GPU
it is told (`--gpu`) before anything reaches the queue (`plan_refusal`).
"""

import dataclasses
import os
from dataclasses import dataclass

import psutil
import torch

from moe.config import configs_frozen
from moe.ledger import FP32_BYTES, fsdp_unit_params
from moe_platform.config import ConfigError, TrainConfig
from moe_platform.plan.hardware import GIGA, NOMINAL_CPU, Cluster, gpu_of_device
from moe_platform.plan.layouts import (
    DEFAULT_HEADROOM,
    MAX_NODES,
    Headroom,
    Plan,
    plan_layouts,
    smallest_fitting_nodes,
)
from moe_platform.plan.memory import rank_memory

OVERRIDE = "or set distributed.check_memory=false if you know better"
SMALLER_PRESET = "pick a smaller preset such as model=moe_small"


@dataclass(frozen=True)
class Memory:
    """What this node offers one rank's device and all its ranks' host memory, in bytes."""

    gpu: str | None  # the GPU's name as torch reports it; None on CPU
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


def host_share(memory: Memory, local_ranks: int) -> float:
    """Host bytes each rank of this node may use: the machine's available memory split evenly among its ranks."""
    return memory.host_bytes / max(local_ranks, 1)


def build_host_bytes(config: TrainConfig, world_size: int) -> float:
    """fp32 bytes a rank holds in host memory while it builds the model: the whole model, or under FSDP, ZeRO-3 and
    pipeline parallelism (built on the meta device and filled block by block, or inside zero.Init) the largest
    block."""
    run = config.run_shape(world_size)
    if run.fsdp or run.zero_stage == 3 or run.pipeline_size > 1:
        return least_build_host_bytes(config)
    return config.model.num_params() * FP32_BYTES


def least_build_host_bytes(config: TrainConfig) -> float:
    """The least any layout's build holds in host memory, at any size: the largest block in fp32."""
    return max(fsdp_unit_params(config.model, ep_size=1)) * FP32_BYTES


def memory_demand(config: TrainConfig, world_size: int, has_gpu: bool) -> Demand:
    """Per-rank bytes by place, from the planner's peak of the worst rank: on a GPU what offload leaves there, and
    what it moves to host memory; on CPU all of it in host memory."""
    peak = rank_memory(config, world_size, on_gpu=has_gpu)
    build = build_host_bytes(config, world_size)
    if not has_gpu:
        return Demand(device_bytes=0.0, host_bytes=peak.total + peak.offloaded, build_host_bytes=build)
    return Demand(device_bytes=peak.total, host_bytes=peak.offloaded, build_host_bytes=build)


def check_memory_fits(config: TrainConfig, world_size: int, local_ranks: int, memory: Memory) -> None:
    """Raise a one-sentence ConfigError when the run's peak per rank, or building the model, cannot fit this
    machine; it names the layout moe-plan would run instead (`_remedy`)."""
    if not config.distributed.check_memory:
        return
    has_gpu = memory.gpu is not None
    demand = memory_demand(config, world_size, has_gpu)
    model = f"this model ({config.model.num_params() / 1e9:.2f} B parameters, {config.trainer.precision})"
    layout = _layout(config, world_size)
    device_limit = memory.device_bytes * (1 - DEFAULT_HEADROOM.fragmentation)  # free memory: CUDA's already taken
    if has_gpu and demand.device_bytes > device_limit:
        remedies = _remedy(config, world_size, local_ranks, memory)
        raise ConfigError(
            f"{model} needs {_gb(demand.device_bytes)} per GPU at its peak ({layout}) but the {memory.gpu} has "
            f"{_gb(memory.device_bytes)} free: {', '.join([*remedies, SMALLER_PRESET])}, {OVERRIDE}"
        )
    host_per_rank = max(demand.host_bytes, demand.build_host_bytes)
    if host_per_rank * local_ranks > memory.host_bytes:
        what = "peak" if demand.host_bytes >= demand.build_host_bytes else "fp32 weights while it is built"
        if has_gpu and what == "peak":
            what = "offloaded state"
        on_ranks = f" on each of the {local_ranks} ranks of this node" if local_ranks > 1 else ""
        remedies = _remedy(config, world_size, local_ranks, memory)
        raise ConfigError(
            f"{model} needs {_gb(host_per_rank)} of host memory for its {what}{on_ranks} ({layout}) but this machine "
            f"has {_gb(memory.host_bytes)} available: {', '.join([*remedies, SMALLER_PRESET])}, {OVERRIDE}"
        )


def this_node_cluster(world_size: int, local_ranks: int, memory: Memory) -> Cluster:
    """The job as a cluster: nodes of `local_ranks` ranks. A GPU the catalog knows keeps its figures, with this
    rank's free memory; on CPU each rank gets its share of the host (NOMINAL_CPU's speeds: moe-plan ranks with
    them, its --calibrate measures this machine)."""
    nodes = max(1, world_size // max(local_ranks, 1))
    if memory.gpu is None:
        card = dataclasses.replace(NOMINAL_CPU, memory_bytes=host_share(memory, local_ranks))
        return Cluster(nodes, local_ranks, card, NOMINAL_CPU.nvlink_bandwidth, NOMINAL_CPU.nvlink_bandwidth)
    known = gpu_of_device(memory.gpu)
    base = known if known is not None else dataclasses.replace(NOMINAL_GPU, name=memory.gpu)
    card = dataclasses.replace(base, memory_bytes=memory.device_bytes)
    return Cluster(nodes, local_ranks, card, card.nvlink_bandwidth, 50 * GIGA)


# A GPU the catalog does not know is ranked with an H100's speeds (only the order of layouts depends on them).
NOMINAL_GPU = gpu_of_device("NVIDIA H100 80GB HBM3")


def fitting_plans(config: TrainConfig, world_size: int, local_ranks: int, memory: Memory) -> list[Plan]:
    """moe-plan's layouts that fit this job's ranks (nodes of `local_ranks` like this one), fastest first, with the
    host memory their build needs on every rank of a node."""
    cluster = this_node_cluster(world_size, local_ranks, memory)
    headroom = Headroom(reserved_bytes=0.0)  # free memory is measured after CUDA took its own
    host_limit = host_share(memory, local_ranks)
    planning = plan_layouts(config, cluster, headroom=headroom, on_gpu=memory.gpu is not None)
    with configs_frozen():  # the layouts' configs do not change while their builds are weighed
        return [plan for plan in planning.fitting if build_host_bytes(plan.config, world_size) <= host_limit]


def _remedy(config: TrainConfig, world_size: int, local_ranks: int, memory: Memory) -> list[str]:
    """["run <overrides> instead (…)"]: moe-plan's fastest layout that fits these ranks; or, when none does, the
    fewest nodes like this one (doubling) on which one does; [] when none does on MAX_NODES."""
    ranks = f"{world_size} {'GPU' if memory.gpu is not None else 'rank'}{'s' if world_size > 1 else ''}"
    # Every layout's build holds at least the largest block: when even that exceeds this host's share per rank, no
    # layout builds here on any number of nodes, and the search (seconds for a large model) would find none.
    if least_build_host_bytes(config) > host_share(memory, local_ranks):
        return []
    fitting = fitting_plans(config, world_size, local_ranks, memory)
    if fitting:
        best = fitting[0]
        return [f"run {' '.join(best.layout.overrides())} instead (moe-plan's fastest layout that fits these {ranks}, "
                f"{_gb(best.memory.total)} per rank)"]  # fmt: skip

    def best_on(cluster: Cluster) -> Plan | None:
        return next(iter(fitting_plans(config, cluster.world_size, local_ranks, memory)), None)

    here = this_node_cluster(world_size, local_ranks, memory)
    found = smallest_fitting_nodes(config, here.with_changes(nodes=here.nodes * 2), best_on=best_on)
    if found is None:
        return []
    nodes, best = found
    overrides = " ".join(best.layout.overrides())
    return [f"no layout fits these {ranks}: launch {nodes} nodes like this one with {overrides}"]


def plan_refusal(config: TrainConfig, cluster: Cluster) -> str | None:
    """moe-submit's check for a cluster of catalog GPUs: None when the config's own layout fits the planner's usable
    memory, else the sentence saying so with the layout that fits (or the fewest nodes)."""
    if not config.distributed.check_memory:
        return None
    peak = rank_memory(config, cluster.world_size).total
    usable = DEFAULT_HEADROOM.usable(cluster.gpu.memory_bytes)
    if peak <= usable:
        return None
    model = f"this model ({config.model.num_params() / 1e9:.2f} B parameters, {config.trainer.precision})"
    planning = plan_layouts(config, cluster)
    gpus = f"{cluster.world_size} {cluster.gpu.name}"
    if planning.best is not None:
        best = planning.best
        remedy = f"run {' '.join(best.layout.overrides())} instead (moe-plan's fastest layout that fits, " \
                 f"{_gb(best.memory.total)} per GPU)"  # fmt: skip
    else:
        found = smallest_fitting_nodes(config, cluster)
        remedy = (
            f"no layout fits even {MAX_NODES} nodes"
            if found is None
            else f"no layout fits {gpus}: ask for --nodes={found[0]} with {' '.join(found[1].layout.overrides())}"
        )
    return (
        f"{model} needs {_gb(peak)} per GPU at its peak ({_layout(config, cluster.world_size)}) but a "
        f"{cluster.gpu.name} has {_gb(usable)} usable: {remedy}, {OVERRIDE}"
    )


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
