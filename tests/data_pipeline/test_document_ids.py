"""data.document_mask: each packed input token's document id, for block-diagonal causal attention."""

from __future__ import annotations

import itertools

import pytest
import torch

from data_pipeline import DataConfig, SyntheticConfig, ValConfig, build_loaders


def synthetic_config(**data) -> DataConfig:
    # Short documents so that every window holds several boundaries.
    synthetic = SyntheticConfig(num_tokens=2**15, mean_doc_len=8.0)
    fields = {"seq_len": 32, "global_batch_size": 8, "val": ValConfig(fraction=0.05)} | data
    return DataConfig(source="synthetic", synthetic=synthetic, **fields)


def assert_documents_follow_eos(batch: dict[str, torch.Tensor], eos_id: int) -> None:
    """The id is 0 at the window's first token and rises by one exactly after each EOS, never elsewhere."""
    ids_BT, documents_BT = batch["input_ids"], batch["document_ids"]
    assert documents_BT.shape == ids_BT.shape and documents_BT.dtype == torch.int64
    assert (documents_BT[:, 0] == 0).all()
    assert torch.equal(documents_BT.diff(dim=1), (ids_BT[:, :-1] == eos_id).long())


def test_synthetic_document_ids_change_exactly_after_each_eos() -> None:
    loaders = build_loaders(synthetic_config(document_mask=True), 0, 1, 4)
    batches = [*itertools.islice(iter(loaders.train), 6), *loaders.val]
    for batch in batches:
        assert_documents_follow_eos(batch, loaders.eos_id)
    assert max(int(b["document_ids"].max()) for b in batches) >= 2, "the corpus packs several documents per window"


def test_document_mask_changes_no_token_and_is_absent_by_default() -> None:
    plain = build_loaders(synthetic_config(), 0, 1, 4)
    masked = build_loaders(synthetic_config(document_mask=True), 0, 1, 4)
    for a, b in zip(itertools.islice(iter(plain.train), 4), itertools.islice(iter(masked.train), 4), strict=True):
        assert "document_ids" not in a
        assert all(torch.equal(a[key], b[key]) for key in ("input_ids", "labels", "sample_ids"))


def test_document_ids_resume_exactly() -> None:
    config = synthetic_config(document_mask=True)
    straight = iter(build_loaders(config, 0, 1, 4).train)
    expected = [next(straight) for _ in range(6)]  # 3 global steps of 2 micro-batches
    first = build_loaders(config, 0, 1, 4).train
    micro_batches = iter(first)
    for _ in range(3):  # one whole global step and half of the next: the half step is replayed
        next(micro_batches)
    resumed = build_loaders(config, 0, 1, 4).train
    resumed.load_state_dict(first.state_dict())
    for want, got in zip(expected[2:], itertools.islice(iter(resumed), 4), strict=True):
        assert all(torch.equal(want[key], got[key]) for key in ("input_ids", "document_ids", "sample_ids"))


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_document_ids_change_exactly_after_each_eos(hf_config, streaming: bool) -> None:
    hf = {"streaming": True, "shuffle_buffer": 0} if streaming else None
    loaders = build_loaders(hf_config(hf=hf, val={"fraction": 0.05}, document_mask=True), 0, 1, 4)
    batches = [*itertools.islice(iter(loaders.train), 4), *loaders.val]
    for batch in batches:
        assert_documents_follow_eos(batch, loaders.eos_id)
    assert max(int(b["document_ids"].max()) for b in batches) >= 1
