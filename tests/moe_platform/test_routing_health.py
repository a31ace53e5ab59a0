"""Routing health: across-layer summaries, the collapse alert's episodes on a really collapsed router, the
progress line, the config checks, and a real run's metrics.jsonl (new keys, no alert on the default run)."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from moe.moe_config import MoEConfig, RouterConfig
from moe.moe_layer import MoELayer
from moe.stats import MoEStats, summarize
from moe_platform.config import ConfigError, LoggingConfig
from moe_platform.monitor.alerts import RoutingAlerts
from moe_platform.monitor.dashboards import ACROSS_LAYER_METRICS, ACROSS_LAYER_STATS
from moe_platform.monitor.metrics import LAYER_METRICS, across_layers, moe_record, reduce_moe_stats
from moe_platform.monitor.progress import Progress
from moe_platform.testing import moe_train

D = 8


def stats_of(before: list[int], after: list[int] | None = None) -> MoEStats:
    """One micro-batch of top-1 routing with these per-expert counts (after capacity: `after`, default all kept)."""
    after = before if after is None else after
    return MoEStats(
        tokens_per_expert_before=torch.tensor(before),
        tokens_per_expert_after=torch.tensor(after),
        num_tokens=torch.tensor(sum(before)),
        fully_dropped_tokens=torch.tensor(sum(before) - sum(after)),
        entropy_sum=torch.tensor(0.5 * sum(before)),
        aux_loss_sum=torch.tensor(0.01),
        z_loss_sum=torch.tensor(0.001),
        num_micro_batches=torch.tensor(1),
    )


def test_across_layer_summaries_are_linear_percentiles_and_name_the_worst_layer():
    # Layer ids need not be contiguous (dense layers between MoE ones): the worst layer is an id, not an index.
    maxvio = {1: 0.5, 3: 2.0, 5: 0.1, 7: 0.5, 9: 1.5}
    entropy = {1: 1.3, 3: 0.2, 5: 1.1, 7: 0.2, 9: 0.9}
    summaries = {
        layer: {"maxvio": maxvio[layer], "drop_frac": 0.0, "cv": 0.1, "entropy": entropy[layer], "dead_experts": 0}
        for layer in maxvio
    }
    record = across_layers(summaries)
    assert set(record) == {f"moe/all/{m}_{s}" for m in ACROSS_LAYER_METRICS for s in ACROSS_LAYER_STATS}
    # Sorted MaxVio: 0.1 0.5 0.5 1.5 2.0; p95 sits at position 0.95 · 4 = 3.8, between 1.5 and 2.0.
    assert record["moe/all/maxvio_min"] == 0.1 and record["moe/all/maxvio_max"] == 2.0
    assert record["moe/all/maxvio_p50"] == 0.5
    assert record["moe/all/maxvio_p95"] == pytest.approx(1.5 + 0.8 * 0.5)
    assert record["moe/all/maxvio_worst_layer"] == 3
    # Entropy's worst is its minimum; on a tie (layers 3 and 7) the lowest id.
    assert record["moe/all/entropy_worst_layer"] == 3 and record["moe/all/entropy_min"] == 0.2
    assert record["moe/all/drop_frac_worst_layer"] == 1  # all equal: the first layer
    for name in ACROSS_LAYER_METRICS:
        s = [record[f"moe/all/{name}_{q}"] for q in ("min", "p50", "p95", "max")]
        assert s == sorted(s)
    # One layer: every summary is that layer's value.
    one = across_layers({4: summaries[3]})
    assert one["moe/all/maxvio_min"] == one["moe/all/maxvio_p95"] == one["moe/all/maxvio_max"] == 2.0
    assert one["moe/all/maxvio_worst_layer"] == 4


def test_reduce_moe_stats_emits_every_layer_key_and_the_summaries_across_layers():
    stats_by_layer = {0: stats_of([4, 4, 4, 4]), 2: stats_of([13, 1, 1, 1], [8, 1, 1, 1]), 3: stats_of([8, 8, 0, 0])}
    record = reduce_moe_stats(Accelerator(cpu=True), stats_by_layer)
    for layer, stats in stats_by_layer.items():
        expected = summarize(stats)
        for name in LAYER_METRICS:
            assert record[f"moe/layer_{layer}/{name}"] == pytest.approx(expected[name])
    assert record["moe/layer_2/maxvio"] == 2.25 and record["moe/layer_3/dead_experts"] == 2
    assert record["moe/all/maxvio_worst_layer"] == 2 and record["moe/all/drop_frac_worst_layer"] == 2
    assert record["moe/all/dead_experts_max"] == 2 and record["moe/all/dead_experts_worst_layer"] == 3
    assert record["moe/all/maxvio_p50"] == float(np.median([0.0, 2.25, 1.0]))
    json.dumps(record)  # a metrics.jsonl line: plain numbers and lists only


def collapsed_layer() -> MoELayer:
    """A real top-1 MoE layer (Switch gates) whose router sends every token with positive features to expert 0."""
    config = MoEConfig(
        num_experts=4, top_k=1, expert_d_ff=12, min_capacity=0, router=RouterConfig(renormalize_topk=False)
    )
    layer = MoELayer(D, config, "swiglu")
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 10.0  # logit_0 = 10 · Σ x > 0 = every other logit
    return layer


def window_record(step: int, healthy: MoELayer, collapsed: MoELayer, micro_batches: int = 2) -> dict:
    """One log window as the trainer builds it: layer 0 healthy, layer 3 collapsed; each layer's micro-batch stats
    are summed over the window, then reduce_moe_stats makes the record."""
    stats_by_layer = {}
    for _ in range(micro_batches):
        x_BTD = torch.randn(2, 16, D)
        for layer_id, stats in ((0, healthy(x_BTD).stats), (3, collapsed(x_BTD.abs() + 0.1).stats)):
            stats_by_layer[layer_id] = stats if layer_id not in stats_by_layer else stats_by_layer[layer_id] + stats
    return {"step": step, **reduce_moe_stats(Accelerator(cpu=True), stats_by_layer)}


def test_the_alert_fires_once_on_a_collapsed_router_and_never_on_a_healthy_one(caplog):
    torch.manual_seed(0)
    healthy = MoELayer(D, MoEConfig(num_experts=4, top_k=2, expert_d_ff=12, min_capacity=0), "swiglu")
    collapsed = collapsed_layer()
    alerts = RoutingAlerts(LoggingConfig(alert_consecutive_logs=2), is_main=True)
    with caplog.at_level(logging.WARNING, logger="moe_platform.monitor.alerts"):
        fired = [alerts.check(window_record(step, healthy, collapsed)) for step in (10, 20, 30, 40)]
    assert fired[0] == [] and fired[2] == [] and fired[3] == []  # not yet; then silent while it persists
    by_kind = {(a["alert"], a["expert"]): a for a in fired[1]}
    assert set(by_kind) == {("maxvio", None), ("dead_expert", 1), ("dead_expert", 2), ("dead_expert", 3)}
    maxvio = by_kind[("maxvio", None)]
    assert maxvio["value"] == 3.0 and maxvio["layer"] == 3 and maxvio["step"] == 20
    assert maxvio["threshold"] == 1.0 and maxvio["consecutive_logs"] == 2
    assert maxvio["metric"] == "moe/layer_3/maxvio"
    assert all(a["layer"] == 3 for a in fired[1])  # the healthy layer 0 never alerts
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [a["message"] for a in fired[1]]  # one printed line per alert
    assert "layer 3 MaxVio 3 > 1" in maxvio["message"] and "step 20" in maxvio["message"]
    assert "layer 3 expert 2 got no tokens" in by_kind[("dead_expert", 2)]["message"]
    json.dumps(fired[1])


def record_of(step: int, before: list[int], after: list[int] | None = None) -> dict:
    return {"step": step, **moe_record({0: summarize(stats_of(before, after))})}


def test_one_alert_per_episode_and_again_after_recovery_and_relapse():
    even, skewed = [4, 4, 4, 4], [13, 1, 1, 1]  # MaxVio 0 and 2.25
    alerts = RoutingAlerts(LoggingConfig(alert_consecutive_logs=3), is_main=False)
    history = [even, skewed, skewed, skewed, skewed, skewed, even, skewed, skewed, even, skewed, skewed, skewed]
    fired = {step: alerts.check(record_of(step, load)) for step, load in enumerate(history)}
    assert [step for step, found in fired.items() if found] == [3, 12]  # a 2-log relapse (7, 8) is too short
    assert all(a["alert"] == "maxvio" for found in fired.values() for a in found)


def test_drop_fraction_and_dead_expert_alerts_have_their_own_streaks():
    alerts = RoutingAlerts(LoggingConfig(alert_consecutive_logs=2, alert_drop_frac=0.2), is_main=False)
    # 16 routed, 12 kept: drop fraction 0.25; expert 3 dead in the first two logs, expert 2 in the last two.
    first = alerts.check(record_of(1, [6, 5, 5, 0], [3, 4, 5, 0]))
    second = alerts.check(record_of(2, [6, 5, 5, 0], [3, 4, 5, 0]))
    third = alerts.check(record_of(3, [6, 5, 0, 5], [6, 5, 0, 5]))
    fourth = alerts.check(record_of(4, [6, 5, 0, 5], [6, 5, 0, 5]))
    assert first == [] and third == []
    assert {(a["alert"], a["expert"]) for a in second} == {("drop_frac", None), ("dead_expert", 3)}
    assert next(a for a in second if a["alert"] == "drop_frac")["value"] == 0.25
    assert [(a["alert"], a["expert"]) for a in fourth] == [("dead_expert", 2)]


def test_records_without_moe_layers_never_alert():
    alerts = RoutingAlerts(LoggingConfig(alert_consecutive_logs=1), is_main=False)
    assert alerts.check({"step": 1, "loss": 3.0}) == []


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"moe_detail": "full"}, "logging.moe_detail='full' is unknown"),
        ({"visuals_every": -1}, "logging.visuals_every=-1 must be >= 0"),
        ({"alert_maxvio": 0.0}, "logging.alert_maxvio=0.0 must be positive"),
        ({"alert_drop_frac": 1.0}, "logging.alert_drop_frac=1.0 must lie in [0, 1)"),
        ({"alert_consecutive_logs": 0}, "logging.alert_consecutive_logs=0 must be >= 1"),
    ],
)
def test_bad_logging_configs_fail_with_one_sentence(fields: dict, needle: str):
    with pytest.raises(ConfigError) as excinfo:
        LoggingConfig(**fields)
    assert needle in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_the_progress_line_adds_the_worst_layers_maxvio_only_for_moe_models(capsys):
    run = {"loss": 3.0, "tokens_per_s": 1000.0, "mfu": 0.1}
    moe = {**run, **moe_record({0: summarize(stats_of([4, 4, 4, 4])), 3: summarize(stats_of([13, 1, 1, 1]))})}
    with Progress(total_steps=2, start_step=0, enabled=True) as progress:
        progress.update(1, run)
        progress.update(2, moe)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("step 1  loss 3.0000") and "maxvio" not in lines[0]
    assert lines[1] == lines[0].replace("step 1", "step 2") + "  maxvio 2.25 (L3)"


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_default_run_logs_routing_health_and_raises_no_alert(tmp_path: Path):
    result = moe_train(tmp_path)
    records = read_records(tmp_path)
    train = [r for r in records if "loss" in r]
    assert len(train) == 6 and not any("alert" in r for r in records)
    assert "routing alert" not in result.stdout + result.stderr
    for record in train:
        for layer in range(4):  # moe_tiny: 4 MoE layers of 4 experts
            assert {f"moe/layer_{layer}/{name}" for name in LAYER_METRICS} <= set(record)
            assert sum(record[f"moe/layer_{layer}/utilisation"]) == pytest.approx(4)
        assert 0 <= record["moe/all/maxvio_min"] <= record["moe/all/maxvio_p50"] <= record["moe/all/maxvio_max"]
        assert record["moe/all/maxvio_worst_layer"] in range(4)


def test_a_run_past_the_threshold_prints_and_records_one_alert_per_layer(tmp_path: Path):
    """Through the real trainer: a MaxVio threshold every layer exceeds alerts each layer once, after M logs."""
    result = moe_train(tmp_path, "trainer.max_steps=3", "logging.alert_maxvio=1e-6", "logging.alert_consecutive_logs=2")
    alerts = [r for r in read_records(tmp_path) if "alert" in r]
    assert sorted((a["step"], a["alert"], a["layer"]) for a in alerts) == [(2, "maxvio", layer) for layer in range(4)]
    output = result.stdout + result.stderr
    for alert in alerts:
        assert output.count(alert["message"]) == 1
