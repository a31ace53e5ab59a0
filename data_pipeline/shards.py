"""A tokenized corpus on disk: written once by ``prepare`` (``moe-data prepare``), read memory-mapped by
``data.source=tokenized``, so no tokenizer runs when training starts.

A directory ``DIR`` holds, for each shard k (``shard_00000`` ...)::

    shard_k.bin        token ids, raw little-endian uint16 when vocab_size <= 65536, else uint32
    shard_k.idx        int64 offsets of the documents' first tokens in shard_k.bin, n_docs + 1 of them
                       (offsets[0] = 0, offsets[-1] = the shard's token count): document j is ids[off[j]:off[j+1]]
    shard_k.key        uint64 holdout key of each document: blake2b-64 of its UTF-8 text (``holdout``)
    shard_k.done.json  the shard's record (``ShardRecord``), written once its three files are in place

and, written last and atomically, ``header.json`` (``Header``): its presence means the corpus is complete.

Shard k holds source rows ``[k·R, (k+1)·R)`` (R = ``rows_per_shard``), each document's ids with EOS appended and the
documents that tokenize to nothing left out, exactly as map-style tokenization (``hf_source.tokenize_dataset``,
role "all") does: the shards concatenated in order are that token stream, token for token.

Train/validation carving needs no text: a document is held out for ``data.val.fraction`` when
``key >> 11 < fraction · 2^53`` (``holdout_mask_from_keys``), the very test ``holdout_mask_from_bytes`` applies to
its text, so ``tokens("train" | "val", fraction)`` keeps the documents the hf source keeps, in the same order.

Opening checks every shard file's size against the header (always: a truncated shard is named) and, with
``verify``, its sha256 (a corrupt one is named); every problem is a ``DataError`` in one sentence naming the path.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import numpy as np

from data_pipeline.errors import DataError
from data_pipeline.holdout import holdout_mask_from_keys
from data_pipeline.packing import TokenBuffer
from data_pipeline.tokenizer import Tokenizer, TokenizerConfig, build_tokenizer, check_vocab_fits

FORMAT = "moe-platform-tokenized"
VERSION = 1
HEADER = "header.json"
# suffix → dtype of each shard file but the token ids (whose dtype the header names)
INDEX_DTYPES = {"idx": np.dtype("<i8"), "key": np.dtype("<u8")}
SHARD_FILES = ("bin", *INDEX_DTYPES)
SHARD_PATTERN = re.compile(r"shard_\d{5,}\.(bin|idx|key|done\.json)(\.tmp)?$")  # what prepare writes, and removes
ROLES = ("all", "train", "val")
_REPREPARE = "re-run its `moe-data prepare` with --overwrite"


@dataclass
class TokenizedConfig:
    """Which prepared directory ``data.source=tokenized`` reads, and how hard it checks it at start-up."""

    path: str = ""  # a directory written by `moe-data prepare`
    verify: bool = True  # hash every shard file at open (one read of the corpus per rank); sizes are always checked


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_json_atomically(path: str, record: dict) -> None:
    """Write to a temporary name, flush it to disk, then rename: a reader sees the whole file or none."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class FileRecord:
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardRecord:
    """One shard: its source rows [start, stop), its kept documents and tokens, and each file's size and hash."""

    name: str
    rows: tuple[int, int]
    tokens: int
    documents: int
    files: dict[str, FileRecord]  # suffix ("bin", "idx", "key") → record

    def to_json(self) -> dict:
        files = {suffix: vars(record) for suffix, record in self.files.items()}
        return {"name": self.name, "rows": list(self.rows), "tokens": self.tokens, "documents": self.documents,
                "files": files}  # fmt: skip

    @classmethod
    def from_json(cls, record: dict) -> ShardRecord:
        files = {suffix: FileRecord(**record["files"][suffix]) for suffix in SHARD_FILES}
        return cls(record["name"], tuple(record["rows"]), record["tokens"], record["documents"], files)


