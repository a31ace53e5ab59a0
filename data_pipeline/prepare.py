"""``prepare``: tokenize a Hugging Face source once into a tokenized corpus directory (format: ``shards``).

    prepare(HFSourceConfig(path="json", data_files=["corpus/*.jsonl"]), TokenizerConfig("tok/"), "shards/web", 8)

The source is read map-style (``hf_source.load_split``: Arrow files in the datasets cache) and cut into shards of
``rows_per_shard`` consecutive rows: a layout that does not depend on the number of workers. ``workers`` processes
tokenize whole shards with the functions map-style training uses (``text_column``, ``tokenize_texts``), so the
concatenated shards equal ``tokenize_dataset(..., role="all")`` token for token whatever ``workers`` is, and so do
the header and the corpus fingerprint.

Resumable: a worker writes a shard's three files under temporary names, renames them into place, then writes the
shard's done record; the header is written last. A re-run keeps the shards whose record is of this input and
tokenizes only the others, so a killed prepare resumes where it stopped. The input is everything the shards depend
on (the source's bytes, or a hub dataset's fingerprint; the tokenizer's fingerprint; the text field;
``rows_per_shard``), hashed into ``input_key``: a directory that already holds it complete is left as it is, one that
holds another input is refused unless ``overwrite``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import queue
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from data_pipeline.errors import BadRowError, DataConfigError, DataError
from data_pipeline.hf_source import (
    HFSourceConfig,
    check_has_documents,
    describe,
    document_bytes,
    load_split,
    locate_row,
    resolve_data_files,
    text_column,
    tokenize_texts,
)
from data_pipeline.holdout import holdout_keys_from_bytes
from data_pipeline.shards import (
    FORMAT,
    HEADER,
    INDEX_DTYPES,
    SHARD_FILES,
    SHARD_PATTERN,
    VERSION,
    FileRecord,
    Header,
    ShardRecord,
    sha256_file,
    shard_name,
    token_dtype,
    write_json_atomically,
)
from data_pipeline.tokenizer import Tokenizer, TokenizerConfig, build_tokenizer, string_buffers

DEFAULT_ROWS_PER_SHARD = 65_536  # ~64M tokens of web text per shard: few files, and many shards for many workers
PROGRESS_LINE_SECONDS = 30.0  # off a terminal, a progress line this often instead of a redrawn bar


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` did: the corpus's header, and how many shards it tokenized or found already done."""

    path: str
    header: Header
    written: int  # shards tokenized by this call (0 and reused 0: the directory already held this input)
    reused: int  # shards an interrupted run had finished, kept
    tokens_written: int  # tokens of the shards this call tokenized
    seconds: float
    workers: int

    @property
    def summary(self) -> str:
        """One line for the command to print."""
        h = self.header
        counts = f"{h.num_documents:,} documents, {h.num_tokens:,} tokens in {len(h.shards)} shard(s) ({h.dtype})"
        if self.written == self.reused == 0:
            return f"{self.path} already holds this corpus ({counts}): nothing to do"
        rate = self.tokens_written / self.seconds if self.seconds > 0 else 0.0
        kept = f", {self.reused} shard(s) kept from an interrupted run" if self.reused else ""
        return f"prepared {self.path}: {counts}, {rate:,.0f} tokens/s with {self.workers} worker(s){kept}"


