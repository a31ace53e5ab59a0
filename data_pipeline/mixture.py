"""Weighted mixtures: which source each position of the global sample sequence is drawn from.

Schedule. Sources i = 1..k have weights w_i > 0, Σ w_i = 1 (normalised from the config). Positions t = 0, 1, 2, …
of the global sample sequence are assigned one source each; c_i(t) is how many of the first t went to source i.
The rule is Tijdeman's solution of the chairman assignment problem (R. Tijdeman, "The chairman assignment problem",
Discrete Math. 32, 1980), with δ = 1/(2k−2):

    eligible(t) = { i : w_i·(t+1) − c_i(t) ≥ δ }                  choosing i keeps c_i ≤ w_i·(t+1) + 1 − δ
    source(t)   = argmin over eligible(t) of (c_i(t) + 1 − δ) / w_i   earliest deadline first (ties: lowest i)

and it keeps every prefix within the bound

    |c_i(t) − w_i·t| ≤ 1 − 1/(2k−2)     for every source i and every t      (k ≥ 2; k = 1 is exact)

which is below one sample and the best bound that holds for every k and every weights. Megatron's
`BlendedDataset` picks the source of greatest sampling error (argmax w_i·(t+1) − c_i): simpler, but for four or more
sources with small weights it drifts past one sample (tests/data_pipeline/test_mixture.py measures both).

The choice at t depends only on (t, c(t)), so the schedule continues from any saved (t, c) exactly as it would have
run from 0: resuming needs the counts, not a replay. Nothing depends on world size or micro-batch size; ranks cut
their slice of a step from the same global sequence (order.BatchLayout).

A changed mixture (`data.allow_changed_mixture`) starts a new schedule at the resume position: its `origin`. Each
source continues its own sample sequence from what it had consumed (`offsets` at the origin); the new weights
apply from the origin on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import numpy as np

from data_pipeline.errors import DataConfigError, DataError
from data_pipeline.order import SampleSequence

_BLOCK = 4096  # schedule positions computed at a time, ahead of the reads


def normalised_weights(names: Sequence[str], weights: Sequence[float]) -> list[float]:
    """Weights as shares summing to 1; a negative, non-finite or all-zero set is refused naming the key."""
    for name, weight in zip(names, weights, strict=True):
        if not math.isfinite(weight) or weight < 0:
            raise DataConfigError(f"data.mixture: source {name!r} has weight {weight}: weights must be finite and >= 0")
    total = math.fsum(weights)
    if not total > 0:
        raise DataConfigError(
            f"data.mixture weights {list(weights)} do not sum to a positive number: give a source a weight > 0"
        )
    return [w / total for w in weights]


def deviation_bound(num_sources: int) -> float:
    """max over i, t of |c_i(t) − w_i·t| under the schedule: 1 − 1/(2k−2) for k sources of positive weight, and 0
    for one."""
    return 0.0 if num_sources == 1 else 1.0 - 1.0 / (2 * num_sources - 2)


class BlendSchedule:
    """The source of every position from `origin` on, computed lazily in blocks and kept from the last rebase."""

    def __init__(self, weights: Sequence[float], origin: int = 0, counts: Optional[Sequence[int]] = None):
        if any(w < 0 for w in weights) or not math.isclose(math.fsum(weights), 1.0, abs_tol=1e-9):
            raise ValueError(f"weights {list(weights)} must be >= 0 and sum to 1")
        self.weights = [float(w) for w in weights]
        self.num_sources = len(self.weights)
        drawn = sum(w > 0 for w in self.weights)  # a zero-weight source is never eligible
        self._delta = 0.0 if drawn == 1 else 1.0 / (2 * drawn - 2)
        self._origin = origin
        self._origin_counts = [0] * self.num_sources if counts is None else [int(c) for c in counts]
        self._rebase(origin, list(self._origin_counts))

    def _rebase(self, base: int, counts: list[int]) -> None:
        self._base = base  # first position held in self._sources
        self._base_counts = counts  # c(base) since the origin
        self._sources = np.zeros(0, dtype=np.int16)
        self._next_counts = list(counts)  # c at base + len(self._sources)

    def resume_at(self, position: int, counts: Sequence[int]) -> None:
        """Continue from `position`, where each source had given `counts` samples since the origin: the positions
        from there on are those the schedule gives from the origin (the choice depends on (t, c(t)) alone)."""
        if position < self._origin:
            raise ValueError(f"position {position} precedes the schedule's origin {self._origin}")
        self._rebase(position, [int(c) for c in counts])

    def _choose(self, t: int, counts: list[int]) -> int:
        """Eligible sources' earliest deadline; t counts from the origin."""
        best, best_deadline = -1, math.inf
        for i, (w, c) in enumerate(zip(self.weights, counts, strict=True)):
            if w * (t + 1) - c >= self._delta:
                deadline = (c + 1 - self._delta) / w
                if deadline < best_deadline:
                    best, best_deadline = i, deadline
        return best  # Σ_i (w_i·(t+1) − c_i) = 1, so some source has at least 1/k >= δ

    def _extend(self, length: int) -> None:
        counts, start = self._next_counts, self._base + len(self._sources) - self._origin
        block = np.empty(length, dtype=np.int16)
        for offset in range(length):
            i = self._choose(start + offset, counts)
            counts[i] += 1
            block[offset] = i
        self._sources = np.concatenate([self._sources, block])

    def counts_at(self, position: int) -> list[int]:
        """c(position): samples each source gave to the positions [origin, position)."""
        self._cover(position, 0)
        done = np.bincount(self._sources[: position - self._base], minlength=self.num_sources)
        return [int(c + d) for c, d in zip(self._base_counts, done, strict=True)]

    def sources(self, start: int, count: int) -> np.ndarray:
        """Source index of positions [start, start + count) (int16)."""
        self._cover(start, count)
        return self._sources[start - self._base : start - self._base + count]

    def _cover(self, start: int, count: int) -> None:
        if start < self._origin:
            raise ValueError(f"position {start} precedes the schedule's origin {self._origin}")
        if start < self._base:  # going back (rare: a replay before the last read): from the origin again
            self._rebase(self._origin, list(self._origin_counts))
        held = len(self._sources)
        if start - self._base > 2 * _BLOCK and start - self._base <= held:  # forget what reads have moved past
            done = np.bincount(self._sources[: start - self._base], minlength=self.num_sources)
            self._base_counts = [int(c + d) for c, d in zip(self._base_counts, done, strict=True)]
            self._base, self._sources = start, self._sources[start - self._base :]
        missing = start + count - (self._base + len(self._sources))
        if missing > 0:
            self._extend(max(missing, _BLOCK))