@dataclass(frozen=True)
class Header:
    """``header.json``: the tokenizer the ids are of, the source they came from, and every shard's record."""

    tokenizer_name: str
    tokenizer_fingerprint: str
    vocab_size: int
    eos_id: int
    pad_id: int
    dtype: str  # "uint16" or "uint32", little-endian
    text_field: str
    source: dict[str, Any]  # the HF source: path, name, split, load_kwargs, and files (path, bytes, sha256) or,
    # for a hub dataset, datasets' fingerprint of the loaded split
    input_key: str  # sha256 of everything the shards depend on: a re-run with the same key is a no-op
    rows_per_shard: int
    shards: tuple[ShardRecord, ...]

    @property
    def num_tokens(self) -> int:
        return sum(shard.tokens for shard in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(shard.documents for shard in self.shards)

    def to_json(self) -> dict:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "shards"}
        return {"format": FORMAT, "version": VERSION, **fields, "shards": [s.to_json() for s in self.shards],
                "num_tokens": self.num_tokens, "num_documents": self.num_documents}  # fmt: skip

    @classmethod
    def read(cls, path: str) -> Header:
        """The header of the complete corpus at ``path``; a DataError naming the file for anything else."""
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(f"{path} cannot be read as JSON ({err}): {_REPREPARE}") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise DataError(f"{path} is not the header of a tokenized corpus (format {FORMAT!r}): {_REPREPARE}")
        if record.get("version") != VERSION:
            raise DataError(
                f"{path} has format version {record.get('version')!r} but this code reads version {VERSION}: prepare "
                f"the corpus again with this version's `moe-data prepare` (--overwrite)"
            )
        try:
            fields = {name: record[name] for name in cls.__dataclass_fields__ if name != "shards"}
            header = cls(**fields, shards=tuple(ShardRecord.from_json(shard) for shard in record["shards"]))
        except (KeyError, TypeError) as err:
            raise DataError(f"{path} lacks {err} or has it malformed: {_REPREPARE}") from None
        if header.dtype != token_dtype(header.vocab_size).name:
            raise DataError(
                f"{path} says dtype {header.dtype!r} for vocab_size {header.vocab_size}, which needs "
                f"{token_dtype(header.vocab_size).name!r}: {_REPREPARE}"
            )
        return header


