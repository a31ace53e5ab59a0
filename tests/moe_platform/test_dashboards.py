"""What reaches wandb and TensorBoard: a bounded scalar key set in "brief", per-layer series in "detailed", the
expert × layer heatmap and the histograms, read back with wandb's record format and TensorBoard's EventAccumulator."""

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from moe.stats import MoEStats, summarize
from moe_platform.config import LoggingConfig
from moe_platform.monitor.dashboards import (
    ACROSS_LAYER_METRICS,
    ACROSS_LAYER_STATS,
    ALERTS_KEY,
    ALL_UTILISATION_KEY,
    HEATMAP_KEY,
    LAYER_SCALARS,
    heatmap_image,
    scalar_metrics,
    utilisation_LE,
)
from moe_platform.monitor.metrics import MetricSinks, moe_record, wandb_run_id
from moe_platform.testing import finished_wandb_files

RUN_SCALARS = {"loss": 3.2, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 1234.0}
BRIEF_MOE_KEYS = len(ACROSS_LAYER_METRICS) * len(ACROSS_LAYER_STATS)  # 25


def layer_summary(load_E: list[int]) -> dict:
    """moe.stats.summarize of one layer that routed `load_E` assignments (top-1, nothing dropped)."""
    before_E = torch.tensor(load_E, dtype=torch.int64)
    total = before_E.sum()
    return summarize(
        MoEStats(
            tokens_per_expert_before=before_E,
            tokens_per_expert_after=before_E.clone(),
            num_tokens=total,
            fully_dropped_tokens=torch.tensor(0),
            entropy_sum=total.double() * 0.5,
            aux_loss_sum=torch.tensor(0.01),
            z_loss_sum=torch.tensor(0.001),
            num_micro_batches=torch.tensor(1),
        )
    )


def train_record(layers: int, experts: int, step: int = 1, seed: int = 0) -> dict:
    """A train record as the trainer logs it, with uneven random loads and some dead experts."""
    generator = torch.Generator().manual_seed(seed + step)
    summaries = {}
    for layer in range(layers):
        load_E = torch.randint(0, 50, (experts,), generator=generator)
        load_E[layer % experts] = 0  # one dead expert per layer
        summaries[layer] = layer_summary(load_E.tolist())
    return {"step": step, **RUN_SCALARS, **moe_record(summaries)}


def test_brief_scalar_keys_do_not_grow_with_layers_or_experts():
    small = scalar_metrics(train_record(layers=2, experts=4), "brief")
    large = scalar_metrics(train_record(layers=32, experts=64), "brief")
    assert small.keys() == large.keys()
    moe_keys = {key for key in large if key.startswith("moe/")}
    assert all(key.startswith("moe/all/") for key in moe_keys)
    assert len(moe_keys) == BRIEF_MOE_KEYS
    assert large.keys() - moe_keys == RUN_SCALARS.keys()


def test_detailed_adds_per_layer_scalars_linear_in_layers_never_in_experts():
    record = train_record(layers=32, experts=64)
    detailed = scalar_metrics(record, "detailed")
    assert len(detailed) == len(scalar_metrics(record, "brief")) + len(LAYER_SCALARS) * 32
    assert detailed.keys() == scalar_metrics(train_record(layers=32, experts=4), "detailed").keys()
    assert all(isinstance(value, int | float) for value in detailed.values())  # no list became a key per expert
    assert record["moe/layer_3/maxvio"] == detailed["moe/layer_3/maxvio"]


