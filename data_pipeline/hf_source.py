"""Hugging Face ``datasets`` source: a hub dataset or local jsonl/parquet/text files, map-style or streaming.

Map-style: ``datasets.map(batched=True, num_proc=...)`` tokenizes every document (EOS appended) into
an Arrow cache keyed by the source data, tokenizer, text field and train/val role, so a second run
(or another rank, see ``build_loaders``) reuses it. Packing is then arithmetic on the concatenated
token column (``TokenBuffer``), which is why the packed samples cannot depend on ``num_proc`` or map
batch boundaries.

Streaming: the same tokenization runs batch by batch while iterating; documents then pass through a
seeded shuffle buffer of ``shuffle_buffer`` documents (``SeedSequence([seed, epoch])``; 0 keeps file
order) and are packed in order. Files are always read in the order given, every rank reads the whole
stream and keeps its slice, and resuming re-reads the stream up to the saved position.

Bad data raises ``DataError`` naming the file and row: a missing/null text field, a non-string text
column, bytes that are not UTF-8, an empty or missing file, a dataset with no usable tokens.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from data_pipeline.errors import BadRowError, DataConfigError, DataError
from data_pipeline.holdout import holdout_mask_from_bytes
from data_pipeline.packing import TokenBuffer
from data_pipeline.tokenizer import Tokenizer, string_buffers, token_dtype

DEFAULT_SHUFFLE_BUFFER = 10_000
_TOKENIZE_VERSION = "1"  # bump when tokenization output changes, to invalidate datasets caches
_LINE_FILES = (".jsonl", ".json", ".txt", ".text")  # files whose load errors we can pin to a line
_FILE_BUILDERS = ("json", "parquet", "text", "csv", "arrow")  # datasets' builders for local files


@dataclass
class HFSourceConfig:
    """Arguments of ``datasets.load_dataset`` plus how to read the text out of it."""

    path: str = ""  # hub name, local directory, or a builder ("json", "parquet", "text") with data_files
    name: Optional[str] = None  # dataset config name
    split: str = "train"
    data_files: Optional[list[str]] = None  # files (or globs) of ``split``, read in this order
    text_field: str = "text"
    streaming: bool = False
    num_proc: Optional[int] = None  # map-style only: processes for tokenization
    map_batch_size: int = 1000  # documents per tokenization batch
    shuffle_buffer: Optional[int] = None  # streaming only: documents in the seeded shuffle buffer (default
    # 10_000; 0 = file order). Map-style corpora shuffle packed samples instead.
    cache_dir: Optional[str] = None  # datasets cache (downloads, Arrow files, tokenized cache)
    load_kwargs: dict[str, Any] = field(default_factory=dict)  # extra load_dataset kwargs, e.g. sample_by

    def __post_init__(self) -> None:
        if self.num_proc is not None and self.num_proc < 1:
            raise DataConfigError(f"data.hf.num_proc={self.num_proc} must be >= 1 or null")
        if self.streaming and self.num_proc is not None:
            raise DataConfigError("data.hf.num_proc is unused when data.hf.streaming=true: remove it")
        if self.map_batch_size < 1:
            raise DataConfigError(f"data.hf.map_batch_size={self.map_batch_size} must be >= 1")
        if self.shuffle_buffer is not None and self.shuffle_buffer < 0:
            raise DataConfigError(f"data.hf.shuffle_buffer={self.shuffle_buffer} must be >= 0")
        if not self.streaming and self.shuffle_buffer is not None:
            raise DataConfigError(
                "data.hf.shuffle_buffer only applies with data.hf.streaming=true (map-style shuffles samples): drop it"
            )
        if not self.text_field:
            raise DataConfigError("data.hf.text_field must name the column that holds the documents")

    @property
    def documents_in_shuffle_buffer(self) -> int:
        return DEFAULT_SHUFFLE_BUFFER if self.shuffle_buffer is None else self.shuffle_buffer


def describe(config: HFSourceConfig, split: str, data_files: Optional[list[str]]) -> str:
    files = f" data_files={data_files}" if data_files else ""
    return f"dataset {config.path!r}{files} split {split!r}"


def load_split(config: HFSourceConfig, split: str, data_files: Optional[list[str]]):
    """``datasets.load_dataset`` for one split; load failures become a DataError naming the file and line."""
    import datasets

    files = resolve_data_files(config, data_files)
    try:
        with _readers_quiet():
            return datasets.load_dataset(
                config.path,
                config.name,
                split=split,
                data_files={split: files} if files else None,
                streaming=config.streaming,
                cache_dir=config.cache_dir,
                **config.load_kwargs,
            )
    except DataError:
        raise
    except Exception as exc:  # datasets wraps reader errors without saying which file/row
        raise _explain_load_failure(files, config.text_field, describe(config, split, data_files), exc) from exc


@contextlib.contextmanager
def _readers_quiet() -> Iterator[None]:
    """datasets' file readers (json, text, parquet, ...) log a failure as an ERROR, then raise it; the DataError made
    of it names the file and line, so the failure is said once, in one sentence, and not also as a log line."""
    readers = logging.getLogger("datasets.packaged_modules")
    level = readers.level
    readers.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        readers.setLevel(level)


def tokenize_rows(
    table: pa.Table, first_row: int, *, text_field: str, tokenizer: Tokenizer, role: str, val_fraction: float
) -> pa.LargeListArray:
    """Token ids (EOS appended) of the documents in ``table`` that belong to ``role``.

    ``role`` is "all", "train" or "val"; train/val keep the documents on their side of the holdout
    hash. ``first_row`` is the dataset row index of the table's first row, for error messages.
    """
    texts = text_column(table, text_field, first_row)
    if role != "all":
        held_out = holdout_mask_from_bytes(document_bytes(texts), val_fraction)
        texts = texts.filter(pa.array(held_out if role == "val" else ~held_out))
    return tokenize_texts(texts, tokenizer)


def tokenize_texts(texts: pa.Array, tokenizer: Tokenizer) -> pa.LargeListArray:
    """Token ids (EOS appended) of each document of a string array without nulls that tokenizes to something."""
    ids = tokenizer.encode_documents(texts)
    if len(ids.values) and int(np.max(ids.values.to_numpy())) >= tokenizer.vocab_size:
        raise DataError(f"tokenizer {tokenizer.name!r} produced an id >= its vocab_size {tokenizer.vocab_size}")
    return ids


def document_bytes(texts: pa.Array) -> Iterator[memoryview]:
    """Each document's UTF-8 bytes, without copying them: what the holdout hash reads."""
    data, offsets = string_buffers(texts)
    return (memoryview(data)[offsets[i] : offsets[i + 1]] for i in range(len(texts)))


