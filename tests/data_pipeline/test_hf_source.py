"""Hugging Face datasets source: local jsonl/parquet/text files, map-style and streaming, tokenizers."""

from __future__ import annotations

import json
import os
from collections import Counter
from itertools import islice

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline import DataError, TokenizerConfig, build_loaders, build_tokenizer


def _byte_stream(docs: list[str]) -> np.ndarray:
    """What byte-level tokenization must produce: each non-empty document's UTF-8 bytes, then EOS=256."""
    parts = [np.append(np.frombuffer(d.encode("utf-8"), np.uint8).astype(np.int64), 256) for d in docs if d]
    return np.concatenate(parts)


def _all_windows(samples) -> np.ndarray:
    if hasattr(samples, "tokens"):  # map-style: random access
        return samples.tokens.windows(np.arange(samples.num_samples), samples.width).astype(np.int64)
    windows = []
    while samples.num_samples is None:  # streaming: read the first epoch to its end
        windows.append(samples.read(len(windows), 1)[1][0])
    return np.array(windows[: samples.num_samples], dtype=np.int64)


def _documents(tokens: np.ndarray, eos_id: int) -> Counter:
    ends = np.flatnonzero(tokens == eos_id) + 1
    return Counter(doc.tobytes() for doc in np.split(tokens.astype(np.int64), ends) if len(doc))


def test_map_style_packing_keeps_every_token(corpus, hf_config):
    loaders = build_loaders(hf_config(), 0, 1)
    expected = _byte_stream(corpus["docs"])
    tokens = loaders.train.samples.tokens
    width = 32
    assert tokens.num_tokens == len(expected)  # tokens before packing == UTF-8 bytes + one EOS per document
    n = tokens.num_windows(width)
    assert n * width + tokens.remainder(width) == len(expected)
    windows = _all_windows(loaders.train.samples)
    assert np.array_equal(windows.ravel(), expected[: n * width])
    # one epoch through the loader: every window exactly once, with the right contents
    seen = {}
    for batch in islice(loaders.train, n // 8):
        for sample_id, inputs, labels in zip(batch["sample_ids"], batch["input_ids"], batch["labels"], strict=True):
            seen[int(sample_id)] = np.append(inputs.numpy(), labels.numpy()[-1])
    assert len(seen) == n // 8 * 8
    assert all(np.array_equal(window, windows[i]) for i, window in seen.items())


def test_num_proc_and_map_batch_size_do_not_change_the_samples(tmp_path, hf_config):
    reference = _all_windows(build_loaders(hf_config(), 0, 1).train.samples)
    fresh_cache = {"num_proc": 2, "map_batch_size": 37, "cache_dir": str(tmp_path)}  # really recompute
    parallel = _all_windows(build_loaders(hf_config(hf=fresh_cache), 0, 1).train.samples)
    assert np.array_equal(parallel, reference)


def test_streaming_packs_the_same_windows_as_map_style(hf_config):
    map_style = _all_windows(build_loaders(hf_config(), 0, 1).train.samples)
    streaming = build_loaders(hf_config(hf={"streaming": True, "shuffle_buffer": 0}), 0, 1)
    assert np.array_equal(_all_windows(streaming.train.samples), map_style)


def test_streaming_order_is_seeded_sharded_and_resumable(corpus, hf_config, global_steps):
    """Streaming sample ids are positions in the epoch's stream, so these checks compare window contents."""
    config = hf_config(hf={"streaming": True, "shuffle_buffer": 64}, seq_len=255)
    steps, windows = global_steps(config, 1, 8, 130)
    loader = build_loaders(config, 0, 1).train
    epoch0 = _all_windows(loader.samples)
    num_samples = len(epoch0)
    assert 110 * 8 < num_samples < 130 * 8  # the run, and the resumed part, cross into epoch 1
    # the shuffle buffer loses and repeats no document: epoch 0 is a permutation of the documents, cut
    # into windows, so only documents touching the dropped tail (< one window) may be missing
    all_docs = _documents(_byte_stream(corpus["docs"]), 256)
    whole = _documents(epoch0.ravel(), 256)
    whole = Counter({d: c for d, c in whole.items() if np.frombuffer(d, np.int64)[-1] == 256})
    assert whole <= all_docs
    missing_tokens = sum(len(d) // 8 * c for d, c in (all_docs - whole).items())
    assert missing_tokens < 256 + 2 * max(len(d.encode()) + 1 for d in corpus["docs"])
    assert np.array_equal(np.concatenate(windows)[:num_samples], epoch0)
    assert not np.array_equal(np.concatenate(windows)[num_samples : num_samples + 8], epoch0[:8])  # reshuffled

    sharded, sharded_windows = global_steps(config, 2, 2, 130)
    assert sharded == steps
    assert all(np.array_equal(a, b) for a, b in zip(windows, sharded_windows, strict=True))
    state = {"samples_consumed": 110 * 8, "seed": 0, "num_samples": None}
    resumed, resumed_windows = global_steps(config, 2, 4, 20, state=state)
    assert resumed == steps[110:130]
    assert all(np.array_equal(a, b) for a, b in zip(resumed_windows, windows[110:130], strict=True))
    other_config = hf_config(hf={"streaming": True, "shuffle_buffer": 64}, seq_len=255, seed=1)
    _, other_windows = global_steps(other_config, 1, 8, 1)
    assert not np.array_equal(other_windows[0], windows[0])


def test_holdout_partitions_documents_and_keeps_duplicates_together(tmp_path, corpus, hf_config):
    docs = corpus["docs"][:400] * 3  # every document three times
    data_file = tmp_path / "dups.jsonl"
    data_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    hf = {"data_files": [str(data_file)]}
    loaders = build_loaders(hf_config(hf=hf, val={"fraction": 0.2}, seq_len=15), 0, 1)
    train_tokens = np.concatenate(loaders.train.samples.tokens.chunks)
    val_tokens = np.concatenate(loaders.val.samples.tokens.chunks)
    train_docs, val_docs = _documents(train_tokens, 256), _documents(val_tokens, 256)
    assert train_docs + val_docs == _documents(_byte_stream(docs), 256)  # nothing lost or duplicated
    assert not set(train_docs) & set(val_docs)  # a document and its copies stay on one side
    assert 0.1 < len(val_tokens) / (len(train_tokens) + len(val_tokens)) < 0.3
    # streaming holds out exactly the same documents
    streaming_hf = hf | {"streaming": True, "shuffle_buffer": 0}
    streaming = build_loaders(hf_config(hf=streaming_hf, val={"fraction": 0.2}, seq_len=15))
    assert np.array_equal(_all_windows(streaming.train.samples), _all_windows(loaders.train.samples))
    assert np.array_equal(_all_windows(streaming.val.samples), _all_windows(loaders.val.samples))


def test_given_validation_split(tmp_path, corpus, hf_config):
    val_file = tmp_path / "val.jsonl"
    val_docs = [f"held out document number {i} with some text" for i in range(40)]
    val_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in val_docs), encoding="utf-8")
    config = hf_config(val={"split": "validation", "data_files": [str(val_file)]}, seq_len=15)
    loaders = build_loaders(config, 0, 1)
    val_tokens = _byte_stream(val_docs)
    n = len(val_tokens) // 16 // 8 * 8  # whole global batches only
    got = np.concatenate([np.concatenate([b["input_ids"], b["labels"][:, -1:]], axis=1) for b in loaders.val])
    assert np.array_equal(got.ravel(), val_tokens[: n * 16])
    assert loaders.train.samples.tokens.num_tokens == len(_byte_stream(corpus["docs"]))


