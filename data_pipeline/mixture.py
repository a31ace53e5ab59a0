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
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from data_pipeline.errors import DataConfigError, DataError
from data_pipeline.hf_source import HFSourceConfig
from data_pipeline.order import SampleSequence
from data_pipeline.synthetic import SyntheticConfig

_BLOCK = 4096  # schedule positions computed at a time, ahead of the reads


_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # it becomes a metric key: data/share/<name>, eval/loss/<name>


@dataclass
class MixtureSourceConfig:
    """One source of `data.mixture`: its name, weight, repetition cap, and where its samples come from: prepared
    shards (`path`, as data.source=tokenized reads them) or an inline source config (`synthetic`, `hf`; an hf
    source tokenizes with data.tokenizer)."""

    name: str = ""
    weight: float = 0.0
    max_epochs: Optional[float] = None  # epochs of this source the run may take at most (None: no cap)
    path: Optional[str] = None
    synthetic: Optional[SyntheticConfig] = None
    hf: Optional[HFSourceConfig] = None

    @property
    def kind(self) -> str:
        return "tokenized" if self.path is not None else "synthetic" if self.synthetic is not None else "hf"


def check_sources(sources: Sequence[MixtureSourceConfig]) -> None:
    """The start-up checks of `data.mixture` that need no data: names, one kind each, weights, caps."""
    if not sources:
        raise DataConfigError(
            "data.source=mixture needs data.mixture: a list of {name, weight, path | synthetic | hf} sources"
        )
    names = [source.name for source in sources]
    for index, source in enumerate(sources):
        where = f"data.mixture[{index}]"
        if not _NAME.match(source.name or ""):
            raise DataConfigError(
                f"{where}.name={source.name!r} must be a non-empty name of letters, digits, '_', '.' or '-' "
                "(it names the source's metrics)"
            )
        if names.count(source.name) > 1:
            raise DataConfigError(f"data.mixture names source {source.name!r} twice: give each source its own name")
        given = [key for key in ("path", "synthetic", "hf") if getattr(source, key) is not None]
        if len(given) != 1:
            raise DataConfigError(
                f"{where} ({source.name}) sets {given or 'none'} of path, synthetic, hf: give exactly one of them"
            )
        if source.max_epochs is not None and not source.max_epochs > 0:
            raise DataConfigError(f"{where}.max_epochs={source.max_epochs} must be > 0, or null for no cap")
    normalised_weights(names, [source.weight for source in sources])


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

    def __init__(self, weights: Sequence[float], origin: int = 0):
        if any(w < 0 for w in weights) or not math.isclose(math.fsum(weights), 1.0, abs_tol=1e-9):
            raise ValueError(f"weights {list(weights)} must be >= 0 and sum to 1")
        self.weights = [float(w) for w in weights]
        self.num_sources = len(self.weights)
        drawn = sum(w > 0 for w in self.weights)  # a zero-weight source is never eligible
        self._delta = 0.0 if drawn == 1 else 1.0 / (2 * drawn - 2)
        self._origin = origin
        self._rebase(origin, [0] * self.num_sources)  # counts are since the origin: none there

    def _rebase(self, base: int, counts: list[int]) -> None:
        self._base = base  # first position held in self._sources
        self._base_counts = counts  # c(base) since the origin
        self._sources = np.zeros(0, dtype=np.int16)
        self._next_counts = list(counts)  # c at base + len(self._sources)

    @property
    def origin(self) -> int:
        return self._origin

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
            if w > 0 and w * (t + 1) - c >= self._delta:
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
            self._rebase(self._origin, [0] * self.num_sources)
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
        fingerprints: Optional[Sequence[str]] = None,
    ):
        self.names = list(names)
        self.sequences = list(sequences)
        self.schedule = schedule
        self.offsets = [0] * len(self.names) if offsets is None else [int(o) for o in offsets]
        self.fingerprints = list(fingerprints) if fingerprints is not None else [""] * len(self.names)

    @property
    def weights(self) -> dict[str, float]:
        return dict(zip(self.names, self.schedule.weights, strict=True))

    def state_at(self, position: int) -> dict[str, Any]:
        """What a resume at `position` needs (JSON): the schedule's origin, each source's offset there and
        consumed count now, and the weights and data fingerprints that the resume checks against its own."""
        return {
            "origin": self.origin,
            "offsets": dict(zip(self.names, self.offsets, strict=True)),
            "consumed": self.consumed(position),
            "weights": self.weights,
            "fingerprints": dict(zip(self.names, self.fingerprints, strict=True)),
        }

    def changes_since(self, saved: dict[str, Any]) -> list[str]:
        """What differs between the saved mixture and this one, one phrase each (empty: the same mixture)."""
        changes, weights, fingerprints = [], self.weights, dict(zip(self.names, self.fingerprints, strict=True))
        for name in saved["weights"]:
            if name not in weights:
                changes.append(f"source {name!r} removed")
        for name in self.names:
            if name not in saved["weights"]:
                changes.append(f"source {name!r} added")
                continue
            if not math.isclose(saved["weights"][name], weights[name], rel_tol=1e-12, abs_tol=1e-15):
                changes.append(f"weight of {name!r} {saved['weights'][name]:.6g} -> {weights[name]:.6g}")
            if saved["fingerprints"].get(name) != fingerprints[name]:
                changes.append(f"data of {name!r} changed")
        return changes

    def resume(self, position: int, saved: dict[str, Any], allow_changed: bool) -> list[str]:
        """Continue at global `position` from `saved` (`state_at` of the run that wrote it); returns the changes
        taken in (empty when the mixture is the same). A changed mixture is refused unless `allow_changed`: then a
        new schedule starts at `position` and each source continues from what it had consumed."""
        changes = self.changes_since(saved)
        if changes and not allow_changed:
            raise DataError(
                f"data.mixture differs from the checkpoint's ({'; '.join(changes)}): resume with the mixture it "
                "was saved with, or set data.allow_changed_mixture=true to continue the new one from the consumed "
                "counts"
            )
        if changes:
            self.offsets = [int(saved["consumed"].get(name, 0)) for name in self.names]
            self.schedule = BlendSchedule(self.schedule.weights, origin=position)
            return changes
        self.offsets = [int(saved["offsets"][name]) for name in self.names]
        since_origin = [int(saved["consumed"][name]) - offset for name, offset in zip(self.names, self.offsets,
                                                                                       strict=True)]  # fmt: skip
        self.schedule = BlendSchedule(self.schedule.weights, origin=int(saved["origin"]))
        self.schedule.resume_at(position, since_origin)
        return []

    @property
    def origin(self) -> int:
        return self.schedule.origin

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
        sizes = [sequence.num_samples for sequence in self.sequences]
        check_caps(self.names, self.schedule, caps, sizes, positions, self.consumed(positions))


def check_caps(
    names: Sequence[str],
    schedule: BlendSchedule,
    caps: Sequence[Optional[float]],
    sizes: Sequence[Optional[int]],
    positions: int,
    needed: Optional[dict[str, int]] = None,
) -> None:
    """Each capped source's samples in the first `positions` of the schedule against max_epochs × its size (None:
    not known before reading it, a stream)."""
    if needed is None:
        needed = dict(zip(names, schedule.counts_at(positions), strict=True))
    for name, cap, available in zip(names, caps, sizes, strict=True):
        if cap is None:
            continue
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
