"""Bad data raises a DataError naming the file and row (or line), never a silent skip."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline import DataConfig, DataError, HFSourceConfig, ValConfig, build_loaders


def _build(tmp_path, files, streaming=False, **hf):
    """Build loaders and read one batch: a stream only meets its rows when iterated."""
    hf_config = HFSourceConfig(
        **({"path": "json", "data_files": [str(f) for f in files], "cache_dir": str(tmp_path / "cache")} | hf),
        streaming=streaming,
    )
    loaders = build_loaders(DataConfig(source="hf", hf=hf_config, val=ValConfig(fraction=0.0), seq_len=7), 0, 1)
    next(iter(loaders.train))
    return loaders


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _good(path, n=50):
    return _jsonl(path, [{"text": f"good document {i}", "id": i} for i in range(n)])


@pytest.mark.parametrize("streaming", [False, True])
def test_a_row_without_the_text_field_names_file_and_row(tmp_path, streaming):
    records = [{"text": f"doc {i}", "id": i} for i in range(30)]
    records[17] = {"id": 17}  # the field is missing in this row only
    files = [_good(tmp_path / "a.jsonl"), _jsonl(tmp_path / "b.jsonl", records)]
    with pytest.raises(DataError, match=re.escape(f"{files[1]}, row 17 (0-based)") + ".*missing"):
        _build(tmp_path, files, streaming=streaming)


def test_row_location_survives_parallel_tokenization(tmp_path):
    records = [{"text": f"doc {i}", "id": i} for i in range(400)]
    records[333] = {"text": None, "id": 333}
    files = [_good(tmp_path / "a.jsonl", 120), _jsonl(tmp_path / "b.jsonl", records)]
    with pytest.raises(DataError, match=re.escape(f"{files[1]}, row 333 (0-based)")):
        _build(tmp_path, files, num_proc=2, map_batch_size=16)


def test_a_file_without_the_text_field_names_file_and_line(tmp_path):
    files = [_good(tmp_path / "a.jsonl"), _jsonl(tmp_path / "b.jsonl", [{"body": "x", "id": 1}] * 5)]
    with pytest.raises(DataError, match=re.escape(f"{files[1]}: line 1: no text field 'text'")):
        _build(tmp_path, files)


def test_a_text_field_that_is_no_column_lists_the_columns(tmp_path):
    with pytest.raises(DataError, match=r"no text field 'content' \(columns: \['text', 'id'\]\)"):
        _build(tmp_path, [_good(tmp_path / "a.jsonl")], text_field="content")


def test_a_non_string_text_column_is_refused(tmp_path):
    files = [_jsonl(tmp_path / "a.jsonl", [{"text": i} for i in range(20)])]
    with pytest.raises(DataError, match="has type int64, expected strings"):
        _build(tmp_path, files)


def test_empty_file_missing_file_and_empty_dataset(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=re.escape(f"data file '{empty}' is empty")):
        _build(tmp_path, [_good(tmp_path / "a.jsonl"), empty])
    with pytest.raises(DataError, match="does not exist"):
        _build(tmp_path, [tmp_path / "nope.jsonl"])
    with pytest.raises(DataError, match="matches nothing"):
        _build(tmp_path, [tmp_path / "*.parquet"])
    only_empty_docs = _jsonl(tmp_path / "blank.jsonl", [{"text": ""}] * 10)
    with pytest.raises(DataError, match="0 tokens after tokenization, fewer than one packed sample"):
        _build(tmp_path, [only_empty_docs])


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_non_utf8_bytes_in_a_text_file_name_file_and_line(tmp_path, suffix):
    bad = tmp_path / f"bad{suffix}"
    line = b"plain line" if suffix == ".txt" else b'{"text": "fine"}'
    broken = b"bad \xff\xfe bytes" if suffix == ".txt" else b'{"text": "bad \xff bytes"}'
    bad.write_bytes(line + b"\n" + line + b"\n" + broken + b"\n" + line + b"\n")
    # the text reader fails (diagnosed by line); the JSON reader passes the bytes on (caught by row)
    path, where = ("text", f"{bad}: line 3: ") if suffix == ".txt" else ("json", f"{bad}, row 2 (0-based): ")
    with pytest.raises(DataError, match=re.escape(where) + ".*not valid UTF-8"):
        _build(tmp_path, [bad], path=path)


def test_lone_surrogate_in_json_names_file_and_line(tmp_path):
    bad = tmp_path / "surrogate.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "lone \\ud800 half"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{bad}: line 2: text field 'text' is not valid UTF-8")):
        _build(tmp_path, [bad])


def test_non_utf8_bytes_in_a_binary_column_name_file_and_row(tmp_path):
    docs = [f"document {i}".encode() for i in range(40)]
    docs[29] = b"broken \xc3\x28 bytes"
    bad = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"text": pa.array(docs, pa.binary())}), bad)
    with pytest.raises(DataError, match=re.escape(f"{bad}, row 29 (0-based)") + ".*not valid UTF-8"):
        _build(tmp_path, [bad], path="parquet")
    docs[29] = b"fine \xc3\xa9 bytes"  # valid UTF-8 in a binary column is accepted
    pq.write_table(pa.table({"text": pa.array(docs, pa.binary())}), tmp_path / "ok.parquet")
    assert _build(tmp_path, [tmp_path / "ok.parquet"], path="parquet").train.num_samples > 0


def test_streamed_validation_is_read_at_first_use_and_reports_bad_rows_then(tmp_path):
    records = [{"text": f"doc {i}", "id": i} for i in range(60)]
    records[5] = {"text": None, "id": 5}
    bad = _jsonl(tmp_path / "a.jsonl", records)
    hf = HFSourceConfig(path="json", data_files=[str(bad)], cache_dir=str(tmp_path / "cache"), streaming=True)
    loaders = build_loaders(DataConfig(source="hf", hf=hf, val=ValConfig(fraction=0.5), seq_len=7), 0, 1)
    with pytest.raises(DataError, match=re.escape(f"{bad}, row 5 (0-based)")):
        list(loaders.val)


def test_a_tokenizer_that_cannot_be_loaded_is_a_data_error(tmp_path):
    from data_pipeline import TokenizerConfig, build_tokenizer

    with pytest.raises(DataError, match="could not be loaded"):
        build_tokenizer(TokenizerConfig(name_or_path=str(tmp_path / "no-such-tokenizer")))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DataError, match="could not be read"):
        build_tokenizer(TokenizerConfig(name_or_path=str(broken)))
