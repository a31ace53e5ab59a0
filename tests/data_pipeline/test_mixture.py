"""The mixture schedule: every prefix within the stated bound of weight × n, continuation from saved counts, the
same global sequence at any world size, each source read in its own order, and caps refused with the numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from data_pipeline.errors import DataConfigError, DataError
from data_pipeline.mixture import BlendSchedule, MixedSamples, deviation_bound, normalised_weights
from data_pipeline.order import BatchLayout, IndexedSamples
from data_pipeline.packing import TokenBuffer

AWKWARD = {
    "two_uneven": [0.999, 0.001],
    "thirds": [1, 1, 1],
    "four_halving": [0.6, 0.25, 0.1, 0.05],
    "five_irrational": [math.pi, math.e, 1, 0.01, 0.3],
    # Megatron's greatest-sampling-error rule drifts 1.05 samples from weight × n on this one
    "five_tiny": [0.01559758, 0.00080782, 0.00075924, 0.40731903, 0.57551633],
    "with_a_zero": [0.5, 0.0, 0.3, 0.2],
}


def prefix_deviation(sources: np.ndarray, weights: list[float]) -> float:
    """max over t, i of |c_i(t) − w_i·t| for the schedule's first len(sources) positions."""
    counts_TK = np.cumsum(np.eye(len(weights), dtype=np.int64)[sources], axis=0)
    t_T1 = np.arange(1, len(sources) + 1)[:, None]
    return float(np.abs(counts_TK - t_T1 * np.asarray(weights)).max())


def greatest_sampling_error(weights: list[float], n: int) -> np.ndarray:
    """Megatron's BlendedDataset rule, for comparison: argmax_i w_i·(t+1) − c_i."""
    counts, out = np.zeros(len(weights)), np.empty(n, dtype=np.int64)
    for t in range(n):
        out[t] = i = int(np.argmax(np.asarray(weights) * (t + 1) - counts))
        counts[i] += 1
    return out


@pytest.mark.parametrize("name", AWKWARD)
def test_every_prefix_stays_within_the_stated_bound_below_one_sample(name: str) -> None:
    weights = normalised_weights([str(i) for i in range(len(AWKWARD[name]))], AWKWARD[name])
    sources = BlendSchedule(weights).sources(0, 20_000)
    drawn = sum(w > 0 for w in weights)
    assert prefix_deviation(sources, weights) <= deviation_bound(drawn) + 1e-9 < 1
    assert not np.any(sources[np.asarray(weights)[sources] == 0]), "a zero-weight source is never drawn"
    if name == "five_tiny":
        assert prefix_deviation(greatest_sampling_error(weights, 20_000), weights) > 1


def test_the_bound_holds_for_random_weights_of_two_to_five_sources() -> None:
    rng = np.random.default_rng(0)
    for _ in range(100):
        k = int(rng.integers(2, 6))
        weights = normalised_weights([str(i) for i in range(k)], list(rng.random(k) ** 3 + 1e-3))
        assert prefix_deviation(BlendSchedule(weights).sources(0, 2_000), weights) <= deviation_bound(k) + 1e-9


def test_a_schedule_resumed_from_saved_counts_continues_as_if_never_stopped() -> None:
    weights = normalised_weights(["a", "b", "c"], [0.5, 0.3, 0.2])
    straight = BlendSchedule(weights).sources(0, 30_000).copy()
    for position in (1, 4095, 4096, 12_345):
        counts = BlendSchedule(weights).counts_at(position)
        resumed = BlendSchedule(weights)
        resumed.resume_at(position, counts)
        assert np.array_equal(resumed.sources(position, 30_000 - position), straight[position:])
        assert resumed.counts_at(30_000) == np.bincount(straight, minlength=3).tolist()
    # reads that go back before the last one recompute from the origin
    schedule = BlendSchedule(weights)
    schedule.sources(20_000, 10)
    assert np.array_equal(schedule.sources(5, 100), straight[5:105])