class TokenizedCorpus:
    """A complete prepared directory, opened: its token facts, and its documents as memory-mapped token buffers."""

    def __init__(self, path: str, header: Header):
        self.path = path
        self.header = header
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @classmethod
    def open(cls, path: str, verify: bool = True, key: str = "data.tokenized.path") -> TokenizedCorpus:
        """Read ``path``'s header and check every shard file's size (and sha256 with ``verify``) against it;
        ``key`` is the config key that named ``path``, for the messages."""
        corpus = cls(path, read_header(path, key))
        corpus.check_files(verify)
        return corpus

    # ---- the token facts a model and trainer need -----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.header.vocab_size

    @property
    def eos_id(self) -> int:
        return self.header.eos_id

    @property
    def pad_id(self) -> int:
        return self.header.pad_id

    @property
    def tokenizer_name(self) -> str:
        return self.header.tokenizer_name

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.header.tokenizer_fingerprint

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @property
    def num_documents(self) -> int:
        return self.header.num_documents

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over the tokenizer's fingerprint and every shard file's sha256: equal iff the token ids are."""
        shards = [[shard.name, {suffix: f.sha256 for suffix, f in shard.files.items()}] for shard in self.header.shards]
        return hashlib.sha256(json.dumps([self.tokenizer_fingerprint, shards]).encode()).hexdigest()

    @property
    def header_path(self) -> str:
        return os.path.join(self.path, HEADER)

    # ---- checks ------------------------------------------------------------------------------------------------------
    def check_files(self, verify: bool) -> None:
        """Every shard file exists with the header's size (a truncated shard), its document index ends at the shard's
        token count, and with ``verify`` its sha256 is the header's (a corrupt shard)."""
        for shard in self.header.shards:
            for suffix, expected in shard.files.items():
                file = self._file(shard, suffix)
                if not os.path.isfile(file):
                    raise DataError(f"{file} is missing but {self.header_path} lists it: {_REPREPARE}")
                size = os.path.getsize(file)
                if size != expected.bytes:
                    how = "truncated" if size < expected.bytes else "longer than written"
                    raise DataError(
                        f"{file} holds {size} bytes but {self.header_path} says {expected.bytes}: the shard is {how}; "
                        f"{_REPREPARE}"
                    )
            _, offsets, _ = self._shard_arrays(shard)
            if len(offsets) != shard.documents + 1 or offsets[0] != 0 or offsets[-1] != shard.tokens:
                raise DataError(
                    f"{self._file(shard, 'idx')} does not index {shard.documents} documents over {shard.tokens} "
                    f"tokens as {self.header_path} says: the shard is corrupt; {_REPREPARE}"
                )
        if verify:
            self.verify()

    def verify(self) -> None:
        """Hash every shard file (a read of the whole corpus) and compare with the header's sha256."""
        for shard in self.header.shards:
            for suffix, expected in shard.files.items():
                file = self._file(shard, suffix)
                if sha256_file(file) != expected.sha256:
                    raise DataError(
                        f"{file} does not match its sha256 in {self.header_path}: the shard is corrupt; restore it or "
                        f"{_REPREPARE}"
                    )

    def check_vocab_fits(self, model_vocab_size: int) -> None:
        """A DataError naming the header when its token ids could reach past the model's embedding table."""
        try:
            check_vocab_fits(self.tokenizer_name, self.vocab_size, model_vocab_size)
        except DataError as err:
            raise DataError(f"{self.header_path}: {err}") from None

    def check_tokenizer(self, config: TokenizerConfig) -> Optional[Tokenizer]:
        """``data.tokenizer``'s tokenizer when it is set (None when left at its default: the header says which ids
        these are); a DataError when it is not the tokenizer the corpus was prepared with."""
        if config == TokenizerConfig():
            return None
        tokenizer = build_tokenizer(config)
        if tokenizer.fingerprint != self.tokenizer_fingerprint:
            raise DataError(
                f"{self.header_path} was prepared with tokenizer {self.tokenizer_name!r} (fingerprint "
                f"{self.tokenizer_fingerprint}) but data.tokenizer is {tokenizer.name!r} (fingerprint "
                f"{tokenizer.fingerprint}): prepare the corpus with data.tokenizer, or leave data.tokenizer unset "
                "to read the ids as prepared"
            )
        return tokenizer

    # ---- the tokens ------------------------------------------------------------------------------------------------
    def tokens(self, role: str = "all", val_fraction: float = 0.0) -> TokenBuffer:
        """The documents of ``role`` ("all", "train": not held out, "val": held out by ``val_fraction``) back to back
        in prepared order, as views of the memory-mapped shards (nothing is copied); runs of consecutive kept
        documents are one chunk each."""
        if role not in ROLES:
            raise ValueError(f"role={role!r} must be one of {ROLES}")
        chunks = []
        for shard in self.header.shards:
            ids, offsets, keys = self._shard_arrays(shard)
            if role == "all":
                chunks.append(ids)
                continue
            held_out = holdout_mask_from_keys(keys, val_fraction)
            starts, stops = _runs(held_out if role == "val" else ~held_out)
            chunks.extend(ids[offsets[a] : offsets[b]] for a, b in zip(starts, stops, strict=True))
        return TokenBuffer(chunks)

    def _file(self, shard: ShardRecord, suffix: str) -> str:
        return os.path.join(self.path, f"{shard.name}.{suffix}")

    def _shard_arrays(self, shard: ShardRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, document offsets, holdout keys) of a shard, memory-mapped once."""
        if shard.name not in self._arrays:
            dtypes = {"bin": np.dtype(self.header.dtype).newbyteorder("<"), **INDEX_DTYPES}
            self._arrays[shard.name] = tuple(_memmap(self._file(shard, s), dtypes[s]) for s in SHARD_FILES)
        return self._arrays[shard.name]


def read_header(path: str, key: str = "data.tokenized.path") -> Header:
    """The header of the prepared directory ``path``; a DataError saying what ``path`` is instead: missing, not a
    directory, or a prepare that was interrupted (shard files without a header: re-running it resumes)."""
    if not os.path.exists(path):
        raise DataError(
            f"{key}={path!r} does not exist: write it with `moe-data prepare ... --out {path}` or point {key} at a "
            "prepared directory"
        )
    if not os.path.isdir(path):
        raise DataError(f"{key}={path!r} is not a directory: point {key} at a directory `moe-data prepare` wrote")
    header = os.path.join(path, HEADER)
    if not os.path.isfile(header):
        written = glob.glob(os.path.join(glob.escape(path), "shard_*.done.json"))
        if written or any(SHARD_PATTERN.match(name) for name in os.listdir(path)):
            raise DataError(
                f"{key}={path!r} holds shard files ({len(written)} shard(s) finished) but no {HEADER}: its "
                "`moe-data prepare` was interrupted; re-run the same command to resume it"
            )
        raise DataError(
            f"{key}={path!r} has no {HEADER}, so it is not a prepared corpus: write one with `moe-data prepare ... "
            f"--out {path}`"
        )
    return Header.read(header)


def _memmap(path: str, dtype: np.dtype) -> np.ndarray:
    """A read-only memory map of the whole file, as a plain ndarray over the mapping: np.memmap's own slicing runs
    Python code on every slice, and a window read slices once per chunk. An empty file (a shard without documents)
    is an empty array, since mmap refuses a length of 0."""
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r").view(np.ndarray)  # the view's base keeps the mapping open


def _runs(keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, stops) of the runs of True in a boolean array: documents [start, stop) are kept together."""
    edges = np.diff(np.concatenate([[0], keep.astype(np.int8), [0]]))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
