"""moe-report on real runs: a one-process run with evaluations, a 2-rank DDP run stopped part-way (a run still going),
and the same run resumed after an interruption that lost its last checkpoint (steps logged twice). The page is
checked for structure here and opened in headless Chromium, which must render every figure without a console
message; the screenshot must show the expert-load heatmap (several distinct Viridis cells, not a blank page)."""

import json
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from plotly.colors import sample_colorscale

from data_pipeline import DataConfig
from moe import ModelConfig
from moe.mla_config import MLAConfig
from moe_platform.config import TrainConfig, TrainerConfig
from moe_platform.monitor import report
from moe_platform.testing import metric_steps, moe_train

FIGURES = ["fig-loss", "fig-throughput", "fig-optimizer", "fig-expert-load", "fig-routing"]
BROWSER_SKIP = "no `chromium` on PATH: apt-get install -y chromium (.ci/run installs it)"


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    """6 steps on one process, evaluated at steps 3 and 6; its console output beside it in moe-train.out."""
    run_dir = tmp_path_factory.mktemp("single")
    result = moe_train(run_dir, "trainer.eval_every=3")
    (run_dir.parent / "moe-train.out").write_text(result.stdout)
    return run_dir


@pytest.fixture(scope="module")
def two_rank_then_resumed(tmp_path_factory) -> tuple[Path, str]:
    """(the run dir after resume=auto on 1 process, its report after the first 4 of 6 steps on 2 DDP ranks).

    The job is 'killed' after logging step 4 but before step 4's checkpoint completed (its directory is removed),
    so the resume starts from step 2 and logs steps 3 and 4 again."""
    run_dir = tmp_path_factory.mktemp("two_rank")
    moe_train(run_dir, "distributed=ddp", "trainer.stop_at=4", "trainer.save_every=2", nproc=2)
    partial = report.render(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    moe_train(run_dir, "resume=auto")
    return run_dir, partial


def test_ledger_shows_the_runs_attention_cache_and_checkpointing() -> None:
    """The report's ledger is the trainer's: the attention type, MLA's latent cache beside its MHA equivalent, the
    run's activation checkpointing and document mask (not the defaults), for a config built here without a run."""
    model = ModelConfig(
        vocab_size=258, d_model=64, n_layers=3, n_heads=4, d_ff=128, attention="mla", mla=MLAConfig(q_lora_rank=32)
    )
    config = TrainConfig(
        model=model,
        data=DataConfig(seq_len=64, document_mask=True),
        trainer=TrainerConfig(activation_checkpointing="full"),
    )
    text = report.ledger_text(config, None)
    assert "attention=mla" in text and "B · L · S · (d_c + d_r) · s" in text and "MHA equivalent" in text
    assert "checkpointing=full" in text and "with checkpointing=none" in text
    assert "S×S probabilities" not in text, "MLA pads its narrower values, so SDPA keeps its fused kernel"
    plain = report.ledger_text(replace(config, model=replace(model, attention="gqa", mla=MLAConfig())), 2)
    assert "attention=gqa" in plain and "2 · B · L · S · H_kv · d_h · s" in plain and "for 2 rank(s)" in plain
    assert "SDPA output and mask" in plain, "the document mask SDPA keeps per layer"


def figures(run_dir: Path) -> dict:
    records, config, _, problem = report.load_run(run_dir)
    assert problem is None
    return report.build_figures(records, config, report.entropy_floor(config))


def steps_of(fig, trace: int = 0) -> list[int]:
    return list(fig.data[trace].x)


def test_report_of_a_run_with_evaluations_holds_every_figure_and_the_ledger(single_run: Path, tmp_path: Path) -> None:
    output = tmp_path / "report.html"
    report.main([str(single_run), "-o", str(output)])
    page = output.read_text()
    for name in FIGURES:
        assert f'id="{name}"' in page, name
    assert not re.search(r"<script[^>]*\bsrc=", page), "plotly's JS is inlined, nothing is fetched"
    assert page.count("<script>") >= len(FIGURES) and "Plotly.newPlot" in page
    assert "Matmul FLOPs per token" in page and "Training state per rank" in page and "for 1 rank(s)" in page
    assert "d_model: 96" in page, "the resolved config is shown"
    assert "No alert records." in page

    figs = figures(single_run)
    assert steps_of(figs["fig-loss"]) == list(range(1, 7))
    assert steps_of(figs["fig-loss"], 1) == [3, 6], "eval loss at its two evaluations"
    floor = report.entropy_floor(report.load_run(single_run)[1])
    printed = (single_run.parent / "moe-train.out").read_text().split("entropy floor:")[1].split()[0]
    assert f"{floor:.4f}" == printed, "the floor the trainer printed, recomputed from config.yaml"
    assert f"{floor:.4f}" in page
    heatmap = figs["fig-expert-load"]
    assert [s["label"] for s in heatmap.layout.sliders[0].steps] == [str(s) for s in range(1, 7)]
    assert len(heatmap.data[0].z) == 4 and all(len(row) == 4 for row in heatmap.data[0].z), "4 layers × 4 experts"
    for row in heatmap.data[0].z:
        assert sum(row) / len(row) == pytest.approx(1.0), "utilisation = load / ideal has mean 1"
    routing = figs["fig-routing"]
    assert len(routing.data) == 3 * 4, "MaxVio, drop fraction, dead experts for each of 4 MoE layers"


def test_report_reads_old_records_and_shows_alert_records(single_run: Path, tmp_path: Path) -> None:
    """Without the per-layer maxvio/utilisation/dead_experts keys (older runs) the same MaxVio is computed from the
    counts; an alert record goes to the alerts table and is not taken for a training step."""
    shutil.copy(single_run / "config.yaml", tmp_path / "config.yaml")
    records = [json.loads(line) for line in (single_run / "metrics.jsonl").read_text().splitlines()]
    new_keys = re.compile(r"^moe/(layer_\d+/(maxvio|utilisation|dead_experts)|all/.*)$")
    old = [{k: v for k, v in r.items() if not new_keys.match(k)} for r in records]
    alert = {
        "step": 5, "alert": "maxvio", "layer": 2, "expert": None, "metric": "moe/layer_2/maxvio", "value": 3.0,
        "threshold": 1.0, "consecutive_logs": 3, "message": "routing alert: layer 2 MaxVio 3.00 > 1.0 for 3 logs",
    }  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*old, alert]))

    now, before = figures(single_run)["fig-routing"], figures(tmp_path)["fig-routing"]
    for trace_now, trace_before in zip(now.data, before.data, strict=True):
        assert list(trace_before.x) == list(trace_now.x)
        assert list(trace_before.y) == pytest.approx(list(trace_now.y), abs=1e-9)
    page = report.render(tmp_path)
    assert "routing alert: layer 2 MaxVio 3.00 &gt; 1.0 for 3 logs" in page and "No alert records." not in page
    assert steps_of(figures(tmp_path)["fig-loss"]) == list(range(1, 7))


