"""Measured peak memory of one training step, beside the ledger's prediction of it.

    predicted = weights + gradients + optimizer state (ledger, per rank) + activations of one micro-batch (ledger;
                under pipeline parallelism of every micro-batch the rank holds in flight)
    measured  = the most bytes live tensors held at any moment of the step (forward, backward, optimizer step)

On a GPU the measurement is `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`. On CPU torch keeps
no such counter, so the step runs under `torch.profiler` with `profile_memory=True`, which records every
allocation and free of the CPU allocator: the peak is the bytes held at the start (every storage a Python-reachable
tensor holds: weights, optimizer state, buffers, the batch) plus the highest running sum of those records. The
profiler slows the step it watches, so a run measures one step only: the second it runs, the first with the
optimizer state in place (AdamW creates it lazily in the first step).

Imports only torch and `moe`, so a bench on a bare GPU image can use it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe.config import ModelConfig, memoized_by_config
from moe.ledger import (
    FP32_BYTES,
    PARAM_DTYPE_BYTES,
    RunShape,
    activation_bytes_per_rank,
    expert_received_bytes,
    held_params_by_rank,
    sharding_peak_bytes,
    training_state_bytes_per_rank,
)
from moe.model import Transformer

if TYPE_CHECKING:  # moe_platform.config brings omegaconf and data_pipeline, which a bare GPU image lacks
    from moe_platform.config import TrainConfig


@dataclass
class PeakMemory:
    """Filled in when the measured block exits: peak bytes, bytes held at its start, and how they were measured."""

    peak_bytes: float = float("nan")
    start_bytes: float = float("nan")
    method: str = ""


@contextlib.contextmanager
def measure_peak(device: torch.device | str, start_bytes: float | None = None) -> Iterator[PeakMemory]:
    """Measure the peak bytes of live tensors on `device` (cuda or cpu) while the block runs.

    On CPU `start_bytes` may say what the block starts from (e.g. `storage_bytes` of a model and its optimizer);
    by default it is every CPU tensor Python can reach, right for a process that holds one run, not for a test
    process that still holds other tests' tensors."""
    device = torch.device(device)
    result = PeakMemory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result.start_bytes = float(torch.cuda.memory_allocated(device))
        yield result
        torch.cuda.synchronize(device)
        result.peak_bytes = float(torch.cuda.max_memory_allocated(device))
        result.method = "torch.cuda.max_memory_allocated"
        return
    if device.type != "cpu":
        raise ValueError(f"cannot measure peak memory on {device}: only cuda and cpu are supported")
    result.start_bytes = float(live_cpu_storage_bytes() if start_bytes is None else start_bytes)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    result.peak_bytes = result.start_bytes + _highest_running_sum(prof)
    result.method = "CPU allocator records (torch.profiler, profile_memory=True)"


def _highest_running_sum(prof: torch.profiler.profile) -> float:
    """The highest running sum of the step's CPU allocation records (frees negative), in time order.

    The profiler records only what threads it profiles allocate and free. A tensor whose last reference a gloo worker
    thread drops (a collective's buffer, when the worker finishes after the caller moved on: a race, run to run)
    is freed unrecorded, and would count as held to the end. The allocator reuses freed addresses, so an
    allocation at an address a recorded block still holds proves that block was freed: its bytes leave the sum
    there, the latest moment it can have been freed. And the allocator does not report frees of blocks allocated
    before the profiler started (torch warns once), so such a block freed inside counts as held to the end. Both
    keep the figure an upper bound, by at most the bytes of blocks freed unrecorded and never reused."""
    records = sorted(
        (event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size)
        for event in _every_event(prof.profiler.kineto_results.experimental_event_tree())
        if event.tag == torch._C._profiler._EventType.Allocation and event.extra_fields.device.type == "cpu"
    )
    held = highest = 0
    blocks: dict[int, int] = {}  # address: bytes, of blocks allocated inside and not yet freed
    for _, address, nbytes in records:
        if nbytes > 0:
            held += nbytes - blocks.get(address, 0)  # a block still here was freed unrecorded
            blocks[address] = nbytes
        elif blocks.pop(address, None) is not None:
            held += nbytes
        highest = max(highest, held)
    return highest


def _every_event(events):
    for event in events:
        yield event
        yield from _every_event(event.children)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    storages.pop(0, None)  # empty tensors
    return sum(storages.values())


def training_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, their gradients, buffers and the optimizer's state tensors: what a step starts from."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return tensors


