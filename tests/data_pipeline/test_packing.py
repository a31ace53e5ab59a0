"""Packing never loses or duplicates a token: windows + remainder reproduce the token stream exactly."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from data_pipeline import ByteTokenizer, TokenBuffer, pack_stream


def _random_chunks(rng: np.random.Generator, total: int, max_chunk: int) -> list[np.ndarray]:
    tokens = rng.integers(0, 258, size=total).astype(np.uint16)
    cuts = np.sort(rng.choice(np.arange(1, total), size=total // max_chunk, replace=False))
    return np.split(tokens, cuts)


@pytest.mark.parametrize("width", [1, 7, 64, 1000])
def test_windows_and_remainder_reproduce_the_stream(width):
    rng = np.random.default_rng(width)
    chunks = _random_chunks(rng, total=5003, max_chunk=50)
    stream = np.concatenate(chunks)
    buffer = TokenBuffer(chunks)
    n = buffer.num_windows(width)
    assert n * width + buffer.remainder(width) == len(stream)
    assert 0 <= buffer.remainder(width) < width
    windows = buffer.windows(rng.permutation(n), width)
    ordered = buffer.windows(np.arange(n), width)
    assert np.array_equal(np.concatenate([ordered.ravel(), stream[n * width :]]), stream)
    # any order of ids returns the same windows, just permuted
    assert sorted(map(bytes, windows)) == sorted(map(bytes, ordered))


@pytest.mark.parametrize("width", [5, 64])
def test_stream_packing_equals_random_access_packing(width):
    rng = np.random.default_rng(0)
    chunks = _random_chunks(rng, total=3001, max_chunk=40)
    streamed = np.concatenate(list(pack_stream(iter(chunks), width)))
    assert np.array_equal(streamed, TokenBuffer(chunks).windows(np.arange(len(streamed)), width))
    assert len(streamed) == 3001 // width


def test_byte_tokenizer_appends_eos_and_drops_empty_documents():
    docs = ["héllo", "", "日本", "a", "", "😀 x"]
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode_documents(pa.array(docs).slice(0))  # slicing exercises array offsets
    expected = [[*d.encode("utf-8"), tokenizer.eos_id] for d in docs if d]
    assert ids.to_pylist() == expected
    sliced = tokenizer.encode_documents(pa.array(docs).slice(2, 3))
    assert sliced.to_pylist() == [[*"日本".encode(), 256], [ord("a"), 256]]
    assert tokenizer.decode(expected[0]) == "héllo"