def test_a_new_origin_restarts_the_blend_at_the_new_weights() -> None:
    weights = normalised_weights(["a", "b"], [0.9, 0.1])
    changed = BlendSchedule(weights, origin=1000)
    assert changed.counts_at(1000) == [0, 0] and changed.counts_at(1010) == [9, 1]
    with pytest.raises(ValueError, match="precedes the schedule's origin"):
        changed.sources(999, 1)


def corpus(seed: int, num_tokens: int, width: int) -> IndexedSamples:
    tokens = np.random.default_rng(seed).integers(0, 100, num_tokens).astype(np.uint16)
    return IndexedSamples(TokenBuffer([tokens]), width, seed=seed)


def mixture(weights: list[float], offsets=None) -> MixedSamples:
    names = [f"s{i}" for i in range(len(weights))]
    sequences = [corpus(i, 500 * (i + 1) * 9, 9) for i in range(len(weights))]
    return MixedSamples(names, sequences, BlendSchedule(normalised_weights(names, weights)), offsets)


def global_sequence(samples: MixedSamples, world_size: int, micro: int, steps: int, global_batch: int = 16):
    """(source ids, within-source ids, windows) of `steps` global batches, concatenated in (rank, micro) order."""
    sources, ids, windows = [], [], []
    for step in range(steps):
        for rank in range(world_size):
            layout = BatchLayout(global_batch, world_size, rank, micro)
            for m in range(layout.accumulation_steps):
                start = layout.micro_batch_start(step, m)
                sources.append(samples.read_sources(start, micro))
                batch_ids, batch_windows = samples.read(start, micro)
                ids.append(batch_ids)
                windows.append(batch_windows)
    return np.concatenate(sources), np.concatenate(ids), np.concatenate(windows)


def test_the_global_sequence_is_the_same_at_any_world_size_and_each_source_reads_in_its_own_order() -> None:
    weights = [0.55, 0.3, 0.15]
    one = global_sequence(mixture(weights), 1, 16, 64)
    for world_size, micro in ((2, 4), (4, 2), (4, 4)):
        other = global_sequence(mixture(weights), world_size, micro, 64)
        assert all(np.array_equal(a, b) for a, b in zip(one, other, strict=True))
    sources, ids, windows = one
    for i in range(3):
        alone = corpus(i, 500 * (i + 1) * 9, 9)
        mine = np.flatnonzero(sources == i)
        expected_ids, expected_windows = alone.read(0, len(mine))  # past an epoch end too: source 0 wraps
        assert np.array_equal(ids[mine], expected_ids) and np.array_equal(windows[mine], expected_windows)
    assert len(np.flatnonzero(sources == 0)) > corpus(0, 4500, 9).num_samples, "source 0 went into a second epoch"


def test_offsets_continue_each_source_where_it_stopped() -> None:
    weights = [0.5, 0.5]
    samples = mixture(weights, offsets=[7, 3])
    sources, ids, _ = global_sequence(samples, 1, 8, 2)
    assert np.array_equal(ids[sources == 0], corpus(0, 4500, 9).read(7, 16)[0])
    assert np.array_equal(ids[sources == 1], corpus(1, 9000, 9).read(3, 16)[0])
    assert samples.consumed(32) == {"s0": 7 + 16, "s1": 3 + 16}


def test_a_source_capped_below_what_the_run_needs_is_refused_with_the_numbers() -> None:
    samples = mixture([0.8, 0.2])  # s0: 500 samples per epoch, s1: 1000
    samples.check_capacity(1000, [2.0, 1.0])
    with pytest.raises(DataError, match=r"'s0' would give 800 samples to 1000 global samples, 1.60 epochs of its 500"):
        samples.check_capacity(1000, [1.5, None])


@pytest.mark.parametrize(
    "weights, match",
    [([0.5, -0.1], "weight -0.1: weights must be finite and >= 0"), ([0, 0], "do not sum to a positive number"),
     ([float("nan"), 1], "weight nan")],
)  # fmt: skip
def test_bad_weights_are_refused_in_one_sentence(weights, match) -> None:
    with pytest.raises(DataConfigError, match=match):
        normalised_weights(["a", "b"], weights)
