"""Each per-step addition of `moe-train`, switched off in turn inside one running trainer (`trainer_overhead.py
--ablate` launches this file as it launches `moe-train`).

What a step of the trainer does that the bare loop of trainer_overhead.py does not, by name:

    liveness     the completed step written to the c10d store at every boundary (train/liveness.py)
    preemption   the preemption flag's asynchronous all-reduce and the wait for the last one (train/preemption.py)
    nan_guard    the loss poisoned when it is not finite, the grad norm's finiteness verdict, the skip counter
    grad_norm    the global grad norm: read from DeepSpeed's engine, or torch's clip (DDP, single); off, 0 is returned
                 and nothing is clipped (the bare DDP loop clips: there this measures the clip itself)
    moe_stats    the MoE layers' raw counts added up per micro-batch, and their all-reduce in the window's log
    bias_update  the aux-loss-free bias step and its one all-reduce of every layer's load (the bare loop does it too)
    data         the loader's `next()` inside the step; off, the window's batches were read into memory before
                 the loop, as the bare loop reads all of its batches
    faults       the fault-injection points (train/faults.py: a lookup in an empty list when MOE_FAULTS is unset)

Timed but never switched off (a log needs them): `window`, the step's losses, grad norm and counts added to the
log window (LogWindow.add; its merge of the MoE counts is timed under moe_stats too), and `log`, the window's log
(reductions, record, sinks; the progress bar is off in the bench). The peak-memory probe measures one step, inside
the warm-up; on every other step it is an empty context manager.

How: the trainer runs unchanged but for thin wrappers around those calls, each of which does nothing while its name
is in the current OFF set. After `warmup` steps, the log windows (`trainer.log_every` steps each) are dealt to the
variants: `none` (everything on), each name above alone, and `all`, in a fresh seeded order each cycle, the same on
every rank. A window's time runs from the end of one log to the end of the next, so the log that reduces a
window's counts is timed with the variant that collected them; the stamps are rank 0's perf_counter, written with
each window's variant to MOE_ABLATION_OUT when `fit` returns. One process for all variants shares its start-up and
meets whatever else loads the machine in every variant alike.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import sys
import time
from collections import deque
from pathlib import Path

# Run as a script, this folder comes first on the path, and its data_pipeline.py would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ADDITIONS = ("liveness", "preemption", "nan_guard", "grad_norm", "moe_stats", "bias_update", "data", "faults")
VARIANTS = ("none", *ADDITIONS, "all")
OFF: set[str] = set()  # what the current window switches off


def schedule(cycles: int, seed: int = 0) -> list[str]:
    """The variant of each timed window: every variant once per cycle, in a fresh order each cycle."""
    rng = random.Random(seed)
    order: list[str] = []
    for _ in range(cycles):
        cycle = list(VARIANTS)
        rng.shuffle(cycle)
        order += cycle
    return order


def switched_off(variant: str) -> set[str]:
    return set(ADDITIONS) if variant == "all" else set() if variant == "none" else {variant}


def install(warmup: int, log_every: int, cycles: int, out: str | None) -> None:
    """Wrap the trainer's per-step additions so that OFF switches them, and deal the windows to the variants."""
    from moe_platform import faults
    from moe_platform.train import trainer as trainer_module
    from moe_platform.train.liveness import Liveness
    from moe_platform.train.nan_guard import NanGuard
    from moe_platform.train.preemption import PreemptionWatch

    Trainer = trainer_module.Trainer
    order = schedule(cycles)
    stamps: dict[int, float] = {}
    inside: dict[str, float] = {}  # seconds spent inside each addition's calls since the window began
    inside_at: dict[int, dict[str, float]] = {}  # ... by the step that closed each window
    prefetched: deque = deque()
    to_prefetch = [0]  # batches the data-off windows take: set by `fit`, read as the loop's batches are made

    @contextlib.contextmanager
    def timing(name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            inside[name] = inside.get(name, 0.0) + time.perf_counter() - start

    def timed(name: str, original):
        def call(*args, **kwargs):
            with timing(name):
                return original(*args, **kwargs)

        return call

    def unless_off(name: str, original, replacement):
        on = timed(name, original)

        def call(*args, **kwargs):
            return replacement(*args, **kwargs) if name in OFF else on(*args, **kwargs)

        return call

    trainer_module.LogWindow.add = timed("window", trainer_module.LogWindow.add)  # never off: a log needs it
    Liveness.step_done = unless_off("liveness", Liveness.step_done, lambda self, step: None)
    PreemptionWatch.requested = unless_off("preemption", PreemptionWatch.requested, lambda self: False)
    trainer_module.poison_nonfinite = unless_off("nan_guard", trainer_module.poison_nonfinite, lambda loss: loss)
    NanGuard.step_is_finite = unless_off("nan_guard", NanGuard.step_is_finite, lambda self, norm: True)
    NanGuard.step_applied = unless_off("nan_guard", NanGuard.step_applied, lambda self: None)
    Trainer._clip_gradients = unless_off("grad_norm", Trainer._clip_gradients, lambda self: 0.0)
    trainer_module._moe_stats = unless_off("moe_stats", trainer_module._moe_stats, lambda output: {})
    trainer_module._add_stats = unless_off("moe_stats", trainer_module._add_stats, lambda total, new: total)
    trainer_module.step_balancing_biases = unless_off(
        "bias_update", trainer_module.step_balancing_biases, lambda *args, **kwargs: None
    )
    faults.point = unless_off("faults", faults.point, lambda where, step: None)

    class Batches(trainer_module.TimedBatches):
        """The loader, or (data off) batches read into memory before the loop, as many as the data windows take."""

        def __init__(self, batches) -> None:
            super().__init__(batches)
            prefetched.extend(next(batches) for _ in range(to_prefetch[0]))

        def __next__(self) -> dict:
            if "data" in OFF:
                return prefetched.popleft()
            with timing("data"):
                return super().__next__()

    trainer_module.TimedBatches = Batches
    original_fit, original_log = Trainer.fit, Trainer._log

    def fit(self):
        data_windows = sum("data" in switched_off(variant) for variant in order)
        to_prefetch[0] = data_windows * log_every * self.grad_accum
        result = original_fit(self)
        if out and self.accelerator.is_main_process:
            bounds = sorted(stamps)
            windows = [
                {
                    "variant": order[i],
                    "s_per_step": (stamps[b] - stamps[a]) / (b - a),
                    "inside_s_per_step": {name: s / (b - a) for name, s in inside_at[b].items()},
                }
                for i, (a, b) in enumerate(itertools.pairwise(bounds))
            ]
            Path(out).write_text(json.dumps({"windows": windows}))
        return result

    def log(self, window):
        with timing("log"):
            record = original_log(self, window)
        step = self.state.step
        if step >= warmup:  # the end of this log opens the next window: switch to its variant
            stamps[step] = time.perf_counter()
            inside_at[step] = dict(inside)
            index = (step - warmup) // log_every
            OFF.clear()
            if index < len(order):
                OFF.update(switched_off(order[index]))
        inside.clear()
        return record

    Trainer.fit, Trainer._log = fit, log


def main() -> None:
    """`python trainer_ablation.py WARMUP LOG_EVERY CYCLES -- moe-train overrides...`"""
    warmup, log_every, cycles = (int(a) for a in sys.argv[1:4])
    install(warmup, log_every, cycles, os.environ.get("MOE_ABLATION_OUT"))
    sys.argv = ["moe-train", *sys.argv[5:]]
    from moe_platform.launch.cli import main as moe_train

    moe_train()


if __name__ == "__main__":
    main()