def prepare(
    hf: HFSourceConfig,
    tokenizer: TokenizerConfig,
    out: str,
    workers: Optional[int] = None,
    *,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    overwrite: bool = False,
    progress: bool = True,
) -> Prepared:
    """Tokenize ``hf``'s split ``hf.split`` with ``tokenizer`` into the directory ``out`` (module docstring).

    ``workers`` defaults to ``hf.num_proc`` (the processes map-style tokenization would use), else 1. With
    ``progress``, documents, tokens, tokens/s and the ETA go to stderr.
    """
    start_time = time.monotonic()
    workers = (hf.num_proc or 1) if workers is None else workers
    if workers < 1:
        raise DataConfigError(f"--workers={workers} must be >= 1")
    if rows_per_shard < 1:
        raise DataConfigError(f"--rows-per-shard={rows_per_shard} must be >= 1")
    if hf.streaming:
        raise DataConfigError(
            "data.hf.streaming=true, but moe-data prepare reads the source map-style (into data.hf.cache_dir) so that "
            "its workers can take row ranges: set data.hf.streaming=false"
        )
    files = resolve_data_files(hf, hf.data_files, key="data.hf.data_files")
    tok = build_tokenizer(tokenizer)
    where = describe(hf, hf.split, hf.data_files)
    local = bool(files) and all(os.path.isfile(path) for path in files)
    dataset = None if local else _load(hf, where)  # a hub dataset's identity is datasets' fingerprint of it
    source = _source_record(hf, files if local else None, dataset)
    input_key = _input_key(source, tok, hf.text_field, rows_per_shard)
    done = _claim(out, input_key, overwrite)
    if done is not None:  # the same input, complete: a no-op, decided without loading a local source
        return Prepared(out, done, 0, 0, 0, time.monotonic() - start_time, workers)
    dataset = dataset if dataset is not None else _load(hf, where)
    os.makedirs(out, exist_ok=True)

    job = _Job(dataset, tok, hf.text_field, hf.map_batch_size, out, token_dtype(tok.vocab_size), input_key)
    num_rows = len(dataset)
    firsts = range(0, num_rows, rows_per_shard)
    tasks = [(index, first, min(first + rows_per_shard, num_rows)) for index, first in enumerate(firsts)]
    records = {index: _finished(job, index, first, stop) for index, first, stop in tasks}
    pending = [task for task in tasks if records[task[0]] is None]
    reused = len(tasks) - len(pending)
    reused_rows = sum(stop - first for index, first, stop in tasks if records[index] is not None)
    bar = _Progress(num_rows, reused_rows, progress)
    try:
        for index, record in _write_shards(job, pending, workers, bar.update):
            records[index] = record
    except BadRowError as err:  # a worker knows the dataset row only: name the file and its row
        raise DataError(f"{locate_row(hf, hf.data_files, where, err.row)}: {err.problem}") from err
    finally:
        bar.close()
    header = Header(
        tokenizer_name=tok.name, tokenizer_fingerprint=tok.fingerprint, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
        pad_id=tok.pad_id, dtype=job.dtype.name, text_field=hf.text_field, source=source, input_key=input_key,
        rows_per_shard=rows_per_shard, shards=tuple(records[k] for k in sorted(records)),
    )  # fmt: skip
    write_json_atomically(os.path.join(out, HEADER), header.to_json())  # last: the corpus is complete
    _sync_directory(out)
    tokens_written = sum(records[index].tokens for index, _, _ in pending)
    return Prepared(out, header, len(pending), reused, tokens_written, time.monotonic() - start_time, workers)


def _load(hf: HFSourceConfig, where: str):
    dataset = load_split(hf, hf.split, hf.data_files)
    check_has_documents(dataset, hf, where)
    return dataset


# ---- the input, and the directory it goes to -----------------------------------------------------------------------
def _source_record(hf: HFSourceConfig, files: Optional[list[str]], dataset) -> dict[str, Any]:
    """The source as the header records it: local files by size and sha256, anything else by datasets' fingerprint."""
    record = {"path": hf.path, "name": hf.name, "split": hf.split, "load_kwargs": dict(hf.load_kwargs)}
    if files is not None:
        record["files"] = [{"path": f, "bytes": os.path.getsize(f), "sha256": sha256_file(f)} for f in files]
    else:
        record["dataset_fingerprint"] = dataset._fingerprint
    return record


def _input_key(source: dict, tokenizer: Tokenizer, text_field: str, rows_per_shard: int) -> str:
    """sha256 of what the shards depend on. Local files count by their bytes, not their paths (a moved corpus is the
    same input), and so does a local dataset directory."""
    identity = {key: value for key, value in source.items() if key not in ("path", "files")}
    if not os.path.isdir(source["path"]):
        identity["path"] = source["path"]  # a builder ("json", ...) or a hub name: how the bytes are read
    if "files" in source:
        identity["files"] = [[f["bytes"], f["sha256"]] for f in source["files"]]
    key = [FORMAT, VERSION, identity, tokenizer.fingerprint, text_field, rows_per_shard]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _claim(out: str, input_key: str, overwrite: bool) -> Optional[Header]:
    """The header when ``out`` already holds this input complete (and ``overwrite`` is not asked); otherwise None,
    with another input's files removed (``overwrite``) or refused. A missing ``out`` is made only once the source has
    loaded, so that a source that cannot be read leaves nothing behind."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"--out {out!r} is a file, not a directory: give a directory to write the shards into")
    if not os.path.isdir(out):
        return None
    if overwrite:
        _remove_shards(out)
        return None
    if os.path.isfile(os.path.join(out, HEADER)):
        header = Header.read(os.path.join(out, HEADER))
        if header.input_key == input_key:
            return header
        raise DataError(
            f"--out {out!r} already holds a corpus prepared from another input or tokenizer ({header.num_tokens:,} "
            f"tokens of tokenizer {header.tokenizer_name!r}): give another --out, or pass --overwrite to replace it"
        )
    others = [name for name, record in _done_records(out).items() if record.get("input_key") != input_key]
    if others:
        raise DataError(
            f"--out {out!r} holds an interrupted prepare of another input or tokenizer ({len(others)} shard(s) done): "
            "give another --out, or pass --overwrite to replace it"
        )
    return None


def _done_records(out: str) -> dict[str, dict]:
    """Shard name → its done record, for every readable record in ``out`` (an unreadable one counts as not done)."""
    records = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".done.json"):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(out, name)) as f:
                    records[name.removesuffix(".done.json")] = json.load(f)
    return records


def _remove_shards(out: str) -> None:
    """Every file a prepare writes, header first (so the directory stops being complete at once); nothing else."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, HEADER))
    for name in os.listdir(out):
        if SHARD_PATTERN.match(name) or name == f"{HEADER}.tmp":
            os.remove(os.path.join(out, name))


