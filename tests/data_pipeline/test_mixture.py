"""The mixture schedule: every prefix within the stated bound of weight × n, continuation from saved counts, the
same global sequence at any world size, each source read in its own order, and caps refused with the numbers."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from data_pipeline import DataConfig, SyntheticConfig, ValConfig, build_loaders, preflight
from data_pipeline.errors import DataConfigError, DataError
from data_pipeline.mixture import (
    BlendSchedule,
    MixedSamples,
    MixtureSourceConfig,
    deviation_bound,
    normalised_weights,
)
from data_pipeline.order import BatchLayout, IndexedSamples
from data_pipeline.packing import TokenBuffer
from data_pipeline.prefetch import Prefetched

AWKWARD = {
    "two_uneven": [0.999, 0.001],
    "thirds": [1, 1, 1],
    "four_halving": [0.6, 0.25, 0.1, 0.05],
    "five_irrational": [math.pi, math.e, 1, 0.01, 0.3],
    # Megatron's greatest-sampling-error rule drifts 1.05 samples from weight × n on this one
    "five_tiny": [0.01559758, 0.00080782, 0.00075924, 0.40731903, 0.57551633],
    "with_a_zero": [0.5, 0.0, 0.3, 0.2],
    "one_drawn_one_zero": [0.0, 1.0],
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


# ---- the mixture as data.source=mixture: loaders, resume, refusals, prefetch ---------------------------------------


def synthetic_source(name: str, weight: float, seed: int, num_tokens: int = 30_000, **kwargs) -> MixtureSourceConfig:
    return MixtureSourceConfig(name=name, weight=weight, synthetic=SyntheticConfig(num_tokens=num_tokens, seed=seed),
                               **kwargs)  # fmt: skip


THREE = [synthetic_source("web", 0.6, 1), synthetic_source("code", 0.25, 2), synthetic_source("math", 0.15, 3)]


def mixture_config(sources=THREE, **kwargs) -> DataConfig:
    defaults = {"seq_len": 31, "global_batch_size": 8, "val": ValConfig(fraction=0.0), "prefetch": 0}
    return DataConfig(source="mixture", mixture=list(sources), **(defaults | kwargs))


def test_the_mixed_batches_are_the_same_at_world_sizes_1_2_4_and_resume_exactly_at_another(global_steps) -> None:
    config = mixture_config()
    steps, windows = global_steps(config, 1, 8, 30)
    for world_size, micro in ((2, 2), (4, 1), (4, 2)):
        other_steps, other_windows = global_steps(config, world_size, micro, 30)
        assert other_steps == steps and all(np.array_equal(a, b) for a, b in zip(windows, other_windows, strict=True))
    train = build_loaders(config, 0, 1).train
    batches = iter(train)
    for _ in range(17):  # mid-epoch of every source, and a micro-batch into step 18 that must not count
        next(batches)
    state = json.loads(json.dumps(train.state_dict()))  # as a checkpoint holds it
    assert state["samples_consumed"] == 17 * 8 and sum(state["mixture"]["consumed"].values()) == 17 * 8
    resumed_steps, resumed_windows = global_steps(config, 2, 2, 13, state=state)
    assert resumed_steps == steps[17:]
    assert all(np.array_equal(a, b) for a, b in zip(windows[17:], resumed_windows, strict=True))


def test_the_share_of_each_source_in_every_prefix_is_within_the_bound() -> None:
    train = build_loaders(mixture_config(), 0, 1).train
    batches = iter(train)
    for step in range(1, 60):
        next(batches)
        counts, n = train.source_counts(), step * 8
        assert all(abs(counts[name] - weight * n) <= deviation_bound(3) + 1e-9
                   for name, weight in train.source_weights().items())  # fmt: skip


def test_a_changed_mixture_is_refused_unless_allowed_and_then_continues_from_the_consumed_counts(caplog) -> None:
    train = build_loaders(mixture_config(), 0, 1).train
    batches = iter(train)
    for _ in range(10):
        next(batches)
    state = train.state_dict()
    reweighted = [synthetic_source("web", 0.5, 1), synthetic_source("code", 0.25, 2), synthetic_source("math", 0.25, 3)]
    other_data = [*THREE[:2], synthetic_source("math", 0.15, 4)]
    changes = [
        (reweighted, "weight of 'web' 0.6 -> 0.5; weight of 'math' 0.15 -> 0.25)"),
        (other_data, "data of 'math' changed)"),
        (THREE[:2], "source 'math' removed; weight of 'web' 0.6 -> 0.705882"),  # the weights renormalised
    ]
    for sources, change in changes:
        with pytest.raises(DataError, match=re.escape(f"data.mixture differs from the checkpoint's ({change}")):
            build_loaders(mixture_config(sources), 0, 1).train.load_state_dict(state)
    allowed = build_loaders(mixture_config(reweighted, allow_changed_mixture=True), 0, 1).train
    with caplog.at_level(logging.WARNING, logger="data_pipeline.loader"):
        allowed.load_state_dict(state)
    assert "weight of 'web' 0.6 -> 0.5" in caplog.text
    batches = iter(allowed)
    for _ in range(10):
        next(batches)
    consumed, before = allowed.source_counts(), state["mixture"]["consumed"]
    assert {name: consumed[name] - before[name] for name in consumed} == {"web": 40, "code": 20, "math": 20}


def test_bad_mixtures_are_refused_in_one_sentence() -> None:
    refusals = [
        (dict(sources=[synthetic_source("web", 0.0, 1), synthetic_source("code", 0.0, 2)]), "do not sum to a positive"),
        (dict(sources=[synthetic_source("web", 1, 1), synthetic_source("web", 1, 2)]), "names source 'web' twice"),
        (dict(sources=[MixtureSourceConfig(name="web", weight=1)]), "sets none of path, synthetic, hf"),
        (dict(sources=[synthetic_source("a b", 1, 1)]), "data.mixture[0].name='a b' must be"),
        (dict(sources=[]), "data.source=mixture needs data.mixture"),
        (dict(sources=[synthetic_source("web", 1, 1, max_epochs=0)]), "max_epochs=0 must be > 0"),
    ]
    for kwargs, match in refusals:
        with pytest.raises(DataConfigError, match=re.escape(match)):
            mixture_config(**kwargs)
    with pytest.raises(DataConfigError, match=r"data\.mixture is set but data\.source='synthetic'"):
        DataConfig(mixture=list(THREE))
    other_vocab = [
        THREE[0],
        MixtureSourceConfig(name="big", weight=1, synthetic=SyntheticConfig(num_domains=8, num_tokens=30_000)),
    ]
    with pytest.raises(DataError, match="source 'big' has a vocabulary of 514 with EOS 512, source 'web' 258 with EOS"):
        build_loaders(mixture_config(other_vocab), 0, 1)
    capped = [synthetic_source("web", 0.9, 1, max_epochs=1.0), synthetic_source("code", 0.1, 2)]
    with pytest.raises(
        DataError, match=r"source 'web' would give 1800 samples to 2000 global samples, \d\.\d\d epochs"
    ):
        preflight(mixture_config(capped), 1024, total_samples=2000)


def test_prefetch_gives_the_same_batches_and_a_prefetched_batch_is_not_consumed() -> None:
    plain = iter(build_loaders(mixture_config(prefetch=0), 0, 2, 2).train)
    expected = [next(plain) for _ in range(12)]
    train = build_loaders(mixture_config(prefetch=3), 0, 2, 2).train
    batches = iter(train)
    got = [next(batches) for _ in range(5)]
    time.sleep(0.05)  # the thread has run ahead by now
    assert train.samples_consumed == 2 * 8, "two whole steps taken; the prefetched ones do not count"
    got += [next(batches) for _ in range(7)]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(expected, got, strict=True) for k in a)
    assert train.samples_consumed == 6 * 8


def test_an_error_while_prefetching_is_raised_at_the_batch_it_belongs_to() -> None:
    def items():
        yield 1
        yield 2
        raise DataError("bad row 3")

    prefetched = Prefetched(items(), depth=2)
    assert [next(prefetched), next(prefetched)] == [1, 2]
    with pytest.raises(DataError, match="bad row 3"):
        next(prefetched)


def test_a_mixture_of_prepared_corpora_blends_them_and_refuses_a_re_prepared_one(
    tmp_path, corpus, global_steps
) -> None:
    """Two prepared directories (each half of the corpus) as sources: the same blend at 1 and 2 ranks; preparing
    one again from other files changes its data fingerprint, which the resume refuses."""
    from data_pipeline import HFSourceConfig, TokenizerConfig, prepare

    def prepared(name: str, files: list[str], overwrite: bool = False) -> str:
        hf = HFSourceConfig(path="json", data_files=files, cache_dir=corpus["cache_dir"])
        prepare(hf, TokenizerConfig(), str(tmp_path / name), 1, progress=False, overwrite=overwrite)
        return str(tmp_path / name)

    first, second = corpus["files"]
    sources = [MixtureSourceConfig(name="a", weight=0.7, path=prepared("a", [first])),
               MixtureSourceConfig(name="b", weight=0.3, path=prepared("b", [second]))]  # fmt: skip
    config = mixture_config(sources)
    steps, _ = global_steps(config, 1, 8, 12)
    assert global_steps(config, 2, 4, 12)[0] == steps
    train = build_loaders(config, 0, 1).train
    batches = iter(train)
    for _ in range(5):
        next(batches)
    state = train.state_dict()
    prepared("b", [first], overwrite=True)
    with pytest.raises(DataError, match=re.escape("(data of 'b' changed)")):
        build_loaders(config, 0, 1).train.load_state_dict(state)
    capped = mixture_config([replace(sources[0], max_epochs=1.0), sources[1]])
    preflight(capped, 1024, total_samples=8)
    with pytest.raises(DataError, match=r"source 'a' would give \d+ samples to 100000 global samples"):
        preflight(capped, 1024, total_samples=100_000)
