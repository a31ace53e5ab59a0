"""Routing alerts: router collapse, dropped tokens and dead experts must never go unnoticed.

A condition is one of: a layer's MaxVio above `logging.alert_maxvio`, a layer's drop fraction above
`logging.alert_drop_frac`, or one expert of a layer with zero tokens in the log window. When a condition holds for
`logging.alert_consecutive_logs` (M) consecutive log records, `RoutingAlerts.check` returns one alert record and
rank 0 prints one warning line. That is one alert per episode: nothing more while the condition persists; once a
log finds it cleared, its streak restarts, and a relapse that lasts M logs alerts again.

Every rank sees the same (all-reduced) record, so every rank keeps the same streaks; only rank 0 prints, and the
trainer's sinks write records on rank 0 only.

Streaks are not checkpointed: a resumed job starts them from zero (registering a new object with Accelerate's
checkpoint would make every earlier checkpoint unloadable). An episode that outlives a preemption is therefore
reported again by the resumed job, after M of its own logs.
"""

import logging
from typing import Any

from moe_platform.monitor.dashboards import tokens_per_expert_by_layer

log = logging.getLogger(__name__)


class RoutingAlerts:
    def __init__(self, logging_config, is_main: bool) -> None:
        self.thresholds = {"maxvio": logging_config.alert_maxvio, "drop_frac": logging_config.alert_drop_frac}
        self.consecutive = logging_config.alert_consecutive_logs
        self.is_main = is_main
        # (kind, layer, expert or None) -> consecutive logs the condition has held; an episode alerts when its
        # streak reaches M exactly, so a persisting one stays silent and only a cleared-then-relapsed one re-alerts.
        self.streaks: dict[tuple[str, int, int | None], int] = {}

    def check(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The alert records (metrics.jsonl format) that this training record completes; warns on rank 0."""
        holding = {condition: value for condition, value in self._conditions(record)}
        self.streaks = {condition: self.streaks.get(condition, 0) + 1 for condition in holding}
        alerts = []
        for condition, streak in self.streaks.items():
            if streak == self.consecutive:
                alerts.append(self._alert(record["step"], *condition, holding[condition]))
        for alert in alerts:
            if self.is_main:
                log.warning(alert["message"])
        return alerts

    def _conditions(self, record: dict[str, Any]):
        """(kind, layer, expert) and its value, for every condition that holds in this record."""
        for layer, tokens_per_expert in tokens_per_expert_by_layer(record).items():
            for kind, threshold in self.thresholds.items():
                value = record[f"moe/layer_{layer}/{kind}"]
                if value > threshold:
                    yield (kind, layer, None), value
            for expert, tokens in enumerate(tokens_per_expert):
                if tokens == 0:
                    yield ("dead_expert", layer, expert), 0

    def _alert(self, step: int, kind: str, layer: int, expert: int | None, value: float) -> dict[str, Any]:
        m = self.consecutive
        if kind == "dead_expert":
            metric, threshold = f"moe/layer_{layer}/tokens_per_expert", 0
            message = (
                f"routing alert at step {step}: layer {layer} expert {expert} got no tokens for {m} logs in a row "
                "(dead expert)"
            )
        else:
            metric, threshold = f"moe/layer_{layer}/{kind}", self.thresholds[kind]
            name, hint = {
                "maxvio": ("MaxVio", "router collapsing onto few experts"),
                "drop_frac": ("drop fraction", "tokens lost to expert capacity"),
            }[kind]
            message = (
                f"routing alert at step {step}: layer {layer} {name} {value:.3g} > {threshold:g} "
                f"for {m} logs in a row ({hint})"
            )
        return {
            "step": step,
            "alert": kind,
            "layer": layer,
            "expert": expert,
            "metric": metric,
            "value": value,
            "threshold": threshold,
            "consecutive_logs": m,
            "message": message,
        }