def text_column(table: pa.Table, text_field: str, first_row: int) -> pa.Array:
    """The text column as a UTF-8 string array; a null, non-text or non-UTF-8 row is a BadRowError."""
    column = table.column(text_field).combine_chunks()
    if column.null_count:
        row = first_row + int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise BadRowError(row, f"text field {text_field!r} is missing or null: fix or remove the row")
    if not any(check(column.type) for check in _TEXT_TYPES):
        raise DataError(
            f"text field {text_field!r} has type {column.type}, expected strings: set data.hf.text_field to a text "
            "column"
        )
    # Readers do not all validate UTF-8 (pyarrow's JSON reader passes invalid bytes through), and
    # byte-level tokenization would turn them into tokens of a text that cannot be decoded.
    try:
        texts = column.cast(pa.large_string())
        texts.validate(full=True)
    except pa.ArrowInvalid:
        for i, value in enumerate(column.cast(pa.large_binary()).to_pylist()):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BadRowError(
                    first_row + i, f"text field {text_field!r} is not valid UTF-8 ({exc}): re-encode it as UTF-8"
                ) from None
        raise
    return texts


_TEXT_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)


def _tokenize_batch(table: pa.Table, indices: list[int], **kwargs) -> pa.Table:
    return pa.table({"ids": tokenize_rows(table, indices[0] if indices else 0, **kwargs)})


def check_has_documents(dataset, config: HFSourceConfig, where: str) -> None:
    """A map-style dataset has rows, and the text field among its columns; else a DataError naming ``where``."""
    if len(dataset) == 0:
        raise DataError(f"{where} has no rows: point data.hf.path or data.hf.data_files at data with documents")
    if config.text_field not in dataset.column_names:
        raise DataError(
            f"{where}: row 0 has no text field {config.text_field!r} (columns: {dataset.column_names}): "
            "set data.hf.text_field to one of them"
        )