# ---- writing shards ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Job:
    """What every worker needs: inherited by forked workers, never pickled."""

    dataset: Any  # datasets.Dataset, map-style
    tokenizer: Tokenizer
    text_field: str
    batch_size: int  # rows tokenized at a time (data.hf.map_batch_size)
    out: str
    dtype: np.dtype
    input_key: str


def _finished(job: _Job, index: int, first: int, stop: int) -> Optional[ShardRecord]:
    """The shard's record when an earlier run of this input finished it: its done record says so and its files have
    the recorded sizes (their hashes are the loader's to check, with data.tokenized.verify)."""
    name = shard_name(index)
    try:
        with open(os.path.join(job.out, f"{name}.done.json")) as f:
            record = json.load(f)
        shard = ShardRecord.from_json(record)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("input_key") != job.input_key or shard.name != name or shard.rows != (first, stop):
        return None
    for suffix, expected in shard.files.items():
        path = os.path.join(job.out, f"{name}.{suffix}")
        if not os.path.isfile(path) or os.path.getsize(path) != expected.bytes:
            return None
    return shard


def _write_shards(
    job: _Job, tasks: list[tuple[int, int, int]], workers: int, report: Callable[[int, int], None]
) -> Iterator[tuple[int, ShardRecord]]:
    """(index, record) of each task's shard as it is finished, by ``workers`` processes (one: this one)."""
    if workers == 1 or len(tasks) <= 1:
        for task in tasks:
            yield task[0], _write_shard(job, *task, report=report)
        return
    # Forked workers inherit the job (the dataset's memory maps, the tokenizer) instead of unpickling it, and start in
    # a moment where spawned ones would import the whole package again.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    progress = context.Queue()
    with _tokenizers_single_threaded():  # N workers are N cores: no Rust thread pool inside each as well
        pool = context.Pool(min(workers, len(tasks)), _start_worker, (job, progress))
    with pool:
        results = pool.imap_unordered(_write_shard_in_worker, tasks)
        for _ in tasks:
            while True:
                _drain(progress, report)
                try:
                    yield results.next(timeout=0.2)
                    break
                except multiprocessing.TimeoutError:
                    continue
        _drain(progress, report)


_worker: Optional[tuple[_Job, Any]] = None  # in a worker process: its job and the queue its progress goes to


def _start_worker(job: _Job, progress) -> None:
    global _worker
    _worker = (job, progress)


def _write_shard_in_worker(task: tuple[int, int, int]) -> tuple[int, ShardRecord]:
    job, progress = _worker
    return task[0], _write_shard(job, *task, report=lambda docs, tokens: progress.put((docs, tokens)))


def _drain(progress, report: Callable[[int, int], None]) -> None:
    while True:
        try:
            report(*progress.get_nowait())
        except queue.Empty:
            return


