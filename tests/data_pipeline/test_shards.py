"""Pre-tokenized shards: `prepare` writes them, `data.source=tokenized` reads them, and training on them is training on
the hf map-style source they came from, window for window; re-runs, interruptions and damaged shards."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest

from data_pipeline import (
    DataConfig,
    DataError,
    TokenizedConfig,
    TokenizedCorpus,
    TokenizerConfig,
    ValConfig,
    build_loaders,
    preflight,
    prepare,
)
from data_pipeline.shards import HEADER, Header

ROWS_PER_SHARD = 250  # the 1200-document corpus in 5 shards, the last one short


def _prepare(corpus, tokenizer: TokenizerConfig, out, workers: int = 1, **kwargs):
    from data_pipeline import HFSourceConfig

    hf = HFSourceConfig(path="json", data_files=corpus["files"], cache_dir=corpus["cache_dir"])
    return prepare(hf, tokenizer, str(out), workers, rows_per_shard=ROWS_PER_SHARD, progress=False, **kwargs)


def _tokenized(path, **kwargs) -> DataConfig:
    data = {"seq_len": 31, "global_batch_size": 8, "seed": 0, "val": ValConfig(fraction=0.0)} | kwargs
    return DataConfig(source="tokenized", tokenized=TokenizedConfig(path=str(path)), **data)


def _stream(tokens) -> np.ndarray:
    return np.concatenate(tokens.chunks).astype(np.int64)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus):
    """The corpus prepared byte-level in 5 shards: copy it before damaging it."""
    out = tmp_path_factory.mktemp("prepared") / "shards"
    _prepare(corpus, TokenizerConfig(), out)
    return out


@pytest.mark.parametrize("workers,tokenizer", [(1, "byte-level"), (2, "bpe")])
def test_tokenized_shards_give_the_hf_windows_in_the_same_order(
    tmp_path, corpus, hf_config, trained_tokenizer, global_steps, workers, tokenizer
):
    """Prepared once, then read: the token stream, the training windows in order (at another world size too), the
    validation windows and the document ids are those of hf map-style on the same two jsonl files."""
    tok = TokenizerConfig()
    if tokenizer == "bpe":
        tok = TokenizerConfig(name_or_path=trained_tokenizer["json"], eos_token="<eos>")
    prepared = _prepare(corpus, tok, tmp_path / "shards", workers)
    assert len(prepared.header.shards) == 5 and prepared.header.dtype == "uint16"
    shards = TokenizedCorpus.open(prepared.path)
    assert np.array_equal(
        _stream(shards.tokens()), _stream(build_loaders(hf_config(tokenizer=tok)).train.samples.tokens)
    )

    carved = {"val": {"fraction": 0.1}, "tokenizer": tok, "document_mask": True}
    hf = hf_config(**carved)
    tokenized = _tokenized(prepared.path, val=ValConfig(fraction=0.1), document_mask=True)  # tokenizer: the header's
    steps, windows = global_steps(hf, 1, 8, 30)
    tokenized_steps, tokenized_windows = global_steps(tokenized, 2, 2, 30)
    assert tokenized_steps == steps
    assert all(np.array_equal(a, b) for a, b in zip(tokenized_windows, windows, strict=True))
    hf_loaders, loaders = build_loaders(hf), build_loaders(tokenized)
    assert (loaders.vocab_size, loaders.eos_id, loaders.pad_id) == (hf_loaders.vocab_size, hf_loaders.eos_id,
                                                                   hf_loaders.pad_id)  # fmt: skip
    assert loaders.train.num_samples == hf_loaders.train.num_samples
    val_batches, hf_val_batches = list(loaders.val), list(hf_loaders.val)
    assert len(val_batches) == len(hf_val_batches) > 0
    for batch, hf_batch in zip(val_batches, hf_val_batches, strict=True):
        assert batch.keys() == hf_batch.keys() and all(batch[k].equal(hf_batch[k]) for k in batch)
    first, hf_first = next(iter(loaders.train)), next(iter(hf_loaders.train))
    assert first["document_ids"].equal(hf_first["document_ids"])


def test_ids_are_uint16_when_the_vocab_fits_else_uint32(tmp_path, corpus, prepared):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    header = Header.read(str(prepared / HEADER))
    first = header.shards[0]
    assert header.dtype == "uint16" and first.files["bin"].bytes == 2 * first.tokens
    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000, "<eos>": 70_001}
    wide = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    wide.pre_tokenizer = Whitespace()
    wide.save(str(tmp_path / "wide.json"))
    words = [" ".join(f"w{(97 * i + 65_000 + j) % 70_000}" for j in range(i % 17)) for i in range(300)]
    path = tmp_path / "wide.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in words))
    small = {"docs": words, "files": [str(path)], "cache_dir": str(tmp_path / "cache")}
    tok = TokenizerConfig(name_or_path=str(tmp_path / "wide.json"), eos_token="<eos>")
    wide_header = _prepare(small, tok, tmp_path / "shards").header
    shard = wide_header.shards[0]
    assert wide_header.dtype == "uint32" and shard.files["bin"].bytes == 4 * shard.tokens
    ids = _stream(TokenizedCorpus.open(str(tmp_path / "shards")).tokens())
    assert ids.max() == 70_001 and (ids >= 2**16).any()  # EOS, and ids past uint16
    expected = [[int(w[1:]) for w in text.split()] + [70_001] for text in words if text]
    assert ids.tolist() == [i for doc in expected for i in doc]


def test_a_rerun_is_a_no_op_and_another_input_is_refused(tmp_path, corpus, trained_tokenizer):
    out = tmp_path / "shards"
    _prepare(corpus, TokenizerConfig(), out)
    stamps = {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)}
    again = _prepare(corpus, TokenizerConfig(), out, workers=2)
    assert again.written == 0 and again.summary.endswith("nothing to do")
    assert {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)} == stamps
    bpe = TokenizerConfig(name_or_path=trained_tokenizer["json"], eos_token="<eos>")
    with pytest.raises(DataError, match=f"--out '{out}' already holds a corpus prepared from another input") as err:
        _prepare(corpus, bpe, out)
    assert "--overwrite" in str(err.value)
    replaced = _prepare(corpus, bpe, out, overwrite=True)
    assert replaced.written == 5 and Header.read(str(out / HEADER)).tokenizer_name == trained_tokenizer["json"]


def test_an_interrupted_prepare_resumes_and_writes_the_same_corpus(tmp_path, corpus, prepared):
    """Shards 0, 1 and 4 finished, shard 2 renamed into place but without its done record (and cut short), shard 3
    only half-written under its temporary name, no header: as a kill leaves it."""
    out = tmp_path / "shards"
    shutil.copytree(prepared, out)
    os.remove(out / HEADER)
    os.remove(out / "shard_00002.done.json")
    with open(out / "shard_00002.bin", "r+b") as f:
        f.truncate(100)
    for suffix in ("bin", "idx", "key", "done.json"):
        os.remove(out / f"shard_00003.{suffix}")
    (out / "shard_00003.bin.tmp").write_bytes(b"\x01\x02" * 50)
    with pytest.raises(DataError, match="was interrupted; re-run the same command to resume it"):
        TokenizedCorpus.open(str(out))
    kept = {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out) if name.startswith(("shard_00000.",
            "shard_00001.", "shard_00004."))}  # fmt: skip
    resumed = _prepare(corpus, TokenizerConfig(), out, workers=2)
    assert (resumed.written, resumed.reused) == (2, 3) and "3 shard(s) kept from an interrupted run" in resumed.summary
    assert {name: os.stat(out / name).st_mtime_ns for name in kept} == kept
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]
    assert Header.read(str(out / HEADER)) == Header.read(str(prepared / HEADER))
    assert TokenizedCorpus.open(str(out)).fingerprint == TokenizedCorpus.open(str(prepared)).fingerprint


def _truncate(path) -> None:
    with open(path / "shard_00001.bin", "r+b") as f:
        f.truncate(os.path.getsize(path / "shard_00001.bin") - 10)


def _flip_a_byte(path) -> None:
    with open(path / "shard_00001.bin", "r+b") as f:
        f.seek(1001)
        byte = f.read(1)
        f.seek(1001)
        f.write(bytes([byte[0] ^ 0x01]))


def _set_version(path) -> None:
    header = json.loads((path / HEADER).read_text())
    (path / HEADER).write_text(json.dumps(header | {"version": 99}))


BAD = {  # case → (what is done to a copy of the prepared corpus, config overrides, model vocab, words it must say)
    "missing_directory": (shutil.rmtree, {}, 258, ["data.tokenized.path='{p}' does not exist"]),
    "not_prepared": (lambda p: [os.remove(p / n) for n in os.listdir(p)], {}, 258, ["no header.json, so it is not"]),
    "interrupted": (lambda p: os.remove(p / HEADER), {}, 258, ["was interrupted; re-run the same command to resume"]),
    "truncated": (_truncate, {}, 258, ["{p}/shard_00001.bin holds", "{p}/header.json", "the shard is truncated"]),
    "corrupt": (_flip_a_byte, {}, 258, ["{p}/shard_00001.bin does not match its sha256 in {p}/header.json"]),
    "unknown_version": (_set_version, {}, 258, ["{p}/header.json has format version 99 but this code reads version"]),
    "another_tokenizer": (
        None,
        {"tokenizer": "bpe"},
        512,
        ["{p}/header.json was prepared with tokenizer 'byte-level'"],
    ),
    "vocab_over_the_models": (None, {}, 100, ["{p}/header.json: tokenizer 'byte-level' has vocab_size 258"]),
    "under_one_window": (None, {"seq_len": 300_000}, 258, ["'{p}' holds", "fewer than one packed sample"]),
    "under_one_validation_batch": (
        None,
        {"val": ValConfig(fraction=0.0005, global_batch_size=16)},
        258,
        ["'{p}'", "fewer than one global batch"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_shards_are_one_sentence_naming_the_path(case, tmp_path, prepared, trained_tokenizer):
    """Each refused by build_loaders and, the same way, by preflight (before any process group), except a flipped
    byte: only hashing the shard sees it, which is the loader's to do (data.tokenized.verify)."""
    damage, overrides, model_vocab, words = BAD[case]
    path = tmp_path / "shards"
    shutil.copytree(prepared, path)
    if damage is not None:
        damage(path)
    if overrides.get("tokenizer") == "bpe":
        overrides = overrides | {
            "tokenizer": TokenizerConfig(name_or_path=trained_tokenizer["json"], eos_token="<eos>")
        }
    config = _tokenized(path, **overrides)
    with pytest.raises(DataError) as err:
        build_loaders(config, model_vocab_size=model_vocab)
    message = str(err.value)
    assert all(word.format(p=path) in message for word in words) and "\n" not in message, message
    if case == "corrupt":
        preflight(config, model_vocab)
        build_loaders(dataclasses.replace(config, tokenized=TokenizedConfig(str(path), verify=False)))
        return
    with pytest.raises(DataError) as before_any_process_group:
        preflight(config, model_vocab)
    if case.startswith("under_one"):  # preflight counts the tokens (exactly), the loader the windows
        assert str(path) in str(before_any_process_group.value) and "cannot fill one" in str(
            before_any_process_group.value
        )
    else:
        assert str(before_any_process_group.value) == message


def test_a_bad_row_in_a_worker_names_its_file_and_row_and_an_unreadable_source_leaves_nothing(tmp_path):
    from data_pipeline import HFSourceConfig

    good = tmp_path / "a.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(150)))
    rows = [json.dumps({"text": f"document {i}"} if i != 120 else {"text": None}) for i in range(200)]
    (tmp_path / "b.jsonl").write_text("\n".join(rows) + "\n")
    hf = HFSourceConfig(path="json", data_files=[str(good), str(tmp_path / "b.jsonl")], cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'b.jsonl'}, row 120 (0-based): text field 'text' is")):
        prepare(hf, TokenizerConfig(), str(tmp_path / "shards"), 2, rows_per_shard=100, progress=False)
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": "unclosed\n')
    hf = HFSourceConfig(path="json", data_files=[str(tmp_path / "b.jsonl")], cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'b.jsonl'}: line 2: not valid JSON")):
        prepare(hf, TokenizerConfig(), str(tmp_path / "unread"), progress=False)
    assert not (tmp_path / "unread").exists()
