"""`moe-data`, the console script, end to end: it prepares a multi-file corpus with two workers into shards that load,
and refuses bad input with one line on stderr and exit 2, no traceback."""

import json
import subprocess

import numpy as np
import pytest

from data_pipeline import TokenizedCorpus
from moe_platform.testing import BIN, subprocess_env


@pytest.mark.slow  # two processes, each seconds of imports
def test_moe_data_prepares_shards_and_refuses_bad_input_in_one_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [f"document {i} " + "word " * (i % 23) for i in range(400)]
    for part in range(2):
        lines = "".join(json.dumps({"text": doc}) + "\n" for doc in docs[part * 200 : (part + 1) * 200])
        (corpus / f"part{part}.jsonl").write_text(lines)
    common = ["data=hf_local", f"data.hf.cache_dir={tmp_path / 'cache'}"]
    good = [*common, "data.hf.data_files=[corpus/*.jsonl]", "--out", "shards/web", "--workers", "2",
            "--rows-per-shard", "150"]  # fmt: skip
    bad = [*common, "data.hf.data_files=[elsewhere/*.jsonl]", "--out", "shards/none"]
    # Both at once: each start is seconds of imports
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    env = subprocess_env()
    runs = [
        subprocess.Popen([BIN / "moe-data", "prepare", *argv], cwd=tmp_path, env=env, **pipes) for argv in (good, bad)
    ]
    (good_out, good_err), (bad_out, bad_err) = (run.communicate(timeout=120) for run in runs)
    assert runs[0].returncode == 0, good_err
    assert good_out.startswith("prepared shards/web: 400 documents") and "in 3 shard(s) (uint16)" in good_out
    shards = TokenizedCorpus.open(str(tmp_path / "shards/web"))
    expected = np.concatenate([np.append(np.frombuffer(doc.encode(), np.uint8), 256) for doc in docs])
    assert np.array_equal(np.concatenate(shards.tokens().chunks), expected)  # files in glob order, byte-level + EOS
    assert runs[1].returncode == 2, bad_err
    lines = bad_err.strip().splitlines()
    assert lines == ["data error: data.hf.data_files: pattern 'elsewhere/*.jsonl' matches nothing: fix the pattern or "
                     "add the files"], bad_err  # fmt: skip
    assert bad_out == "" and not (tmp_path / "shards/none").exists()
