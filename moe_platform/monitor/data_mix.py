"""Per-source figures of a data mixture: the tokens each source gave to a log window, their share beside the weight.

A mixture's schedule is one global sequence (data_pipeline/mixture.py), so every rank knows every source's count
without a reduction: a window's figures are the loader's consumed counts at its end minus those at its start.

    data/tokens/<name>   tokens (labels) of source <name> in the window's global batches
    data/share/<name>    its share of the window's tokens; over a window of n samples it is within
                         (1 − 1/(2k−2))·2/n of the weight (a difference of two prefixes, each within the bound)
    data/weight/<name>   the configured weight, normalised
"""

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
