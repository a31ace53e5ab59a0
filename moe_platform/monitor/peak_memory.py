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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from moe.config import ModelConfig
from moe.ledger import RunShape, activation_bytes_per_rank, sharding_transient_bytes, training_state_bytes_per_rank


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
    # The allocator does not report frees of blocks allocated before the profiler started (torch warns once), so
    # a storage alive at the start and freed inside counts as held to the end: an upper bound by its bytes (in a
    # training step, the previous step's batch).
    records = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    held = highest = 0
    for _, nbytes in records:
        held += nbytes
        highest = max(highest, held)
    result.peak_bytes = result.start_bytes + highest
    result.method = "CPU allocator records (torch.profiler, profile_memory=True)"


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
    (`moe.ledger.sharding_transient_bytes`)."""

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
        return PeakPrediction(state.total, activations, sharding_transient_bytes(config, run, p).total)

    if run.pipeline_size == 1 or pipeline_rank is not None:
        return of_rank(pipeline_rank)
    return max((of_rank(p) for p in range(run.pipeline_size)), key=lambda prediction: prediction.total)


class PeakMemoryProbe:
    """Measures the second training step a process runs (the first with optimizer state), once per run."""

    MEASURED_CALL = 2

    def __init__(self, device: torch.device | str, enabled: bool = True) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self.calls = 0
        self.result: PeakMemory | None = None

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