def live_cpu_storage_bytes() -> int:
    """Bytes of the distinct CPU storages behind every tensor Python can reach (views counted once)."""
    gc.collect()  # garbage in reference cycles still holds memory, but the next collection would free it
    storages = {}
    for obj in gc.get_objects():
        # issubclass on type(obj), not isinstance: isinstance reads __class__, which some modules' lazy
        # attributes turn into deprecation warnings.
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_sparse:
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a tensor without memory: torch.compile's fake and functional tensors
                continue
    storages.pop(0, None)  # empty tensors
    return sum(storages.values())


@dataclass(frozen=True)
class PeakPrediction:
    """The ledger's per-rank bytes for one training step: training state, one micro-batch's activations, and under
    FSDP and ZeRO-3 what they gather, its unsharded gradients and reduce-scatter input
    (`moe.ledger.sharding_peak_bytes`: under FSDP2 the gradients and reduce-scatter input beyond a block's)."""

    state_bytes: float
    activation_bytes: float
    transient_bytes: float = 0.0

    @property
    def total(self) -> float:
        return self.state_bytes + self.activation_bytes + self.transient_bytes


def predict_peak(config: ModelConfig, run: RunShape, pipeline_rank: int | None = None) -> PeakPrediction:
    """Training state per rank (weights + gradients + master + optimizer) + one micro-batch's activations (+ under
    FSDP and ZeRO-3 what they gather and reduce beyond the shards), from the ledger. Under pipeline parallelism
    the figures of `pipeline_rank`'s stages, its activations those of every micro-batch it holds in flight
    (`moe.ledger.pipeline_activation_bytes`); None: the pipeline rank whose sum is largest.

    Gradients and the full activations never peak together (backward frees activations as it writes gradients,
    and the optimizer's temporaries come after both), so this sum bounds the step's tensors from above up to
    what neither counts: transients inside one op, the gradient of the logits, the batch itself."""

    def of_rank(p: int | None) -> PeakPrediction:
        state = training_state_bytes_per_rank(config, run, p)
        activations = activation_bytes_per_rank(config, run, p)
        return PeakPrediction(state.total, activations, sharding_peak_bytes(config, run, p))

    if run.pipeline_size == 1 or pipeline_rank is not None:
        return of_rank(pipeline_rank)
    return max((of_rank(p) for p in range(run.pipeline_size)), key=lambda prediction: prediction.total)


# ---- communication buffers and offload: what the ledger's tables leave out -------------------------------------
#
# torch 2.13 DDP as Accelerate builds it (DistributedDataParallelKwargs: bucket_cap_mb=25, gradient_as_bucket_view=
# False, torch's defaults; we pass none): the reducer copies every gradient it reduces into flat buckets of its own,
# allocated beside `.grad` and kept for the run, so they hold as many bytes as those gradients (the 25 MiB cap only
# says how they are split).
DDP_GRADIENT_AS_BUCKET_VIEW = False
# DeepSpeed 0.19.8's ZeRO defaults (deepspeed/runtime/zero/config.py). parallel/accelerator.py's deepspeed_config sets
# no bucket sizes, and Accelerate fills them only where a config says "auto", so these hold for our runs:
#   * reduce_bucket_size: ZeRO-1/2 (setup_buckets, at every step's first backward) and ZeRO-3 (at start-up) allocate
#     a contiguous-gradient (IPG) buffer of this many elements whatever the model's size, in the grad-accumulation
#     dtype, which is the weights' (4 B fp32, 2 B bf16); ZeRO-1/2 allocate a second one under overlap_comm, which
#     deepspeed_config turns on with GPUs only;
#   * stage3_param_persistence_threshold: ZeRO-3 keeps every parameter of at most this many elements whole on every
#     rank (a norm, a router, a small expert matrix), beside its partition.
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
ZERO3_PARAM_PERSISTENCE_THRESHOLD = 100_000


@dataclass(frozen=True)
class RankMemory:
    """One rank's peak bytes by part (the device's on a GPU; on CPU all in host memory)."""

    weights: float
    gradients: float
    optimizer: float  # AdamW m, v + DeepSpeed's fp32 master partition
    activations: float  # ledger's activations at the peak (pipeline: every micro-batch in flight)
    gathered: float  # FSDP2 / ZeRO-3 gathered units, unsharded grads, reduce-scatter input (sharding_peak_bytes)
    buffers: float  # communication buffers: DDP's gradient buckets, DeepSpeed's IPG buckets, flat all-reduce inputs
    offloaded: float = 0.0  # bytes ZeRO-Offload / FSDP cpu_offload moves to host memory (NOT in total)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.gathered + self.buffers


