"""Every layout the platform accepts for a config on a cluster, which of them fit, and which is fastest.

A layout is the strategy (DDP, ZeRO-1/2/3, FSDP2, HSDP with R replicas), the expert-parallel size EP, the pipeline
size PP with its schedule, the micro-batch size and the activation checkpointing mode; gradient accumulation
follows from the config's global batch (global / (micro · W/PP)). `candidate_layouts` enumerates them all;
`plan_layouts` applies each to the config the way its Hydra overrides would (`Layout.overrides`, which moe-plan
prints in the `moe-submit` command), keeps those `validate_launch` accepts, predicts each one's peak memory per rank
(plan/memory.py) and step time (plan/time_model.py), and ranks those that fit by predicted step time.

A layout fits when its worst rank's predicted peak is at most the usable memory: the GPU's memory less `Headroom`
(what CUDA, NCCL and the allocator keep that no tensor counts). Offload is not planned: it trades time for memory
in ways this model does not time (moe-train's start-up check still counts it).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from moe.checkpointing import MODES as CHECKPOINTING
from moe.config import configs_frozen
from moe.stages import SCHEDULES
from moe_platform.config import (
    ConfigError,
    DistributedConfig,
    FSDPConfig,
    PipelineConfig,
    TrainConfig,
    validate_launch,
)
from moe_platform.plan.hardware import GIB, Cluster
from moe_platform.plan.imbalance import Imbalance, from_config
from moe_platform.plan.memory import RankMemory, rank_memory
from moe_platform.plan.time_model import DEFAULT_ASSUMPTIONS, Assumptions, StepTime, step_time

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
PIPELINE_STRATEGIES = ("ddp", "fsdp", "hsdp")  # DeepSpeed's engine does not run under our pipeline schedules
# The Hydra keys a layout sets; moe-plan's command replaces the user's own values of them with the layout's.
LAYOUT_KEYS = (
    "distributed",
    "distributed.strategy",
    "distributed.zero_stage",
    "distributed.offload_optimizer",
    "distributed.offload_params",
    "distributed.expert_parallel_size",
    "distributed.fsdp",
    "distributed.pipeline_parallel_size",
    "distributed.pipeline",
    "trainer.micro_batch_size",
    "trainer.activation_checkpointing",
)


@dataclass(frozen=True)
class Headroom:
    """Device memory no tensor of the run counts: the CUDA context and cuBLAS workspaces (~0.5-1 GiB), NCCL's
    communicators and their buffers (~0.5-1 GiB at a few groups), and the caching allocator's fragmentation
    (a share of what it holds). Priors, overridable (`moe-plan --reserve-gib`, `--fragmentation`)."""

    reserved_bytes: float = 2 * GIB
    fragmentation: float = 0.05

    def usable(self, memory_bytes: float) -> float:
        return memory_bytes * (1 - self.fragmentation) - self.reserved_bytes


DEFAULT_HEADROOM = Headroom()


@dataclass(frozen=True)
class Layout:
    strategy: str  # one of STRATEGIES
    expert_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    checkpointing: str = "none"
    replicate_size: int = 1  # HSDP's replicas

    def overrides(self) -> list[str]:
        """The Hydra overrides that select this layout (conf/distributed's presets, then its fields)."""
        out = [f"distributed={self.strategy}"]  # conf/distributed/<strategy>.yaml
        if self.strategy == "hsdp":
            out.append(f"distributed.fsdp.replicate_size={self.replicate_size}")
        if self.expert_parallel_size > 1:
            out.append(f"distributed.expert_parallel_size={self.expert_parallel_size}")
        if self.pipeline_parallel_size > 1:
            out += [
                f"distributed.pipeline_parallel_size={self.pipeline_parallel_size}",
                f"distributed.pipeline.schedule={self.schedule}",
            ]
        out += [
            f"trainer.micro_batch_size={self.micro_batch_size}",
            f"trainer.activation_checkpointing={self.checkpointing}",
        ]
        return out

    def describe(self) -> str:
        """`FSDP × EP 8 × PP 2 (1f1b), micro 2, ckpt full`: one line for the table."""
        name = {"ddp": "DDP", "fsdp": "FSDP", "hsdp": f"HSDP {self.replicate_size}×"}.get(
            self.strategy, f"ZeRO-{self.strategy[-1]}"
        )
        parts = [name]
        if self.expert_parallel_size > 1:
            parts.append(f"EP {self.expert_parallel_size}")
        if self.pipeline_parallel_size > 1:
            parts.append(f"PP {self.pipeline_parallel_size} {self.schedule}")
        return " × ".join(parts)


def apply_layout(config: TrainConfig, layout: Layout) -> TrainConfig:
    """`config` with the layout's distributed and trainer fields, as composing its overrides after the user's would
    give (the user's backend, timeout and memory-check settings kept); raises ConfigError where the platform
    refuses it."""
    base = config.distributed
    zero_stage = int(layout.strategy[-1]) if layout.strategy.startswith("zero") else 0
    strategy = "deepspeed" if zero_stage else ("fsdp" if layout.strategy == "hsdp" else layout.strategy)
    distributed = DistributedConfig(
        strategy=strategy,
        zero_stage=zero_stage,
        backend=base.backend,
        timeout_s=base.timeout_s,
        check_memory=base.check_memory,
        expert_parallel_size=layout.expert_parallel_size,
        fsdp=FSDPConfig(replicate_size=layout.replicate_size if layout.strategy == "hsdp" else 1),
        pipeline_parallel_size=layout.pipeline_parallel_size,
        pipeline=PipelineConfig(schedule=layout.schedule) if layout.pipeline_parallel_size > 1 else PipelineConfig(),
    )
    trainer = dataclasses.replace(
        config.trainer, micro_batch_size=layout.micro_batch_size, activation_checkpointing=layout.checkpointing
    )
    return dataclasses.replace(config, distributed=distributed, trainer=trainer)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(config: TrainConfig, world_size: int) -> Iterator[Layout]:
    """Every combination the grid spans at `world_size` ranks: PP dividing W (at most the layer count), EP dividing
    both the experts and W/PP, micro-batches dividing the rows each data-parallel rank takes per step, HSDP's R
    dividing W/PP; the platform's own checks then decide (`plan_layouts`)."""
    model = config.model
    experts = model.moe.num_experts if model.moe is not None else 1
    modes = [mode for mode in CHECKPOINTING if mode != "moe" or model.moe is not None]
    for pp in (d for d in _divisors(world_size) if d <= model.n_layers):
        dp = world_size // pp
        rows = config.data.global_batch_size // dp if config.data.global_batch_size % dp == 0 else 0
        micro_sizes = [b for b in _divisors(rows) if b & (b - 1) == 0] if rows else []
        eps = [ep for ep in _divisors(dp) if experts % ep == 0]
        strategies = STRATEGIES if pp == 1 else PIPELINE_STRATEGIES
        schedules = SCHEDULES if pp > 1 else ("1f1b",)
        for strategy, ep, schedule, micro, mode in itertools.product(strategies, eps, schedules, micro_sizes, modes):
            replicas = [r for r in _divisors(dp) if 1 < r < dp] if strategy == "hsdp" else [1]
            for r in replicas:
                yield Layout(strategy, ep, pp, schedule, micro, mode, r)


@dataclass(frozen=True)
class Plan:
    """One layout, applied: its config, predicted memory of the worst rank and step time, and whether it fits."""

    layout: Layout
    config: TrainConfig
    memory: RankMemory
    time: StepTime | None  # None for a layout that does not fit: it is not timed
    usable_bytes: float
    world_size: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.usable_bytes - self.memory.total

    @property
    def grad_accum(self) -> int:
        return self.config.run_shape(self.world_size).grad_accum


@dataclass(frozen=True)
class Planning:
    """What `plan_layouts` found: the plans that fit, fastest first; those that do not, smallest first; and why the
    platform refused the rest (first sentence of each refusal, counted)."""

    fitting: list[Plan]
    too_large: list[Plan]
    refused: Counter
    too_large_unweighed: int = 0  # layouts whose memory floor a smaller micro-batch of theirs already exceeded

    @property
    def not_fitting(self) -> int:
        return len(self.too_large) + self.too_large_unweighed

    @property
    def best(self) -> Plan | None:
        return self.fitting[0] if self.fitting else None


def plan_layouts(
    config: TrainConfig,
    cluster: Cluster,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    headroom: Headroom = DEFAULT_HEADROOM,
    *,
    imbalance: Imbalance | None = None,
    on_gpu: bool = True,
) -> Planning:
    """Every candidate layout at the cluster's size, applied, checked, predicted and sorted (`Planning`); expert
    load planned by `imbalance` (default: the config's, plan/imbalance.py) at each layout's EP size."""
    imbalance = from_config(config.model) if imbalance is None else imbalance
    with configs_frozen():  # the model does not change while its layouts are weighed
        return _plan_layouts(config, cluster, assumptions, headroom, imbalance, on_gpu)


def _plan_layouts(config, cluster, assumptions, headroom, imbalance, on_gpu) -> Planning:
    W = cluster.world_size
    usable = headroom.usable(cluster.gpu.memory_bytes)
    fitting, too_large, refused = [], [], Counter()
    # A layout's training state and gathered units do not depend on its micro-batch or checkpointing mode; once they
    # alone exceed the GPU, the group's other micro-batches and modes cannot fit either and are counted, not weighed.
    over_floor: set[Layout] = set()
    unweighed = 0
    for layout in candidate_layouts(config, W):
        group = dataclasses.replace(layout, micro_batch_size=0, checkpointing="")
        if group in over_floor:
            unweighed += 1
            continue
        try:
            applied = apply_layout(config, layout)
            validate_launch(applied, W, has_gpu=on_gpu)
        except ConfigError as err:
            refused[str(err).split(":")[0]] += 1
            continue
        factor = imbalance.factor(layout.expert_parallel_size)
        memory = rank_memory(applied, W, imbalance=factor, on_gpu=on_gpu)
        if memory.total > usable:
            too_large.append(Plan(layout, applied, memory, None, usable, W))
            if memory.weights + memory.gradients + memory.optimizer + memory.gathered > usable:
                over_floor.add(group)
            continue
        fitting.append(
            Plan(layout, applied, memory, step_time(applied, cluster, assumptions, imbalance=factor), usable, W)
        )
    fitting.sort(key=lambda plan: (plan.time.total, plan.memory.total))
    too_large.sort(key=lambda plan: plan.memory.total)
    return Planning(fitting, too_large, refused, unweighed)


# The most nodes a refusal searches for (a 32K-GPU cluster at 8 per node).
MAX_NODES = 4096


def smallest_fitting_nodes(
    config: TrainConfig,
    cluster: Cluster,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    headroom: Headroom = DEFAULT_HEADROOM,
    *,
    imbalance: Imbalance | None = None,
    max_nodes: int = MAX_NODES,
    best_on: Callable[[Cluster], Plan | None] | None = None,
) -> tuple[int, Plan] | None:
    """The fewest nodes among the cluster's count doubled k times (clusters are allocated, and global batches
    divide, in powers of two) on which some layout fits, with its best plan; None when not even `max_nodes` do.
    `best_on(cluster)` replaces the planner's own best plan when a caller has more to check (the start-up check:
    host memory for the build)."""
    if best_on is None:

        def best_on(cluster_here: Cluster) -> Plan | None:
            return plan_layouts(config, cluster_here, assumptions, headroom, imbalance=imbalance).best

    nodes = cluster.nodes
    while nodes <= max_nodes:
        best = best_on(cluster.with_changes(nodes=nodes))
        if best is not None:
            return nodes, best
        nodes *= 2
    return None