def tokenize_dataset(
    dataset,
    config: HFSourceConfig,
    data_files: Optional[list[str]],
    tokenizer: Tokenizer,
    *,
    role: str,
    val_fraction: float,
    where: str,
) -> TokenBuffer:
    """Tokenize a map-style dataset with a cached ``datasets.map`` and return its token concatenation."""
    import datasets
    from datasets.fingerprint import Hasher

    check_has_documents(dataset, config, where)
    # Our own cache key: hashing the tokenizer object through dill is slow and not always stable.
    # ``_fingerprint`` is datasets' identity of the loaded data (its own cache key for this table).
    fingerprint = Hasher.hash(
        [dataset._fingerprint, tokenizer.fingerprint, config.text_field, role, val_fraction, _TOKENIZE_VERSION]
    )
    dtype = token_dtype(tokenizer.vocab_size)
    kwargs = dict(text_field=config.text_field, tokenizer=tokenizer, role=role, val_fraction=val_fraction)
    try:
        tokenized = dataset.with_format("arrow").map(
            _tokenize_batch,
            batched=True,
            with_indices=True,
            batch_size=config.map_batch_size,
            num_proc=config.num_proc,
            remove_columns=dataset.column_names,
            fn_kwargs=kwargs,
            features=datasets.Features({"ids": datasets.LargeList(datasets.Value(dtype.name))}),
            new_fingerprint=fingerprint,
            desc=f"tokenizing {role}",
        )
    except BadRowError as err:
        raise DataError(f"{locate_row(config, data_files, where, err.row)}: {err.problem}") from err
    chunks = [chunk.flatten().to_numpy() for chunk in tokenized.data.column("ids").chunks]
    return TokenBuffer(chunks)


def stream_tokens(
    config: HFSourceConfig,
    split: str,
    data_files: Optional[list[str]],
    tokenizer: Tokenizer,
    *,
    role: str,
    val_fraction: float,
    seed: int,
    epoch: int,
    shuffle: bool,
) -> Iterator[np.ndarray]:
    """Token batches (documents with EOS, back to back) of one pass over a streaming split."""
    where = describe(config, split, data_files)
    stream = load_split(config, split, data_files)
    if config.text_field not in (stream.column_names or [config.text_field]):
        raise DataError(f"{where}: row 0 has no text field {config.text_field!r} (columns: {stream.column_names})")
    kwargs = dict(text_field=config.text_field, tokenizer=tokenizer, role=role, val_fraction=val_fraction)
    documents = _tokenized_documents(stream, config, data_files, where, kwargs)
    if not shuffle or config.documents_in_shuffle_buffer == 0:
        yield from (ids.values.to_numpy() for ids in documents)
        return
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch]))
    yield from _buffer_shuffle(
        (doc for ids in documents for doc in _split_lists(ids)), config.documents_in_shuffle_buffer, rng
    )


def _tokenized_documents(
    stream, config: HFSourceConfig, data_files: Optional[list[str]], where: str, kwargs: dict
) -> Iterator[pa.LargeListArray]:
    row = 0
    tables = stream.with_format("arrow").iter(batch_size=config.map_batch_size)
    while True:
        try:
            with _readers_quiet():
                table = next(tables)
        except StopIteration:
            return
        except DataError:
            raise
        except Exception as exc:  # a reader failing mid-stream, as load_split's do up front: name the file and line
            files = resolve_data_files(config, data_files)
            raise _explain_load_failure(files, config.text_field, where, exc) from exc
        try:
            ids = tokenize_rows(table, row, **kwargs)
        except BadRowError as err:
            raise DataError(f"{locate_row(config, data_files, where, err.row)}: {err.problem}") from err
        except KeyError as err:  # a later file lacks the column entirely
            raise DataError(
                f"{where}: row {row}: no text field {config.text_field!r}: set data.hf.text_field or fix the files"
            ) from err
        yield ids
        row += table.num_rows


def _split_lists(ids: pa.LargeListArray) -> list[np.ndarray]:
    values = ids.values.to_numpy()
    offsets = ids.offsets.to_numpy()
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(ids))]