def test_report_of_a_two_rank_run_still_going(two_rank_then_resumed, tmp_path: Path) -> None:
    """After 4 of 6 steps on 2 ranks, with the next record half-written: the report names 2 ranks and 4 steps."""
    run_dir, partial = two_rank_then_resumed
    assert "for 2 rank(s)" in partial and "2 data-parallel ranks" in partial
    assert "1–4 of trainer.max_steps=6 (still running" in partial
    for name in FIGURES:
        assert f'id="{name}"' in partial, name

    shutil.copy(run_dir / "config.yaml", tmp_path / "config.yaml")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][: len(lines[4]) // 2])
    page = report.render(tmp_path)
    assert "1 line(s) of metrics.jsonl are not complete JSON" in page
    assert steps_of(figures(tmp_path)["fig-loss"]) == [1, 2, 3, 4]


def test_report_of_a_resumed_run_has_each_step_once_with_its_last_record(two_rank_then_resumed, tmp_path) -> None:
    resumed, _ = two_rank_then_resumed
    assert metric_steps(resumed) == list(range(1, 7)), "the resume superseded the killed job's steps 3 and 4"
    superseded = (resumed / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded if "loss" in json.loads(line)] == [3, 4]
    # A run dir whose metrics.jsonl repeats steps (written before resumes superseded records, or appended to by
    # hand): the report keeps each step's last record.
    run_dir = tmp_path
    shutil.copy(resumed / "config.yaml", run_dir / "config.yaml")
    current = (resumed / "metrics.jsonl").read_text().splitlines()
    early = [line for line in current if json.loads(line)["step"] <= 2]
    (run_dir / "metrics.jsonl").write_text("\n".join([*early, *superseded, *current[len(early) :]]) + "\n")
    assert metric_steps(run_dir) == [1, 2, 3, 4, 3, 4, 5, 6]
    last_loss = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            last_loss[record["step"]] = record["loss"]
    figs = figures(run_dir)
    assert steps_of(figs["fig-loss"]) == list(range(1, 7))
    assert list(figs["fig-loss"].data[0].y) == [last_loss[s] for s in range(1, 7)]
    assert [s["label"] for s in figs["fig-expert-load"].layout.sliders[0].steps] == [str(s) for s in range(1, 7)]
    for trace in figs["fig-routing"].data:
        assert list(trace.x) == list(range(1, 7)), trace.name
    page = report.render(run_dir)
    assert "2 record(s) of steps logged again after a resume" in page
    assert "1–6 of trainer.max_steps=6" in page and "still running" not in page


def test_a_missing_or_empty_run_dir_is_one_sentence_and_exit_2(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "starting").mkdir()
    (tmp_path / "starting" / "config.yaml").write_text("{}\n")
    (tmp_path / "starting" / "metrics.jsonl").write_text('{"step": 1, "lo')
    cases = {"missing": "does not exist", "empty": "has no metrics.jsonl yet", "starting": "holds no training record"}
    for name, expected in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            report.main([str(tmp_path / name)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err


# ---- in a browser ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium; skipped without it locally, a failure when MOE_BROWSER_REQUIRED=1 (CI, .ci/run)."""
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("MOE_BROWSER_REQUIRED") == "1":
            pytest.fail(f"MOE_BROWSER_REQUIRED=1 but {BROWSER_SKIP}", pytrace=False)
        pytest.skip(BROWSER_SKIP)
    return path


def headless(chromium: str, page: Path, profile: Path, *mode: str) -> subprocess.CompletedProcess:
    """One headless Chromium run on `page` (root in a container: no sandbox; no GPU, no display needed);
    console messages go to stderr as `...:CONSOLE...] "<message>", source: ...`."""
    command = [
        chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", *mode,
        page.as_uri(),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def viridis_lookup() -> np.ndarray:
    """(32, 32, 32) bool: colours within one 8-level bin of the Viridis scale (RGB >> 3)."""
    table = np.zeros((32, 32, 32), dtype=bool)
    for color in sample_colorscale("Viridis", np.linspace(0, 1, 512)):
        r, g, b = (int(float(c)) >> 3 for c in color.removeprefix("rgb(").removesuffix(")").split(","))
        table[max(r - 1, 0) : r + 2, max(g - 1, 0) : g + 2, max(b - 1, 0) : b + 2] = True
    return table


def test_the_report_renders_in_chromium_without_console_errors(chromium: str, single_run: Path, tmp_path) -> None:
    output = tmp_path / "report.html"
    report.main([str(single_run), "-o", str(output)])
    screenshot = tmp_path / "report.png"
    shot = headless(chromium, output, tmp_path / "profile", f"--screenshot={screenshot}", "--window-size=1400,3000")
    assert console_messages(shot.stderr) == []
    dom = headless(chromium, output, tmp_path / "profile", "--dump-dom")
    assert console_messages(dom.stderr) == []
    for name in FIGURES:  # plotly drew each figure: its div holds the svg plotly makes
        assert re.search(rf'id="{name}"[^>]*class="[^"]*js-plotly-plot', dom.stdout), name
    assert dom.stdout.count('class="main-svg"') >= len(FIGURES)

    pixels = np.asarray(Image.open(screenshot).convert("RGB"))  # (H, W, 3)
    assert pixels.shape[:2] == (3000, 1400)
    assert pixels.std() > 20 and (pixels.min(axis=2) < 200).mean() > 0.02, "the page is not blank"
    binned = pixels >> 3
    heatmap = viridis_lookup()[binned[..., 0], binned[..., 1], binned[..., 2]]  # (H, W)
    rows, cols = np.nonzero(heatmap)
    assert rows.size > 20_000, "the heatmap's cells are on screen"
    region = pixels[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    assert region.shape[0] > 100 and region.shape[1] > 400 and region.reshape(-1, 3).std(axis=0).max() > 10
    # Each cell is one flat colour; cells of different load differ (the colour bar's thin stripes are too small).
    colors, counts = np.unique(pixels[heatmap], axis=0, return_counts=True)
    assert (counts > 2000).sum() >= 3, "at least three heatmap cells of distinct load"
