"""Tokenizers: byte-level by default (no download), or any Hugging Face fast tokenizer.

Both turn a column of documents (a pyarrow string array with no nulls) into a list array of token
ids with EOS appended to every document, which is what packing concatenates. No other special
tokens are added (no BOS, no template). Documents that tokenize to nothing are dropped: they would
only add a lone EOS.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np
import pyarrow as pa

from data_pipeline.errors import DataConfigError, DataError


@dataclass
class TokenizerConfig:
    """Which tokenizer: None means byte-level (256 bytes + EOS=256 + PAD=257, vocab 258)."""

    name_or_path: Optional[str] = None  # a tokenizer.json file, a local directory, or a hub name (AutoTokenizer)
    eos_token: Optional[str] = None  # default: the tokenizer's own eos_token
    pad_token: Optional[str] = None  # default: the tokenizer's pad token, else EOS (packing never pads)

    def __post_init__(self) -> None:
        if self.name_or_path is None and (self.eos_token is not None or self.pad_token is not None):
            raise DataConfigError(
                "data.tokenizer.eos_token/pad_token only apply to a Hugging Face tokenizer: set "
                "data.tokenizer.name_or_path or remove them (byte-level uses EOS=256, PAD=257)"
            )


class Tokenizer(Protocol):
    """What packing needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int
    fingerprint: str  # changes whenever the token ids it produces could change (keys the datasets cache)

    def encode_documents(self, texts: pa.Array) -> pa.LargeListArray:
        """Token ids of each non-empty document, EOS appended (a string array without nulls)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest storage for the ids: halves the cache and memory for vocabularies up to 65536."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def string_buffers(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(utf8_bytes, offsets) of a string array without copying the bytes; document i is bytes[off[i]:off[i+1]]."""
    texts = texts.cast(pa.large_string())
    n = len(texts)
    offsets = np.frombuffer(texts.buffers()[1], dtype=np.int64)[texts.offset : texts.offset + n + 1]
    data_buffer = texts.buffers()[2]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    return data, offsets


def _lists_with_eos(values: np.ndarray, lengths: np.ndarray, eos_id: int) -> pa.LargeListArray:
    """Split ``values`` into documents of ``lengths`` (back to back), append EOS to each, drop empty ones."""
    lengths = lengths[lengths > 0]
    out_offsets = np.concatenate([[0], np.cumsum(lengths + 1)])
    out = np.empty(int(out_offsets[-1]), dtype=values.dtype)
    out[out_offsets[1:] - 1] = eos_id
    # value k of document j lands at k + j: shifted by the j EOS inserted before it
    out[np.arange(len(values)) + np.repeat(np.arange(len(lengths)), lengths)] = values
    return pa.LargeListArray.from_arrays(pa.array(out_offsets, pa.int64()), pa.array(out))


class ByteTokenizer:
    """UTF-8 bytes are the tokens: ids 0..255, EOS=256, PAD=257."""

    name = "byte-level"
    vocab_size = 258
    eos_id = 256
    pad_id = 257
    fingerprint = "byte-level-v1"

    def encode_documents(self, texts: pa.Array) -> pa.LargeListArray:
        data, offsets = string_buffers(texts)
        values = data[offsets[0] : offsets[-1]].astype(np.uint16)
        return _lists_with_eos(values, np.diff(offsets), self.eos_id)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer, used through its Rust backend (``tokenizers.Tokenizer``)."""

    def __init__(self, backend, name: str, eos_id: int, pad_id: int):
        backend.no_truncation()  # a saved tokenizer may truncate or pad: either would corrupt packing
        backend.no_padding()
        self.backend = backend
        self.name = name
        self.eos_id = eos_id
        self.pad_id = pad_id
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        digest = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()[:16]
        self.fingerprint = f"hf-{digest}-eos{eos_id}"
        self._dtype = token_dtype(self.vocab_size)

    def encode_documents(self, texts: pa.Array) -> pa.LargeListArray:
        encodings = self.backend.encode_batch_fast(texts.to_pylist(), add_special_tokens=False)
        ids = [np.asarray(e.ids, dtype=self._dtype) for e in encodings]
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        values = np.concatenate(ids) if ids else np.zeros(0, dtype=self._dtype)
        return _lists_with_eos(values, lengths, self.eos_id)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)


def build_tokenizer(config: TokenizerConfig) -> ByteTokenizer | HFTokenizer:
    """Byte-level, a ``tokenizer.json`` file (via ``tokenizers``), or AutoTokenizer for a directory / hub name."""
    if config.name_or_path is None:
        return ByteTokenizer()
    path = config.name_or_path
    if os.path.isfile(path):
        import tokenizers

        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as exc:  # a corrupt or foreign file: say which, not a Rust parse trace
            raise DataError(
                f"data.tokenizer.name_or_path={path!r} could not be read ({_first_line(exc)}): give a tokenizer.json "
                "that the tokenizers library wrote"
            ) from exc
        default_eos, default_pad = None, None
    else:
        import transformers

        try:
            auto = transformers.AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # not on disk, and no network or no such hub name
            raise DataError(
                f"data.tokenizer.name_or_path={path!r} could not be loaded ({type(exc).__name__}: "
                f"{_first_line(exc)}): give a local directory or tokenizer.json, or a hub name reachable from here"
            ) from exc
        if not auto.is_fast:
            raise DataError(
                f"data.tokenizer.name_or_path={path!r} has no fast (Rust) backend: convert it to a tokenizer.json"
            )
        backend = auto.backend_tokenizer
        default_eos, default_pad = auto.eos_token, auto.pad_token
    eos_token = config.eos_token or default_eos
    if eos_token is None:
        raise DataError(
            f"data.tokenizer.name_or_path={path!r} defines no EOS token: set data.tokenizer.eos_token to one of "
            "its tokens"
        )
    eos_id = _token_id(backend, eos_token, path, "eos_token")
    pad_token = config.pad_token or default_pad
    pad_id = _token_id(backend, pad_token, path, "pad_token") if pad_token is not None else eos_id
    return HFTokenizer(backend, name=path, eos_id=eos_id, pad_id=pad_id)


def _token_id(backend, token: str, path: str, field: str) -> int:
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise DataError(
            f"tokenizer {path!r} has no token {token!r}: set data.tokenizer.{field} to a token in its vocab"
        )
    return token_id


def check_vocab_fits(tokenizer_name: str, vocab_size: int, model_vocab_size: int) -> None:
    """Raise a DataError if token ids could reach past the model's embedding table."""
    if vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer {tokenizer_name!r} has vocab_size {vocab_size} (ids up to {vocab_size - 1}) but the model's "
            f"vocab_size is {model_vocab_size}: raise model.vocab_size to >= {vocab_size} or use a smaller tokenizer"
        )


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
