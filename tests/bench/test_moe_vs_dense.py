"""bench/moe_vs_dense.py: its rows hold the parameter budgets they claim, and its quick run prints every row with
finite numbers, on the stdlib corpus, with the collapse run's routing alert in metrics.jsonl and in the HTML report."""

import html
import math
import re
import shutil
import statistics
from pathlib import Path

import pytest

from moe import count_parameters
from moe_platform.launch.compose import train_config

NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|nan|inf)", re.IGNORECASE)


def test_the_rows_have_the_active_and_total_parameters_they_claim(load_bench) -> None:
    """dense-active = moe-4x2's active FFN, dense-total = its total FFN, fine-shared = both, up to the routers."""
    bench = load_bench("moe_vs_dense")
    size = bench.FULL
    counts = {
        row: count_parameters(train_config([*overrides, *shape(size)]).model)
        for row, overrides in bench.row_overrides(size).items()
    }
    routers = {
        row: size.n_layers * size.d_model * e
        for row, e in (("moe-4x2", 4), ("moe-fine-shared", 7), ("moe-8x2", 8), ("moe-2x1", 2))
    }
    assert counts["dense-active"].total == counts["moe-4x2"].active - routers["moe-4x2"]
    assert counts["dense-total"].total == counts["moe-4x2"].total - routers["moe-4x2"]
    assert counts["moe-fine-shared"].active - routers["moe-fine-shared"] == counts["dense-active"].total
    assert counts["moe-fine-shared"].total - routers["moe-fine-shared"] == counts["dense-total"].total
    assert counts["collapse"] == counts["balanced-8x2"]  # only the balancing differs
    assert counts["moe-8x2"] == counts["balanced-8x2"]  # the same model, trained for the full run
    assert counts["dense-total-8x2"].total == counts["moe-8x2"].total - routers["moe-8x2"]
    assert counts["collapse"].active == counts["moe-4x2"].active + size.n_layers * size.d_model * 4
    assert counts["moe-2x1"].active - routers["moe-2x1"] == counts["dense-active"].total  # whole-width experts
    assert counts["moe-2x1"].total - routers["moe-2x1"] == counts["dense-total"].total
    for row in ("moe-4x2", "dense-active", "dense-total"):  # the Muon rows change the optimizer, not the model
        assert counts[f"{row}-muon"] == counts[row]


def shape(size) -> list[str]:
    return [f"model.d_model={size.d_model}", f"model.n_layers={size.n_layers}", f"model.n_heads={size.n_heads}",
            f"model.n_kv_heads={size.n_kv_heads}"]  # fmt: skip