@memoized_by_config
def _zero3_persistent_params(model: ModelConfig) -> int:
    """Parameters ZeRO-3 never partitions: those of at most ZERO3_PARAM_PERSISTENCE_THRESHOLD elements, counted on
    the real module (built on the meta device: no memory)."""
    return sum(
        p.numel() for p in meta_transformer(model).parameters() if p.numel() <= ZERO3_PARAM_PERSISTENCE_THRESHOLD
    )


def meta_transformer(model: ModelConfig) -> Transformer:
    """The model's modules with every parameter on the meta device: their names and shapes, no memory, no fills."""
    with torch.device("meta"), _initialisers_skipped():
        return Transformer(model)


_INITIALISERS = ("normal_", "trunc_normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")


@contextlib.contextmanager
def _initialisers_skipped() -> Iterator[None]:
    """torch.nn.init's fills as no-ops: only shapes are wanted, and the first fill of a meta tensor imports
    torch._dynamo (its meta kernel is a traced Python decomposition), ~2 s that moe-plan would pay for nothing."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, initialiser in saved.items():
            setattr(torch.nn.init, name, initialiser)


def _buffers(config: TrainConfig, run: RunShape, pipeline_rank: int | None, on_gpu: bool) -> tuple[float, float]:
    """(held for the run, transient at the gradient reduction) communication bytes of one rank.

    DDP: its buckets, the gradients of what it reduces (all but the routed experts under EP) × 4 B (fp32 weights in
    either precision). Our own reductions (parallel/expert_parallel.py `sum_and_divide`: the experts' under EP, and
    under PP every gradient of a stage) concatenate the gradients into one flat fp32 buffer after backward: the
    larger of the replicated (PP) and the expert block's. DeepSpeed: its IPG buffer(s), above."""
    dist = config.distributed
    dense, routed = held_params_by_rank(config.model, run)[pipeline_rank or 0]
    experts = routed // run.ep_size
    if dist.strategy == "deepspeed":
        p = PARAM_DTYPE_BYTES[run.precision]
        copies = 2 if run.zero_stage in (1, 2) and on_gpu else 1  # overlap_comm's second buffer
        return (DEEPSPEED_REDUCE_BUCKET_ELEMENTS * p * copies if run.zero_stage else 0.0), 0.0
    if dist.strategy != "ddp" or run.dp_size * run.pipeline_size == 1:
        return 0.0, 0.0  # FSDP's reduce-scatter input is the ledger's; one process has nothing to reduce
    if run.pipeline_size > 1:  # no torch DDP: sync_gradients flattens the replicated, then the experts' gradients
        replicated = dense + (0 if run.ep_size > 1 else routed)
        return 0.0, max(replicated, experts if run.ep_size > 1 else 0) * FP32_BYTES
    reduced_by_ddp = dense + (0 if run.ep_size > 1 else routed)
    held = 0.0 if DDP_GRADIENT_AS_BUCKET_VIEW else reduced_by_ddp * FP32_BYTES
    return held, (experts * FP32_BYTES if run.ep_size > 1 else 0.0)