@contextlib.contextmanager
def _tokenizers_single_threaded() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM=false while the workers are forked: each then encodes on one thread, and Hugging Face
    tokenizers does not warn in each child that a fork after parallel use disables its parallelism."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _write_shard(job: _Job, index: int, first: int, stop: int, report: Callable[[int, int], None]) -> ShardRecord:
    """Tokenize rows [first, stop) into shard ``index``: files under .tmp names, renamed into place, then the done
    record; ``report(rows, tokens)`` after each batch."""
    name = shard_name(index)
    path = {suffix: os.path.join(job.out, f"{name}.{suffix}") for suffix in SHARD_FILES}
    table = job.dataset.with_format("arrow")
    offsets_D, keys_D, num_tokens = [np.zeros(1, np.int64)], [], 0
    bin_hash = hashlib.sha256()
    with open(f"{path['bin']}.tmp", "wb") as f:
        for row in range(first, stop, job.batch_size):
            end = min(row + job.batch_size, stop)
            ids, keys = _tokenize_with_keys(table[row:end], row, job)
            values = ids.flatten().to_numpy().astype(job.dtype, copy=False)
            f.write(memoryview(values))
            bin_hash.update(memoryview(values))
            offsets_D.append(num_tokens + np.cumsum(np.diff(ids.offsets.to_numpy())))
            keys_D.append(keys)
            num_tokens += len(values)
            report(end - row, len(values))
        _sync(f)
    hashes = {"bin": bin_hash.hexdigest()}
    arrays = {"idx": np.concatenate(offsets_D), "key": np.concatenate(keys_D or [np.zeros(0, np.uint64)])}
    for suffix, array in arrays.items():
        data = memoryview(np.ascontiguousarray(array, dtype=INDEX_DTYPES[suffix]))
        with open(f"{path[suffix]}.tmp", "wb") as f:
            f.write(data)
            _sync(f)
        hashes[suffix] = hashlib.sha256(data).hexdigest()
    for suffix in SHARD_FILES:
        os.replace(f"{path[suffix]}.tmp", path[suffix])
    files = {suffix: FileRecord(os.path.getsize(path[suffix]), hashes[suffix]) for suffix in SHARD_FILES}
    record = ShardRecord(name, (first, stop), num_tokens, len(arrays["key"]), files)
    write_json_atomically(os.path.join(job.out, f"{name}.done.json"), record.to_json() | {"input_key": job.input_key})
    return record


def _tokenize_with_keys(table: pa.Table, first_row: int, job: _Job) -> tuple[pa.LargeListArray, np.ndarray]:
    """Token ids of the documents that tokenize to something (as ``tokenize_rows`` with role "all") and the holdout
    key of each of them."""
    texts = text_column(table, job.text_field, first_row)
    ids = tokenize_texts(texts, job.tokenizer)
    keys = holdout_keys_from_bytes(document_bytes(texts))
    return ids, keys[_kept(texts, ids, job.tokenizer)]


def _kept(texts: pa.Array, ids: pa.LargeListArray, tokenizer: Tokenizer) -> np.ndarray:
    """Which documents the tokenizer kept. It drops those that tokenize to nothing without saying which: an empty
    text always (Tokenizer.encode_documents), rarely another (whitespace that a normalizer strips); only then are
    a batch's documents encoded one at a time to find them."""
    if len(ids) == len(texts):
        return np.ones(len(texts), dtype=bool)
    kept = np.diff(string_buffers(texts)[1]) > 0
    if int(kept.sum()) != len(ids):
        kept = np.array([len(tokenizer.encode_documents(texts.slice(i, 1))) == 1 for i in range(len(texts))])
    return kept


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _sync_directory(path: str) -> None:
    """fsync the directory, so that its renames (the header's last) are on disk too."""
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- progress ------------------------------------------------------------------------------------------------------
class _Progress:
    """Documents read, tokens written, tokens/s and the ETA (by documents) on stderr: a live bar on a terminal, a line
    every PROGRESS_LINE_SECONDS elsewhere (a Slurm or CI log, where a redrawn line is noise)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.total, self.initial, self.docs, self.tokens = total, initial, initial, 0
        self.live = enabled and sys.stderr.isatty()
        self.lines = enabled and not self.live
        self.start = self.last_line = time.monotonic()
        self.bar = tqdm(total=total, initial=initial, unit="doc", desc="tokenizing", file=sys.stderr,
                        disable=not self.live, dynamic_ncols=True)  # fmt: skip

    def _postfix(self, elapsed: float) -> str:
        return f"{self.tokens:,} tokens, {self.tokens / max(elapsed, 1e-9):,.0f} tok/s"

    def update(self, docs: int, tokens: int) -> None:
        self.docs, self.tokens = self.docs + docs, self.tokens + tokens
        now = time.monotonic()
        if self.live:
            self.bar.set_postfix_str(self._postfix(now - self.start), refresh=False)
            self.bar.update(docs)
        elif self.lines and now - self.last_line >= PROGRESS_LINE_SECONDS:
            self.last_line = now
            print(self._line(now - self.start), file=sys.stderr, flush=True)

    def _line(self, elapsed: float) -> str:
        return self._tqdm.format_meter(self.docs, self.total, elapsed, prefix="tokenizing", unit="doc",
                                       postfix=self._postfix(elapsed), initial=self.initial)  # fmt: skip

    def close(self) -> None:
        self.bar.close()