class MixedSamples:
    """The global sample sequence of a mixture: position t reads the next sample of `schedule.sources(t)`.

    Source i's samples are its own sequence (its seeded permutation per epoch), read from `offsets[i]` (what it
    had consumed at the schedule's origin) on. `read` returns within-source sample ids; `read_sources` says whose.
    """

    num_samples = None  # a mixture has no epoch of its own: each source has its own

    def __init__(
        self,
        names: Sequence[str],
        sequences: Sequence[SampleSequence],
        schedule: BlendSchedule,
        offsets: Optional[Sequence[int]] = None,
    ):
        self.names = list(names)
        self.sequences = list(sequences)
        self.schedule = schedule
        self.offsets = [0] * len(self.names) if offsets is None else [int(o) for o in offsets]

    @property
    def origin(self) -> int:
        return self.schedule._origin

    def consumed(self, position: int) -> dict[str, int]:
        """Samples each source has given to the global positions [0, position)."""
        counts = self.schedule.counts_at(position)
        return {name: offset + count for name, offset, count in zip(self.names, self.offsets, counts, strict=True)}

    def read_sources(self, start: int, count: int) -> np.ndarray:
        return self.schedule.sources(start, count).astype(np.int64)

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        sources = self.schedule.sources(start, count)
        first = self.schedule.counts_at(start)
        ids, windows = np.empty(count, dtype=np.int64), None
        for i, sequence in enumerate(self.sequences):
            rows = np.flatnonzero(sources == i)
            if len(rows) == 0:
                continue
            # a source's positions in one read are consecutive in its own sequence
            source_ids, source_windows = sequence.read(self.offsets[i] + first[i], len(rows))
            if windows is None:
                windows = np.empty((count, source_windows.shape[1]), dtype=source_windows.dtype)
            ids[rows], windows[rows] = source_ids, source_windows
        return ids, windows

    def check_capacity(self, positions: int, caps: Sequence[Optional[float]]) -> None:
        """Refuse, with the numbers, a run of `positions` global samples that would take a source past its
        `max_epochs` cap (None: no cap)."""
        needed = self.consumed(positions)
        for name, sequence, cap in zip(self.names, self.sequences, caps, strict=True):
            if cap is None:
                continue
            available = sequence.num_samples
            if available is None:
                raise DataConfigError(
                    f"data.mixture: source {name!r} has max_epochs={cap} but its size is not known before reading "
                    "it (a stream): remove max_epochs or use a map-style or tokenized source"
                )
            if needed[name] > cap * available:
                raise DataError(
                    f"data.mixture: source {name!r} would give {needed[name]} samples to {positions} global samples, "
                    f"{needed[name] / available:.2f} epochs of its {available}, past its max_epochs={cap}: lower its "
                    "weight or trainer.max_steps, add data to it, or raise its max_epochs"
                )
