"""Checks of the data that need no tokenization, for the start of a run, before any process group exists.

`build_loaders` meets every problem in the end, but a multi-process job builds its loaders only once its process
group is up, on every rank. What the config, the file system and the tokenizer alone can tell is checked here
first, in well under a second:

* the batch layouts: the validation batch splits over the ranks;
* a local dataset directory, and every local data file or glob: it exists, matches something, is not empty;
* the first line of each JSON-lines file (the text field is there, the line is UTF-8 JSON) and each parquet
  file's schema (it has the text column): a wrong `data.hf.text_field` fails on row 0 of every file;
* the tokenizer: it loads, and its ids fit the model's embedding table;
* a corpus that cannot fill one packed sample (or one validation batch) even at its largest: byte-level tokens of
  a text or JSON-lines document are never more than its line's bytes plus one, and synthetic corpora have
  exactly `num_tokens` tokens;
* a tokenized corpus (`data.source=tokenized`): its header is there and every shard file has the header's size,
  its vocabulary fits the model, `data.tokenizer` (when set) is the one it was prepared with, and its training and
  validation documents (exactly: their counts are in its index) fill one packed sample and one validation batch.
  Shard checksums are `build_loaders`'s to check (`data.tokenized.verify`): they take a read of the whole corpus.

What only reading every row can tell (bytes that are not UTF-8 or a row without the text field past the first
line, a corpus too small once tokenized and held out) is left to tokenization, which meets it with the file and row.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from data_pipeline.errors import DataConfigError, DataError
from data_pipeline.hf_source import _LINE_FILES, _first_bad_line, resolve_data_files
from data_pipeline.loader import DataConfig, _source_config, _val_layout, build_loaders
from data_pipeline.mixture import BlendSchedule, check_caps, normalised_weights
from data_pipeline.order import BatchLayout
from data_pipeline.shards import TokenizedCorpus
from data_pipeline.tokenizer import build_tokenizer, check_vocab_fits


def preflight(
    config: DataConfig,
    model_vocab_size: int,
    world_size: int = 1,
    micro_batch_size: Optional[int] = None,
    total_samples: Optional[int] = None,
) -> None:
    """Raise a DataConfigError or DataError, naming the config key and the fix, for what can be known before
    tokenizing; same arguments as `build_loaders`."""
    if config.source == "mixture":
        _check_mixture(config, model_vocab_size, world_size, micro_batch_size, total_samples)
        return
    micro_batch_size = micro_batch_size or max(1, config.global_batch_size // world_size)
    try:
        layout = BatchLayout(config.global_batch_size, world_size, 0, micro_batch_size)
    except ValueError as err:
        raise DataConfigError(f"data.global_batch_size: {err}") from None
    val_batch = _val_layout(config, layout).global_batch_size
    if config.source == "synthetic":
        synthetic = config.synthetic
        check_vocab_fits("synthetic", synthetic.vocab_size, model_vocab_size)
        _check_enough_tokens(
            synthetic.num_tokens, config, val_batch, f"data.synthetic.num_tokens={synthetic.num_tokens}",
            "raise data.synthetic.num_tokens",
        )  # fmt: skip
        return
    if config.source == "tokenized":
        _check_tokenized(config, model_vocab_size, val_batch)
        return
    hf = config.hf
    if hf.path.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(hf.path)):
        raise DataError(
            f"data.hf.path={hf.path!r} does not exist: give an existing directory, a hub dataset name, or a file "
            "builder ('json', 'parquet', 'text') with data.hf.data_files"
        )
    train_files = resolve_data_files(hf, hf.data_files, key="data.hf.data_files")
    val_files = resolve_data_files(hf, config.val.data_files, key="data.val.data_files")
    for path in train_files + val_files:
        _check_first_row(path, hf.path, hf.text_field)
    tokenizer = build_tokenizer(config.tokenizer)
    check_vocab_fits(tokenizer.name, tokenizer.vocab_size, model_vocab_size)
    if config.tokenizer.name_or_path is None and hf.path in ("json", "text"):
        # Byte-level: a document's tokens are its UTF-8 bytes plus EOS, never more than its line's (or file's) bytes
        # plus one. Without a split of its own, validation is carved out of the train files.
        carved = config.val.split is None
        for key, files, holds_val in (
            ("data.hf.data_files", train_files, carved),
            ("data.val.data_files", val_files, True),
        ):
            most = _most_byte_level_tokens(files)
            if most is not None:
                what = f"{key} (at most {most} byte-level tokens)"
                _check_enough_tokens(most, config, val_batch if holds_val else None, what, "add data")


def _check_mixture(
    config: DataConfig,
    model_vocab_size: int,
    world_size: int,
    micro_batch_size: Optional[int],
    total_samples: Optional[int],
) -> None:
    """Each source as a source of its own, then the caps: a capped source's size is read from its shards' index or
    drawn (synthetic) now; an hf source's is known once tokenized (build_loaders checks it then)."""
    names = [source.name for source in config.mixture]
    for index, source in enumerate(config.mixture):
        if source.kind == "tokenized":  # its errors name the mixture's key, not data.tokenized.path
            TokenizedCorpus.open(source.path, verify=False, key=f"data.mixture[{index}].path")
        preflight(_source_config(config, source), model_vocab_size, world_size, micro_batch_size)
    caps, sizes = [], []
    for source in config.mixture:
        map_style_hf = source.kind == "hf" and not source.hf.streaming  # its size needs tokenizing: checked later
        if source.max_epochs is None or map_style_hf or total_samples is None:
            caps.append(None)
            sizes.append(None)
        elif source.kind == "hf":  # a stream: its size is unknown, which check_caps refuses
            caps.append(source.max_epochs)
            sizes.append(None)
        else:
            caps.append(source.max_epochs)
            sub = _source_config(config, source)
            if source.kind == "tokenized":  # its size only: the shards' checksums are build_loaders's to check
                sub = replace(sub, tokenized=replace(sub.tokenized, verify=False))
            sizes.append(build_loaders(sub, model_vocab_size=model_vocab_size).train.num_samples)
    if any(cap is not None for cap in caps):
        weights = normalised_weights(names, [source.weight for source in config.mixture])
        check_caps(names, BlendSchedule(weights), caps, sizes, total_samples)