def test_the_quick_run_prints_every_row_with_finite_numbers_and_summarize_reads_it_back(
    load_bench, tmp_path: Path, capsys
) -> None:
    bench = load_bench("moe_vs_dense")
    summary = bench.main(["--quick", "--jobs", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out

    corpus = summary["corpus"]
    assert corpus["files"] == bench.QUICK.max_files - corpus["skipped_not_utf8"] and corpus["bytes"] > 100_000
    assert re.fullmatch(r"[0-9a-f]{64}", corpus["sha256"]) and 0 < corpus["held_out_files"] < corpus["files"]
    assert f"sha256 {corpus['sha256'][:16]}" in out

    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "/" in line}
    for row in ("dense-active", "moe-4x2"):
        numbers = NUMBER.findall(rows[row].split(maxsplit=1)[1])
        assert len(numbers) >= 6, rows[row]  # params, eval mean, std, min, max, tok/s (+ MaxVio, dead, alerts)
        assert all(math.isfinite(float(n.replace(",", ""))) for n in numbers), rows[row]
    gap = next(line for line in out.splitlines() if line.startswith("  moe-4x2 vs dense-active:"))
    assert re.search(r"[-+]\d\.\d{4} nats \([-+]\d+\.\d\d%\), seed ranges overlap: (yes|no); paired", gap), gap
    assert re.search(r"steps to the reference's final training loss (\d\.\d\d–\d\.\d\dx|never reached)", gap), gap

    runs = {run["row"]: run for run in summary["runs"]}
    assert set(runs) == {"dense-active", "moe-4x2", "collapse"}
    for run in runs.values():
        assert math.isfinite(run["eval_loss"]) and run["tokens_per_s"] > 0 and run["total_params"] > 0
    assert runs["dense-active"]["maxvio"] is None and runs["moe-4x2"]["maxvio"] >= 0
    assert runs["moe-4x2"]["active_params"] < runs["moe-4x2"]["total_params"]
    # Without the balancing loss the router collapses within the run, the alert fires, and the report shows it.
    collapse = runs["collapse"]
    assert collapse["alerts"], out
    assert "collapse (8 experts top-2, model.moe.aux_loss_coef=0, no bias" in out and "NO alert" not in out
    page = Path(collapse["report"]).read_text()
    assert "<table id='alerts' class='alert'>" in page
    for alert in collapse["alerts"]:
        assert html.escape(alert["message"]) in page

    # --summarize trains nothing and reads the same runs back: the same figures, the same gap line.
    again = bench.main(["--summarize", str(tmp_path)])
    assert capsys.readouterr().out.count(gap) == 1
    read_back = {run["row"]: run for run in again["runs"]}
    assert set(read_back) == {"dense-active", "moe-4x2"}  # the collapse rows have their own schedule
    for row, run in read_back.items():
        assert {k: v for k, v in run.items() if k != "train_curve"} == {
            k: v for k, v in runs[row].items() if k != "train_curve"
        }
        assert [list(point) for point in run["train_curve"]] == [list(point) for point in runs[row]["train_curve"]]
    # A run of another setting is refused in one sentence naming it, and so is a run two directories both hold.
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "runs" / "moe-4x2_seed0", other / "runs" / "moe-4x2_seed1")
    config = other / "runs" / "moe-4x2_seed1" / "config.yaml"
    config.write_text(config.read_text().replace(f"max_steps: {bench.QUICK.steps}", "max_steps: 99"))
    with pytest.raises(SystemExit, match=r"^--summarize: .*moe-4x2_seed1 ran with trainer.max_steps=99, not the 24 "):
        bench.main(["--summarize", str(tmp_path), "--summarize", str(other)])
    with pytest.raises(
        SystemExit, match=r"^--summarize: dense-active seed 0 is in two of the directories: name only one$"
    ):
        bench.main(["--summarize", str(tmp_path), "--summarize", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^--summarize .*nowhere: it holds no runs/ directory: name an earlier"):
        bench.main(["--summarize", str(tmp_path), "--summarize", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match=r"^--summarize: no run of \['dense-total'\] under .*: check --rows$"):
        bench.main(["--summarize", str(tmp_path), "--rows", "dense-total"])


def test_steps_to_match_is_one_for_the_same_curve_below_one_for_a_faster_and_none_for_one_that_never_gets_there(
    load_bench,
) -> None:
    bench = load_bench("moe_vs_dense")

    def run(losses: list[float]):
        return bench.RunResult("r", 0, 0.0, losses[-1], 1.0, 1, 1, 0.0, train_curve=list(enumerate(losses)))

    reference = [3.0 - 0.05 * step for step in range(40)]  # its last 10 logs average 1.275
    faster = [3.0 - 0.0625 * step for step in range(40)]  # every level in 0.8 of the steps
    stuck = [max(loss, 1.5) for loss in reference]
    assert bench.steps_to_match(run(reference), run(reference)) == 1.0
    ratio = bench.steps_to_match(run(faster), run(reference))
    assert 0.78 < ratio < 0.88  # 0.8 up to the smoothing window's lag (both curves lag 4.5 steps: 33 / 39)
    assert bench.steps_to_match(run(stuck), run(reference)) is None
    level = bench.smoothed(list(enumerate(reference)))[-1][1]
    assert level == pytest.approx(statistics.mean(reference[-bench.SMOOTH_LOGS :]))


def test_set_overrides_a_numeric_field_of_the_size_and_refuses_others_in_one_sentence(load_bench) -> None:
    bench = load_bench("moe_vs_dense")
    assert bench.size_field("expert_d_ff=64") == ("expert_d_ff", 64)
    assert bench.size_field("lr=1.5e-3") == ("lr", 1.5e-3)
    for bad in ("seeds=0", "width=3"):  # a tuple field, and no field at all
        with pytest.raises(SystemExit, match=rf"^--set {bad}: ") as error:
            bench.size_field(bad)
        assert ". " not in str(error.value)


def test_data_seed_fixes_the_sample_order_for_every_seed_and_leaves_the_init_seed_alone(load_bench) -> None:
    from dataclasses import replace

    bench = load_bench("moe_vs_dense")
    corpus = bench.Corpus(**{f.name: None for f in bench.fields(bench.Corpus)} | {"bpe_vocab": 0})
    for seed in (0, 3):
        own = bench.common_overrides(bench.QUICK, corpus, seed)
        fixed = bench.common_overrides(replace(bench.QUICK, data_seed=7), corpus, seed)
        assert f"data.seed={seed}" in own and f"trainer.seed={seed}" in own
        assert "data.seed=7" in fixed and f"trainer.seed={seed}" in fixed
        rest = [[o for o in overrides if not o.startswith("data.seed=")] for overrides in (own, fixed)]
        assert rest[0] == rest[1]


def test_the_bpe_learns_from_the_training_texts_alone_and_round_trips_text(load_bench, tmp_path: Path) -> None:
    """--set bpe_vocab=N: N tokens with EOS, every byte encodable (nothing unknown), text back exactly."""
    import tokenizers

    bench = load_bench("moe_vs_dense")
    texts = [f"def f{i}(x):\n    return x * {i}  # héllo\n" for i in range(200)]
    bpe = tokenizers.Tokenizer.from_file(str(bench.train_bpe(texts, 300, tmp_path / "tokenizer.json")))
    assert bpe.get_vocab_size() <= 300 and bpe.token_to_id(bench.EOS) is not None
    unseen = "class Ω:\n\tpass  # never in the training texts: ß, 漢"
    for text in (texts[7], unseen):
        assert bpe.decode(bpe.encode(text).ids) == text
    assert len(bpe.encode(texts[7]).ids) < len(texts[7].encode())  # merges learned: fewer tokens than bytes


def test_prose_keeps_every_docstring_and_comment_and_no_code(load_bench) -> None:
    """--text prose trains on a file's English alone: each docstring and comment paragraph, in source order."""
    bench = load_bench("moe_vs_dense")
    source = '''#!/usr/bin/env python
"""Module summary.

More about the module."""
import os  # why os
# ----------------------------------------
def f(x):
    """Return x, doubled."""
    # first line of a note
    # second line of the note
    return x * 2
'''
    prose = bench.prose_of(source)
    paragraphs = ["Module summary.\n\nMore about the module.", "why os", "Return x, doubled."]
    assert prose == "\n\n".join([*paragraphs, "first line of a note\nsecond line of the note"])
    assert "import" not in prose and "return" not in prose and "----" not in prose
    assert bench.prose_of("def broken(:\n    '''never parsed'''\n") == ""


def test_a_gap_between_rows_of_different_seed_sets_is_taken_over_the_seeds_both_ran(load_bench, capsys) -> None:
    """--summarize can join runs of different seed sets: a gap is paired, so it is over the seeds both rows hold."""
    bench = load_bench("moe_vs_dense")
    corpus = bench.Corpus("stdlib", "cpython", 1, 0, 1, 1, 1, "0" * 64, "shards")
    curve = [(step, 2.0 - step / 100) for step in range(0, 100, 4)]

    def run(row: str, seed: int, loss: float):
        return bench.RunResult(row, seed, loss, curve[-1][1], 1.0, 1, 1, 0.0, train_curve=curve)

    results = [run("dense-active", 0, 1.0), run("dense-active", 1, 3.0), run("moe-4x2", 0, 0.9)]
    bench.print_results(bench.QUICK, corpus, ["dense-active", "moe-4x2"], results, {})
    gap = next(line for line in capsys.readouterr().out.splitlines() if "moe-4x2 vs dense-active" in line)
    assert gap.startswith("  moe-4x2 vs dense-active (seeds [0]): -0.1000 nats (-10.00%)"), gap
    assert "steps to the reference's final training loss 1.00–1.00x" in gap  # the same curve: the same steps