def _buffer_shuffle(docs: Iterator[np.ndarray], size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Classic shuffle buffer: each incoming document evicts a uniformly chosen buffered one."""
    buffer: list[np.ndarray] = []
    for doc in docs:
        if len(buffer) < size:
            buffer.append(doc)
            continue
        j = int(rng.integers(size))
        yield buffer[j]
        buffer[j] = doc
    for j in rng.permutation(len(buffer)):
        yield buffer[j]


def resolve_data_files(config: HFSourceConfig, data_files: Optional[list[str]], key: str = "data_files") -> list[str]:
    """Local paths/globs expanded (each glob sorted) in the order given, so rows follow this file order.

    Local means: with a file builder (``path`` = "json", "parquet", ...) relative to the working
    directory, with a local dataset directory relative to it. A local pattern matching nothing, a
    missing file or an empty file is a DataError naming ``key``, the config field that lists the files.
    URLs, and patterns inside a hub dataset, are passed through for datasets to resolve.
    """
    if os.path.isdir(config.path):
        base = config.path
    elif config.path in _FILE_BUILDERS:
        base = ""
    else:
        return list(data_files or [])
    files = []
    for pattern in data_files or []:
        if "://" in pattern:
            files.append(pattern)
            continue
        pattern = os.path.join(base, pattern)  # unchanged when base is "" or the pattern is absolute
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise DataError(f"{key}: pattern {pattern!r} matches nothing: fix the pattern or add the files")
        elif os.path.exists(pattern):
            matches = [pattern]
        else:
            raise DataError(f"{key}: data file {pattern!r} does not exist: fix the path or point {key} elsewhere")
        for path in matches:
            if os.path.isfile(path) and os.path.getsize(path) == 0:
                raise DataError(f"{key}: data file {path!r} is empty: remove it from {key} or fill it")
        files.extend(matches)
    return files


def _explain_load_failure(files: list[str], text_field: str, where: str, exc: Exception) -> DataError:
    """Scan local line-oriented files for the first bad line; fall back to the original error."""
    for path in files:
        if path.endswith(_LINE_FILES) and os.path.isfile(path):
            problem = _first_bad_line(path, text_field)
            if problem:
                return DataError(f"{path}: {problem}")
    detail = (str(exc).strip().splitlines() or [""])[0]
    return DataError(
        f"could not load {where} ({type(exc).__name__}: {detail}): check data.hf.path, data.hf.name and "
        "data.hf.data_files"
    )


def _first_bad_line(path: str, text_field: str, max_lines: Optional[int] = None) -> Optional[str]:
    """What is wrong with the first bad line among the first `max_lines` (all: None) of a text or JSON-lines file."""
    json_lines = path.endswith(".jsonl") or (path.endswith(".json") and _first_byte(path) == b"{")
    with open(path, "rb") as f:
        for number, raw in enumerate(itertools.islice(f, max_lines), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return f"line {number}: not valid UTF-8 ({err.reason} at byte {err.start} of the line): re-encode it"
            if not json_lines or not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                return f"line {number}: not valid JSON ({err.msg}): fix the line"
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                return f"line {number}: no text field {text_field!r} (has {keys}): set data.hf.text_field or fix it"
            text = record[text_field]
            if not isinstance(text, str):
                return (
                    f"line {number}: text field {text_field!r} is {type(text).__name__}, expected a string: "
                    "set data.hf.text_field to a text field"
                )
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                return f"line {number}: text field {text_field!r} is not valid UTF-8 ({err.reason}): fix the row"
    return None


def _first_byte(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(4096).lstrip()[:1]


def locate_row(config: HFSourceConfig, data_files: Optional[list[str]], where: str, row: int) -> str:
    """'<file>, row k (0-based)' for a dataset row of local data files, else '<dataset>, row r'.

    Only called on errors: it loads each data file on its own to count its rows.
    """
    import datasets

    try:
        files = resolve_data_files(config, data_files)
        if not files or not all(os.path.isfile(f) for f in files):  # only local files are cheap to count
            return f"{where}, row {row} (0-based)"
        builder = datasets.load_dataset_builder(
            config.path, config.name, data_files=files or None, cache_dir=config.cache_dir
        )
        start = 0
        for path in files:
            num_rows = len(
                datasets.load_dataset(
                    builder.name, data_files=[path], split="train", cache_dir=config.cache_dir, **config.load_kwargs
                )
            )
            if row < start + num_rows:
                return f"{path}, row {row - start} (0-based)"
            start += num_rows
    except Exception:  # locating is best effort: the message below still names the dataset and row
        pass
    return f"{where}, row {row} (0-based)"
