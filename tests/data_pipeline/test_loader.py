"""Order, sharding and resume of the train loader, and the validation loader (synthetic source: fast)."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest

from data_pipeline import DataConfig, DataError, SyntheticConfig, ValConfig, build_loaders

SMALL = SyntheticConfig(num_tokens=40_000)


def _config(**kwargs) -> DataConfig:
    defaults = {"synthetic": SMALL, "seq_len": 31, "global_batch_size": 8, "seed": 0, "val": ValConfig(fraction=0.0)}
    return DataConfig(**(defaults | kwargs))


def _ids(loader, num_micro_batches: int) -> list[int]:
    batches = iter(loader)
    return np.concatenate([next(batches)["sample_ids"].numpy() for _ in range(num_micro_batches)]).tolist()


def test_batches_have_shifted_labels_and_the_documented_shapes():
    loaders = build_loaders(_config(), 0, 1)
    batch = next(iter(loaders.train))
    assert batch["input_ids"].shape == batch["labels"].shape == (8, 31)
    assert batch["sample_ids"].shape == (8,)
    assert all(t.dtype.is_floating_point is False and t.dtype.itemsize == 8 for t in batch.values())
    assert np.array_equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert (loaders.vocab_size, loaders.eos_id, loaders.pad_id) == (258, 256, 257)


def test_same_seed_same_batches_and_different_seed_different(global_steps):
    steps, windows = global_steps(_config(), 1, 8, 20)
    steps_again, windows_again = global_steps(_config(), 1, 8, 20)
    other_steps, _ = global_steps(_config(seed=1), 1, 8, 20)
    assert steps == steps_again
    assert all(np.array_equal(a, b) for a, b in zip(windows, windows_again, strict=True))
    assert steps != other_steps


@pytest.mark.parametrize("world_size,micro_batch_size", [(2, 4), (2, 2), (4, 2), (4, 1)])
def test_global_batches_do_not_depend_on_world_size_or_accumulation(global_steps, world_size, micro_batch_size):
    reference, reference_windows = global_steps(_config(), 1, 8, 12)
    steps, windows = global_steps(_config(), world_size, micro_batch_size, 12)
    assert steps == reference
    assert all(np.array_equal(a, b) for a, b in zip(windows, reference_windows, strict=True))


def test_each_epoch_visits_every_sample_once_and_epochs_differ():
    loader = build_loaders(_config(), 0, 1).train
    n = loader.num_samples
    ids = _ids(loader, -(-2 * n // 8) + 1)  # a little over two epochs; steps straddle the epoch boundary
    assert sorted(ids[:n]) == list(range(n))
    assert sorted(ids[n : 2 * n]) == list(range(n))
    assert ids[:n] != ids[n : 2 * n]


@pytest.mark.parametrize("resume_step", [0, 1, 7, 155])  # from step 155 the run crosses the epoch end (n = 1258)
@pytest.mark.parametrize("resume_world_size,resume_micro", [(1, 8), (2, 2)])
def test_resume_equals_the_uninterrupted_stream(global_steps, resume_step, resume_world_size, resume_micro):
    total_steps = resume_step + 6
    uninterrupted, _ = global_steps(_config(), 1, 8, total_steps)
    first = build_loaders(_config(), 0, 1, 4).train  # save from a run with accumulation (a = 2)
    batches = iter(first)
    for _ in range(resume_step * first.accumulation_steps):
        next(batches)
    state = first.state_dict()
    assert state["samples_consumed"] == resume_step * 8
    resumed, _ = global_steps(_config(), resume_world_size, resume_micro, 6, state=state)
    assert uninterrupted[:resume_step] + resumed == uninterrupted
    if resume_step == 155:  # the resumed steps straddle the epoch boundary (a step mixes two epochs)
        assert resume_step * 8 < first.num_samples < total_steps * 8 and first.num_samples % 8


def test_a_partly_iterated_step_is_replayed_after_resume():
    loader = build_loaders(_config(), 0, 1, 2).train  # 4 micro-batches per step
    batches = iter(loader)
    step0 = [next(batches)["sample_ids"].tolist() for _ in range(4)]
    step1_partial = [next(batches)["sample_ids"].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state["samples_consumed"] == 8  # the unfinished step does not count
    resumed = build_loaders(_config(), 0, 1, 2).train
    resumed.load_state_dict(state)
    assert [b["sample_ids"].tolist() for b in islice(resumed, 3)] == step1_partial
    assert step0[0] != step1_partial[0]


def test_resume_refuses_a_different_seed_or_corpus():
    state = build_loaders(_config(), 0, 1).train.state_dict()
    with pytest.raises(ValueError, match="seed"):
        build_loaders(_config(seed=5), 0, 1).train.load_state_dict(state)
    with pytest.raises(DataError, match="packed samples"):
        build_loaders(_config(seq_len=15), 0, 1).train.load_state_dict(state)


@pytest.mark.parametrize("world_size,micro_batch_size", [(1, 8), (2, 4), (4, 1)])
def test_validation_sees_the_same_samples_for_any_world_size(world_size, micro_batch_size):
    config = _config(val=ValConfig(fraction=0.3, max_batches=3))
    reference = build_loaders(config, 0, 1).val
    expected = [b["sample_ids"].tolist() for b in reference]
    assert len(expected) == 3 and expected[0] == list(range(8))
    per_rank = [list(build_loaders(config, r, world_size, micro_batch_size).val) for r in range(world_size)]
    a = len(per_rank[0]) // 3
    for step in range(3):
        got = [i for r in range(world_size) for b in per_rank[r][step * a : (step + 1) * a] for i in b["sample_ids"]]
        assert got == expected[step]
    # validation is re-iterable and identical each time
    assert [b["sample_ids"].tolist() for b in reference] == expected


def test_layout_errors_name_the_fields_to_change():
    with pytest.raises(ValueError, match="micro_batch_size"):
        build_loaders(_config(), 0, 2, 3)
    with pytest.raises(ValueError, match="rank"):
        build_loaders(_config(), 2, 2)
    with pytest.raises(DataError, match=r"val\.fraction"):
        build_loaders(_config(val=ValConfig(fraction=0.001)), 0, 1)
    with pytest.raises(DataError, match="vocab_size"):
        build_loaders(_config(), 0, 1, model_vocab_size=200)