def test_heatmap_colours_balance_overload_and_dead_experts():
    util_LE = np.array([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [0.25, 0.5, 1.5, np.nan]])
    image_HW3 = heatmap_image(util_LE)
    cell = image_HW3.shape[0] // 3
    assert image_HW3.shape == (3 * cell, 4 * cell, 3) and image_HW3.dtype == np.uint8

    def pixel(layer, expert):
        return tuple(int(c) for c in image_HW3[layer * cell + cell // 2, expert * cell + cell // 2])

    assert {pixel(0, e) for e in range(4)} == {(255, 255, 255)}  # balanced: white
    assert pixel(1, 0) == (255, 0, 0)  # 4× ideal: saturated red
    assert pixel(1, 1) == (0, 0, 0)  # dead: black
    assert pixel(2, 0) == (0, 0, 255)  # a quarter of ideal: saturated blue
    assert pixel(2, 1)[2] == 255 and pixel(2, 1)[0] < 255  # half: paler blue
    assert pixel(2, 3) == (128, 128, 128)  # no value: grey


def test_utilisation_from_counts_matches_the_records_utilisation():
    record = train_record(layers=3, experts=8)
    layers, given_LE = utilisation_LE(record)
    without = {k: v for k, v in record.items() if not k.endswith("/utilisation")}
    assert layers == [0, 1, 2]
    np.testing.assert_allclose(utilisation_LE(without)[1], given_LE)
    np.testing.assert_allclose(given_LE.mean(axis=1), 1.0)  # load / ideal averages to 1 in every layer


def wandb_history(run_dir: Path, expected_runs: int) -> tuple[list, dict[int, dict]]:
    """(the `run` records of the `expected_runs` offline runs under run_dir, {step: {logged key: value}}); a media
    value (image, histogram) is the dict of its fields."""
    runs, rows = [], {}
    for records in finished_wandb_files(run_dir, expected_runs):
        for record in records:
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.append(record.run)
            elif kind == "history":
                row: dict = {}
                for item in record.history.item:
                    value = json.loads(item.value_json)
                    path = list(item.nested_key) or [item.key]
                    if len(path) > 1:  # media: one item per field of the logged object
                        row.setdefault(path[0], {})[path[-1]] = value
                    else:
                        row[path[0]] = value
                rows[row["_step"]] = row
    return runs, rows


WANDB_OWN = {"_step", "_runtime", "_timestamp"}


def test_wandb_offline_run_holds_the_bounded_scalars_the_heatmap_and_continues_on_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    logging_config = LoggingConfig(
        wandb=True,
        wandb_mode="offline",
        wandb_project="moe-dash",
        wandb_group="sweep-7",
        wandb_tags=["moe", "test"],
        visuals_every=2,
    )
    records = [train_record(layers=32, experts=64, step=step) for step in (1, 2, 3)]
    sinks = MetricSinks(tmp_path, {"trainer": {"max_steps": 4}}, logging_config, is_main=True)
    for record in records:
        sinks.write(record)
    sinks.write({"step": 3, "eval/loss": 2.5})
    alert = {"step": 3, "alert": "maxvio", "layer": 1, "expert": None, "metric": "maxvio", "message": "layer 1 ..."}
    sinks.write(alert)
    sinks.close()
    time.sleep(1.01 - time.time() % 1)  # wandb names an offline run's folder by the second it starts
    resumed = MetricSinks(tmp_path, {"trainer": {"max_steps": 4}}, logging_config, is_main=True)  # a later job
    resumed.write(train_record(layers=32, experts=64, step=4))
    resumed.close()

    runs, rows = wandb_history(tmp_path, expected_runs=2)
    assert len(runs) == 2 and {run.run_id for run in runs} == {wandb_run_id(tmp_path)}
    first = runs[0]
    assert (first.project, first.run_group, list(first.tags)) == ("moe-dash", "sweep-7", ["moe", "test"])
    assert first.display_name == tmp_path.name
    assert sorted(rows) == [1, 2, 3, 4]

    scalar_keys = {key for row in rows.values() for key, value in row.items() if not isinstance(value, dict)}
    scalar_keys -= WANDB_OWN
    assert scalar_keys == set(scalar_metrics(records[0], "brief")) | {"eval/loss", ALERTS_KEY}
    assert len(scalar_keys) <= len(RUN_SCALARS) + BRIEF_MOE_KEYS + 2  # the brief bound, at 32 layers × 64 experts
    assert not any(key.startswith("moe/layer_") for row in rows.values() for key in row)
    assert rows[3]["eval/loss"] == 2.5 and rows[3][ALERTS_KEY] == 1 and rows[3]["loss"] == RUN_SCALARS["loss"]

    # Pictures on the 1st and 3rd log of the first job, and on the resumed job's 1st log.
    assert [step for step, row in rows.items() if HEATMAP_KEY in row] == [1, 3, 4]
    heatmap = rows[1][HEATMAP_KEY]
    assert heatmap["_type"] == "image-file"
    [png] = tmp_path.glob(f"wandb/offline-run-*/files/{heatmap['path']}")
    picture = np.asarray(Image.open(png).convert("RGB"))
    np.testing.assert_array_equal(picture, heatmap_image(utilisation_LE(records[0])[1]))
    assert picture.shape[1] // picture.shape[0] == 2  # 64 experts wide, 32 layers high
    assert rows[1][ALL_UTILISATION_KEY]["_type"] == "histogram"
    assert sum(rows[1][ALL_UTILISATION_KEY]["values"]) == 32 * 64


def test_tensorboard_reads_back_per_layer_scalars_histograms_and_the_heatmap(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging_config = LoggingConfig(tensorboard=True, moe_detail="detailed", visuals_every=1)
    records = [train_record(layers=3, experts=8, step=step) for step in (1, 2)]
    sinks = MetricSinks(tmp_path, {}, logging_config, is_main=True)
    for record in records:
        sinks.write(record)
    sinks.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    assert set(tags["scalars"]) == set(scalar_metrics(records[0], "detailed"))
    assert {f"moe/layer_{i}/{m}" for i in range(3) for m in LAYER_SCALARS} <= set(tags["scalars"])
    last = records[-1]
    assert [e.step for e in events.Scalars("moe/layer_2/maxvio")] == [1, 2]
    assert events.Scalars("moe/layer_2/maxvio")[-1].value == pytest.approx(last["moe/layer_2/maxvio"])

    histogram_tags = {f"moe/layer_{i}/tokens_per_expert" for i in range(3)} | {ALL_UTILISATION_KEY}
    assert histogram_tags <= set(tags["histograms"])
    for layer in range(3):
        histogram = events.Histograms(f"moe/layer_{layer}/tokens_per_expert")[-1].histogram_value
        assert list(histogram.bucket) == last[f"moe/layer_{layer}/tokens_per_expert"]  # bar e = tokens of expert e
        assert histogram.num == sum(last[f"moe/layer_{layer}/tokens_per_expert"])
    assert events.Histograms(ALL_UTILISATION_KEY)[-1].histogram_value.num == 3 * 8

    [first_image, second_image] = events.Images(HEATMAP_KEY)
    picture = np.asarray(Image.open(io.BytesIO(second_image.encoded_image_string)).convert("RGB"))
    np.testing.assert_array_equal(picture, heatmap_image(utilisation_LE(last)[1]))
    assert (first_image.step, second_image.step) == (1, 2)


def test_alert_records_reach_metrics_jsonl_whole_and_no_dashboard_scalar_but_the_count(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = MetricSinks(tmp_path, {}, LoggingConfig(tensorboard=True), is_main=True)
    record = train_record(layers=2, experts=4, step=5)
    alert = {"step": 5, "alert": "dead_expert", "layer": 0, "expert": 0, "metric": "tokens", "value": 0,
             "threshold": 0, "consecutive_logs": 3, "message": "layer 0 expert 0 dead for 3 logs"}  # fmt: skip
    sinks.write(record)
    sinks.write(alert)
    sinks.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [json.loads(json.dumps(record)), alert]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert ALERTS_KEY in events.Tags()["scalars"] and "layer" not in events.Tags()["scalars"]
    assert [e.value for e in events.Scalars(ALERTS_KEY)] == [1]