def rank_peak(
    config: TrainConfig, world_size: int, pipeline_rank: int | None = None, *, imbalance: float = 1.0,
    on_gpu: bool = True,
) -> RankMemory:  # fmt: skip
    """One rank's peak by part (under PP pipeline rank `pipeline_rank`'s, which must be given): the ledger's training
    state, sharding transients and activations, plus what the ledger leaves out, communication buffers and ZeRO-3's
    persistent parameters, with offload's share moved out of the total.

    The peak is where backward starts (every activation and the logits' gradients live) or where the gradients are
    reduced after it (activations freed, the reduction's flat buffer live), whichever is higher, so a transient
    buffer counts only beyond the activations: peak = state + gathered + held buffers + max(activations, transient).
    `imbalance` f >= 1 (the most-loaded EP rank's received assignments over the mean) adds (f - 1) × the activations
    that grow with them (`moe.ledger.expert_received_bytes`)."""
    if imbalance < 1:
        raise ValueError(f"imbalance={imbalance} is the most-loaded rank's load over the mean, at least 1")
    run = config.run_shape(world_size)
    if run.pipeline_size > 1 and pipeline_rank is None:
        raise ValueError("under pipeline parallelism say which pipeline rank (plan.memory.rank_memory takes the worst)")
    model, dist = config.model, config.distributed
    state = training_state_bytes_per_rank(model, run, pipeline_rank)
    activations = activation_bytes_per_rank(model, run, pipeline_rank)
    if run.ep_size > 1:
        activations += (imbalance - 1) * expert_received_bytes(model, run, pipeline_rank)
    gathered = sharding_peak_bytes(model, run, pipeline_rank)
    if run.zero_stage == 3:
        gathered += _zero3_persistent_params(model) * PARAM_DTYPE_BYTES[run.precision]
    held, transient = _buffers(config, run, pipeline_rank, on_gpu)
    weights, gradients, optimizer = state.weights, state.gradients, state.master + state.optimizer
    offloaded = 0.0
    if dist.strategy == "fsdp" and dist.fsdp.cpu_offload:  # FSDP2's CPUOffloadPolicy: every shard on the host
        offloaded, weights, gradients, optimizer = weights + gradients + optimizer, 0.0, 0.0, 0.0
    if dist.strategy == "deepspeed" and dist.offload_optimizer:  # fp32 master, m, v (and ZeRO-2/3's grad partition)
        moved_gradients = gradients if run.zero_stage >= 2 else 0.0
        offloaded, optimizer, gradients = optimizer + moved_gradients, 0.0, gradients - moved_gradients
    if dist.strategy == "deepspeed" and dist.offload_params:  # ZeRO-3's weight partitions
        offloaded, weights = offloaded + weights, 0.0
    buffers = held + max(0.0, transient - activations)
    return RankMemory(weights, gradients, optimizer, activations, gathered, buffers, offloaded)


def predicted_peak_per_rank(config: TrainConfig, world_size: int, *, on_gpu: bool) -> list[float]:
    """`rank_peak` of each of `world_size` ranks (rank r runs pipeline rank r // (W/PP)), uniform routing, in the
    memory the step's measurement sees: the device's on a GPU (the total), everything on CPU (offload included)."""
    run = config.run_shape(world_size)
    peaks = []
    for rank in range(world_size):
        memory = rank_peak(config, world_size, rank // run.dp_size if run.pipeline_size > 1 else None, on_gpu=on_gpu)
        peaks.append(memory.total if on_gpu else memory.total + memory.offloaded)
    return peaks


class PeakMemoryProbe:
    """Measures the second training step a process runs (the first with optimizer state), once per run."""

    MEASURED_CALL = 2

    def __init__(self, device: torch.device | str, enabled: bool = True) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self.calls = 0
        self.result: PeakMemory | None = None
        self.recorded = False

    @contextlib.contextmanager
    def around_step(self, window=None) -> Iterator[None]:
        """Measure this step if it is the chosen one. On CPU the profiler slows the step several times over, so a
        measured step is taken out of `window`'s tokens/s (`LogWindow.untimed`); on GPU reading the counter is free."""
        self.calls += 1
        if not self.enabled or self.calls != self.MEASURED_CALL or self.device.type not in ("cpu", "cuda"):
            yield
            return
        untimed = window.untimed() if window is not None and self.device.type == "cpu" else contextlib.nullcontext()
        with untimed, measure_peak(self.device) as self.result:
            yield

    def record(self, accelerator, predicted_per_rank: Sequence[float]) -> dict[str, list[float]]:
        """Collective, in the first log after the measured step (every rank measures the same step): each rank's
        measured peak (a list over ranks, one gather) beside the prediction for each rank; {} before and after."""
        if self.result is None or self.recorded:
            return {}
        self.recorded = True
        local = torch.tensor([self.result.peak_bytes], dtype=torch.float64, device=accelerator.device)
        measured = accelerator.gather(local).tolist()
        return {"memory/peak_bytes_per_rank": measured, "plan/peak_bytes_per_rank": list(predicted_per_rank)}

    def describe(self, prediction: PeakPrediction) -> str:
        """One line: measured beside predicted, or why nothing was measured."""
        predicted = (
            f"predicted {_mib(prediction.total)} (state {_mib(prediction.state_bytes)} + activations "
            f"{_mib(prediction.activation_bytes)}"
            + (f" + gathered {_mib(prediction.transient_bytes)}" if prediction.transient_bytes else "")
            + ")"
        )
        if self.result is None:
            return f"peak memory per rank: not measured (it is measured in a run's second step); {predicted}"
        ratio = self.result.peak_bytes / prediction.total
        return (
            f"peak memory per rank, one training step: measured {_mib(self.result.peak_bytes)} "
            f"({self.result.method}), {predicted}; measured / predicted = {ratio:.2f}"
        )


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"
