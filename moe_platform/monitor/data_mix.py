"""Per-source figures of a data mixture: the tokens each source gave to a log window, their share beside the weight.

A mixture's schedule is one global sequence (data_pipeline/mixture.py), so every rank knows every source's count
without a reduction: a window's figures are the loader's consumed counts at its end minus those at its start.

    data/tokens/<name>   tokens (labels) of source <name> in the window's global batches
    data/share/<name>    its share of the window's tokens; over a window of n samples it is within
                         (1 − 1/(2k−2))·2/n of the weight (a difference of two prefixes, each within the bound)
    data/weight/<name>   the configured weight, normalised

and, for every run, how long the loop waited for its batches (`TimedBatches`):

    data_wait_frac       seconds spent in the loader's next() over the window's training seconds (eval and
                         checkpoints excluded, as for tokens/s); data.prefetch is what keeps it near 0
"""

import time
from collections.abc import Iterator
from typing import Any

from data_pipeline import TrainLoader


class MixtureWindow:
    """Counts at the last log; `record()` gives the window since then and starts the next one."""

    def __init__(self, loader: TrainLoader, tokens_per_sample: int):
        self.loader = loader
        self.tokens_per_sample = tokens_per_sample
        self.start = loader.source_counts()

    def record(self) -> dict[str, Any]:
        now = self.loader.source_counts()
        if now is None or self.start is None:
            return {}
        taken = {name: now[name] - self.start.get(name, 0) for name in now}
        total = sum(taken.values())
        self.start = now
        record: dict[str, Any] = {}
        for name, weight in self.loader.source_weights().items():
            record[f"data/tokens/{name}"] = taken[name] * self.tokens_per_sample
            record[f"data/share/{name}"] = taken[name] / total if total else float("nan")
            record[f"data/weight/{name}"] = weight
        return record


class TimedBatches:
    """The loader's iterator, counting the seconds the training loop waits in `next()`."""

    def __init__(self, batches: Iterator[dict]):
        self.batches = batches
        self.waited_s = 0.0

    def __iter__(self) -> "TimedBatches":
        return self

    def __next__(self) -> dict:
        begin = time.perf_counter()
        batch = next(self.batches)
        self.waited_s += time.perf_counter() - begin
        return batch

    def record(self, window_s: float) -> dict[str, float]:
        """The wait since the last record over `window_s` training seconds; starts the next window."""
        waited, self.waited_s = self.waited_s, 0.0
        return {"data_wait_frac": waited / window_s if window_s > 0 else float("nan")}