def test_parquet_and_text_files(tmp_path, corpus):
    from data_pipeline import DataConfig, HFSourceConfig, ValConfig

    docs = [d for d in corpus["docs"][:300] if d]
    pq.write_table(pa.table({"body": docs}), tmp_path / "docs.parquet")
    (tmp_path / "docs.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    for path, data_file, field in [("parquet", "docs.parquet", "body"), ("text", "docs.txt", "text")]:
        hf = HFSourceConfig(
            path=path, data_files=[str(tmp_path / data_file)], text_field=field, cache_dir=str(tmp_path / "cache")
        )
        loaders = build_loaders(DataConfig(source="hf", hf=hf, val=ValConfig(fraction=0.0), seq_len=15), 0, 1)
        assert loaders.train.samples.tokens.num_tokens == len(_byte_stream(docs)), path


@pytest.mark.parametrize("which", ["json", "dir"])
def test_hf_tokenizer_trained_in_a_temp_dir(corpus, hf_config, trained_tokenizer, which):
    config = hf_config(seq_len=15)
    config.tokenizer = TokenizerConfig(
        name_or_path=trained_tokenizer[which], eos_token="<eos>" if which == "json" else None
    )
    loaders = build_loaders(config, 0, 1)
    tokenizer = loaders.tokenizer
    assert loaders.vocab_size == trained_tokenizer["vocab_size"]
    assert tokenizer.eos_id == tokenizer.backend.token_to_id("<eos>")
    assert loaders.pad_id == (tokenizer.backend.token_to_id("<pad>") if which == "dir" else tokenizer.eos_id)
    expected = np.concatenate([[*tokenizer.encode(d), tokenizer.eos_id] for d in corpus["docs"] if d])
    windows = _all_windows(loaders.train.samples).ravel()
    assert np.array_equal(windows, expected[: len(windows)])
    first_doc = expected[: int(np.argmax(expected == tokenizer.eos_id))]
    assert tokenizer.decode(first_doc.tolist()) == next(d for d in corpus["docs"] if d)
    with pytest.raises(DataError, match="model's vocab_size is 258"):
        build_loaders(config, 0, 1, model_vocab_size=258)


def test_tokenizer_without_eos_is_refused(trained_tokenizer):
    with pytest.raises(DataError, match="eos_token"):
        build_tokenizer(TokenizerConfig(name_or_path=trained_tokenizer["json"]))
    with pytest.raises(DataError, match="no token"):
        build_tokenizer(TokenizerConfig(name_or_path=trained_tokenizer["json"], eos_token="</s>"))


def test_local_directory_with_relative_glob_reads_files_in_order(corpus, hf_config):
    by_files = build_loaders(hf_config(), 0, 1)
    directory = os.path.dirname(corpus["files"][0])
    by_directory = build_loaders(hf_config(hf={"path": directory, "data_files": ["part*.jsonl"]}), 0, 1)
    assert np.array_equal(_all_windows(by_directory.train.samples), _all_windows(by_files.train.samples))