def _check_tokenized(config: DataConfig, model_vocab_size: int, val_batch: int) -> None:
    """Header, shard sizes, vocabulary, tokenizer, and the exact token counts of the training and validation parts."""
    corpus = TokenizedCorpus.open(config.tokenized.path, verify=False)
    corpus.check_vocab_fits(model_vocab_size)
    corpus.check_tokenizer(config.tokenizer)
    fraction = config.val.holdout_fraction
    where = f"data.tokenized.path={config.tokenized.path!r}"
    train = corpus.tokens("train" if fraction > 0 else "all", fraction).num_tokens
    _check_enough_tokens(train, config, None, f"{where} ({train} training tokens)", "prepare more data")
    if config.val.enabled:
        val = corpus.tokens("val", fraction).num_tokens
        what = f"{where} ({val} validation tokens at data.val.fraction={fraction})"
        _check_enough_tokens(val, config, val_batch, what, "raise data.val.fraction or prepare more data")


def _check_first_row(path: str, builder: str, text_field: str) -> None:
    """Row 0 of a local JSON-lines or parquet file has the text field; reads one line, or the parquet footer."""
    if builder == "json" and path.endswith(_LINE_FILES) and os.path.isfile(path):
        problem = _first_bad_line(path, text_field, max_lines=1)
        if problem:
            raise DataError(f"{path}: {problem}")
    elif builder == "parquet" and path.endswith(".parquet") and os.path.isfile(path):
        import pyarrow.parquet as pq

        try:
            columns = pq.read_schema(path).names
        except Exception as exc:  # not parquet, or a truncated file: its footer cannot be read
            raise DataError(f"{path} is not a readable parquet file ({exc}): replace it or remove it") from exc
        if text_field not in columns:
            raise DataError(
                f"{path}: no text field {text_field!r} (columns: {columns}): set data.hf.text_field to one of them"
            )


def _most_byte_level_tokens(files: list[str]) -> Optional[int]:
    """An upper bound on the byte-level tokens of local text/JSON-lines files; None when some are not such files."""
    if not files or not all(path.endswith(_LINE_FILES) and os.path.isfile(path) for path in files):
        return None
    return sum(os.path.getsize(path) for path in files) + len(files)


def _check_enough_tokens(most: int, config: DataConfig, val_batch: Optional[int], what: str, fix: str) -> None:
    """`most` tokens (an upper bound) must fill one packed sample, and one validation batch when one is read."""
    width = config.seq_len + 1
    if most < width:
        raise DataError(
            f"{what} cannot fill one packed sample of data.seq_len+1={width} tokens: {fix} or lower data.seq_len"
        )
    if val_batch is not None and config.val.enabled and most < val_batch * width:
        raise DataError(
            f"{what} cannot fill one validation batch of {val_batch} samples of data.seq_len+1={width} tokens: "
            f"{fix}, lower data.val.global_batch_size or data.seq_len, or set data.val.fraction=0"
        )
