"""`moe-report RUN_DIR [-o report.html]`: one self-contained HTML file that answers "is this run healthy?".

Built from the run directory's metrics.jsonl and config.yaml alone (no server, no network, plotly's JS inlined), so
it works on a cluster that cannot reach wandb, on a run that is still going and on one resumed after preemption:

* metrics.jsonl holds three kinds of record, told apart by their keys: training ("loss"), evaluation ("eval/loss")
  and alert ("alert"). A resumed run re-logs the steps between its checkpoint and the interruption; the last
  record of a step wins, so no step appears twice. A line that is not JSON (the one being written right now, or one
  cut short by a kill) is skipped and counted.
* Per MoE layer the report reads `moe/layer_{i}/tokens_per_expert` (old runs have only those counts) and uses
  `moe/layer_{i}/maxvio` and `.../utilisation` when the run logged them; both are computed from the counts
  otherwise, with the same definitions (moe/stats.py: utilisation = load / mean load, MaxVio = (max − mean) / mean).
* The ledger is `moe.format_ledger` for the saved config; the world size, which config.yaml does not hold, is the
  length of the first record's `memory/params_per_rank` (one entry per rank).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from moe import format_ledger
from moe.stats import load_balance
from moe_platform.monitor.dashboards import tokens_per_expert_by_layer

MAX_SLIDER_STEPS = 60  # heatmap positions kept in the file; a long run is subsampled evenly (last step kept)
MAX_HEATMAP_LABELS = 256  # cells above which the heatmap drops its per-cell numbers
# The efficiency figure: the first of these the run logged (throughput.py: MFU needs a real peak).
EFFICIENCY = (
    ("mfu", "MFU"),
    ("model_flops_vs_matmul_probe", "model FLOP/s ÷ CPU matmul probe (not an MFU)"),
    ("model_tflops_per_device", "model TFLOP/s per device"),
)
METRICS_FILE, CONFIG_FILE = "metrics.jsonl", "config.yaml"


class ReportError(Exception):
    """The run directory cannot give a report; the message is one sentence naming what is missing."""


@dataclass
class RunRecords:
    """metrics.jsonl split by kind, one record per step (the last written wins), in step order."""

    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    repeated: int = 0  # records replaced by a later record of the same step (a resume logged the step again)
    unreadable: int = 0  # lines that are not a JSON object (the one being written, or one cut short)


def read_records(path: Path) -> RunRecords:
    """metrics.jsonl by kind: training ("loss"), evaluation ("eval/loss") and alert ("alert") records."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    alerts: dict[tuple, dict] = {}
    records = RunRecords()
    for line in Path(path).read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            records.unreadable += 1
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            records.unreadable += 1
            continue
        step = record["step"]
        if "alert" in record:  # a resumed run may raise the same alert again at the same step
            alerts[(step, record["alert"], record.get("layer"), record.get("expert"))] = record
            continue
        by_step = evals if "eval/loss" in record else train
        if "eval/loss" not in record and "loss" not in record:
            continue  # a kind this reader does not know
        records.repeated += step in by_step
        by_step[step] = record
    records.train = [train[s] for s in sorted(train)]
    records.evals = [evals[s] for s in sorted(evals)]
    records.alerts = [alerts[k] for k in sorted(alerts, key=lambda k: (k[0], str(k[1:])))]
    return records


def moe_layers(train: list[dict[str, Any]]) -> list[int]:
    """Ids of the MoE layers that have expert counts in any record."""
    return sorted({layer for record in train for layer in tokens_per_expert_by_layer(record)})


def utilisation(record: dict[str, Any], layer: int) -> list[float] | None:
    """Load / ideal per expert (mean 1.0); the logged value when present, else from the counts."""
    return _balance(record, layer, "utilisation")


def maxvio(record: dict[str, Any], layer: int) -> float | None:
    """(max load − mean) / mean; the logged value when present, else from the counts."""
    return _balance(record, layer, "maxvio")


def dead_experts(record: dict[str, Any], layer: int) -> int | None:
    return _balance(record, layer, "dead_experts")


def _balance(record: dict[str, Any], layer: int, name: str) -> Any:
    """A layer's balance metric as logged, or computed from its counts as the trainer computes it (runs from
    before the metric existed); None for a record without that layer."""
    logged = record.get(f"moe/layer_{layer}/{name}")
    if logged is not None:
        return logged
    counts = record.get(f"moe/layer_{layer}/tokens_per_expert")
    return None if counts is None else load_balance(counts)[name]


def _finite(value: Any) -> float | None:
    """A plottable number, or None (a gap) for a missing, NaN or infinite value."""
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float | None]]:
    steps = [r["step"] for r in records if key in r]
    return steps, [_finite(r[key]) for r in records if key in r]


# ---- what the config says -------------------------------------------------------------------------------------------


def entropy_floor(config) -> float | None:
    """Best achievable loss in nats/token of the synthetic language, computed from the saved config exactly as the
    data pipeline does (from its tables alone, no corpus is sampled); None for real text or an unreadable config."""
    if config is None or config.data.source != "synthetic":
        return None
    from data_pipeline import SyntheticLanguage

    return SyntheticLanguage(config.data.synthetic).entropy_floor


def world_size(train: list[dict[str, Any]]) -> int | None:
    """Ranks of the run when it logged its first step: that record's footprint has one entry per rank (a later job
    of a resumed run may use another world size; its records do not say)."""
    sizes = [len(r["memory/params_per_rank"]) for r in train if isinstance(r.get("memory/params_per_rank"), list)]
    return sizes[-1] if sizes else None


def ledger_text(config, ranks: int | None) -> str:
    """The start-up ledger of this config, for the run's world size (1 assumed, and said, when unknown): the run
    shape the trainer printed, activation checkpointing and the document mask included."""
    dp_size = ranks or 1
    where = (
        f"{dp_size} rank(s), the run's world size at its first logged step"
        if ranks
        else "1 rank assumed (metrics.jsonl does not record the world size yet)"
    )
    return f"for {where}\n\n{format_ledger(config.model, config.run_shape(dp_size))}"


# ---- figures --------------------------------------------------------------------------------------------------------


def _layout(fig: go.Figure, title: str, height: int = 360) -> go.Figure:
    fig.update_layout(
        title={"text": title},
        height=height,
        margin={"l": 60, "r": 30, "t": 60, "b": 50},
        legend={"orientation": "h", "y": -0.2},
        template="plotly_white",
    )
    return fig


def loss_figure(records: RunRecords, floor: float | None) -> go.Figure:
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    steps, values = _series(records.train, "loss")
    fig.add_trace(go.Scatter(x=steps, y=values, mode="lines", name="train loss"))
    if records.evals:
        steps, values = _series(records.evals, "eval/loss")
        fig.add_trace(go.Scatter(x=steps, y=values, mode="lines+markers", name="eval loss"))
    steps, values = _series(records.train, "aux_loss")
    if steps:
        fig.add_trace(
            go.Scatter(x=steps, y=values, mode="lines", name="MoE aux loss (right)", opacity=0.6), secondary_y=True
        )
    if floor is not None:
        fig.add_hline(
            y=floor,
            line_dash="dash",
            line_color="black",
            annotation_text=f"entropy floor {floor:.4f}",
            annotation_position="top right",
        )
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss (nats/token)", secondary_y=False)
    fig.update_yaxes(title_text="aux loss", secondary_y=True, showgrid=False)
    return _layout(fig, "Loss" + ("" if floor is not None else " (entropy floor unknown for this data)"))


def throughput_figure(train: list[dict[str, Any]]) -> go.Figure:
    """tokens/s beside MFU (against a real peak) or, on CPU, the model FLOP/s over the measured matmul rate."""
    key, label = next(((k, name) for k, name in EFFICIENCY if any(k in r for r in train)), ("mfu", "MFU (not logged)"))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens/s (all ranks)", label))
    for col, name in ((1, "tokens_per_s"), (2, key)):
        steps, values = _series(train, name)
        fig.add_trace(go.Scatter(x=steps, y=values, mode="lines", name=name, showlegend=False), row=1, col=col)
    fig.update_xaxes(title_text="step")
    return _layout(fig, "Throughput")


def optimizer_figure(train: list[dict[str, Any]]) -> go.Figure:
    fig = make_subplots(rows=1, cols=2, subplot_titles=("learning rate", "grad norm (before clipping)"))
    for col, key in ((1, "lr"), (2, "grad_norm")):
        steps, values = _series(train, key)
        fig.add_trace(go.Scatter(x=steps, y=values, mode="lines", name=key, showlegend=False), row=1, col=col)
    fig.update_xaxes(title_text="step")
    return _layout(fig, "Optimizer")


def heatmap_figure(train: list[dict[str, Any]], layers: list[int]) -> go.Figure:
    """Expert × layer utilisation (load / ideal) with a slider over logged steps (at most MAX_SLIDER_STEPS)."""
    logged = [r for r in train if any(f"moe/layer_{i}/tokens_per_expert" in r for i in layers)]
    if len(logged) > MAX_SLIDER_STEPS:
        stride = (len(logged) - 1) / (MAX_SLIDER_STEPS - 1)
        logged = [logged[round(k * stride)] for k in range(MAX_SLIDER_STEPS)]
    grids = []
    for record in logged:
        rows = [utilisation(record, layer) or [] for layer in layers]
        width = max(len(row) for row in rows)
        grids.append([[_finite(v) for v in row] + [None] * (width - len(row)) for row in rows])
    num_experts = max(len(grid[0]) for grid in grids)
    top = max([v for grid in grids for row in grid for v in row if v is not None] + [2.0])
    labels = len(layers) * num_experts <= MAX_HEATMAP_LABELS
    fig = go.Figure(
        go.Heatmap(
            z=grids[-1],
            x=list(range(num_experts)),
            y=[f"layer {i}" for i in layers],
            zmin=0.0,
            zmax=top,
            colorscale="Viridis",
            colorbar={"title": {"text": "load / ideal"}},
            texttemplate="%{z:.2f}" if labels else None,
            hovertemplate="expert %{x}, %{y}: %{z:.3f} × ideal<extra></extra>",
        )
    )
    steps = [
        {
            "label": str(r["step"]),
            "method": "update",
            "args": [{"z": [grid]}, {"title.text": _heatmap_title(r["step"])}],
        }
        for r, grid in zip(logged, grids, strict=True)
    ]
    fig.update_layout(
        sliders=[{"active": len(steps) - 1, "currentvalue": {"prefix": "step "}, "pad": {"t": 50}, "steps": steps}]
    )
    fig.update_xaxes(title_text="expert", dtick=1)
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, _heatmap_title(logged[-1]["step"]), height=max(360, 120 + 28 * len(layers)))


def _heatmap_title(step: int) -> str:
    return f"Expert load per layer at step {step} (1.0 = even; 0 = dead expert)"


def routing_figure(train: list[dict[str, Any]], layers: list[int], config) -> go.Figure:
    """MaxVio, drop fraction and dead experts per layer over time, with the alert thresholds when configured."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=("MaxVio (max − mean) / mean", "drop fraction", "dead experts"))
    palette = qualitative.Plotly if len(layers) <= len(qualitative.Plotly) else qualitative.Dark24
    for n, layer in enumerate(layers):
        color = palette[n % len(palette)]
        have = [r for r in train if f"moe/layer_{layer}/tokens_per_expert" in r]
        steps = [r["step"] for r in have]
        columns = (
            [maxvio(r, layer) for r in have],
            [_finite(r.get(f"moe/layer_{layer}/drop_frac")) for r in have],
            [dead_experts(r, layer) for r in have],
        )
        for col, values in enumerate(columns, start=1):
            fig.add_trace(
                go.Scatter(
                    x=steps,
                    y=values,
                    mode="lines",
                    name=f"layer {layer}",
                    legendgroup=f"layer {layer}",
                    showlegend=col == 1,
                    line={"color": color},
                ),
                row=1,
                col=col,
            )
    if config is not None:  # the thresholds the run alerted at (alerts.py)
        for col, name in ((1, "alert_maxvio"), (2, "alert_drop_frac")):
            fig.add_hline(
                y=getattr(config.logging, name),
                line_dash="dot",
                line_color="red",
                row=1,
                col=col,
                annotation_text=f"logging.{name}",
                annotation_position="top left",
            )
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(rangemode="tozero")
    return _layout(fig, "Routing health per MoE layer", height=400)


def mixture_sources(records: RunRecords) -> list[str]:
    """The names of a mixture's sources, from their `data/share/<name>` records (monitor/data_mix.py)."""
    prefix = "data/share/"
    return sorted({key[len(prefix) :] for r in records.train for key in r if key.startswith(prefix)})


def mixture_figure(records: RunRecords, sources: list[str]) -> go.Figure:
    """Each source's share of the tokens per log window beside its weight, and its own eval loss."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("share of each window's tokens (dotted: weight)",
                                                        "eval loss per source"))  # fmt: skip
    palette = qualitative.Plotly if len(sources) <= len(qualitative.Plotly) else qualitative.Dark24
    for n, name in enumerate(sources):
        color = palette[n % len(palette)]
        for key, dash, shown in ((f"data/share/{name}", None, True), (f"data/weight/{name}", "dot", False)):
            steps, values = _series(records.train, key)
            fig.add_trace(
                go.Scatter(x=steps, y=values, mode="lines", name=name, legendgroup=name, showlegend=shown,
                           line={"color": color, "dash": dash}),
                row=1, col=1,
            )  # fmt: skip
        steps, values = _series(records.evals, f"eval/loss/{name}")
        fig.add_trace(
            go.Scatter(x=steps, y=values, mode="lines+markers", name=name, legendgroup=name, showlegend=False,
                       line={"color": color}),
            row=1, col=2,
        )  # fmt: skip
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    return _layout(fig, "Data mixture", height=380)


def build_figures(records: RunRecords, config, floor: float | None) -> dict[str, go.Figure]:
    """The report's figures by element id, in page order (the mixture's only when the run mixed sources, MoE
    figures only when it logged expert counts)."""
    figures = {
        "fig-loss": loss_figure(records, floor),
        "fig-throughput": throughput_figure(records.train),
        "fig-optimizer": optimizer_figure(records.train),
    }
    if sources := mixture_sources(records):
        figures["fig-data-mix"] = mixture_figure(records, sources)
    layers = moe_layers(records.train)
    if layers:
        figures["fig-expert-load"] = heatmap_figure(records.train, layers)
        figures["fig-routing"] = routing_figure(records.train, layers, config)
    return figures


# ---- the page -------------------------------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1280px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
pre { background: #f6f8fa; padding: 12px; overflow-x: auto; font-size: 12px; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #ddd; padding: 4px 8px; }
.alert { color: #b00020; font-weight: 600; } .note { color: #555; font-size: 13px; }
"""


def load_run(run_dir: Path) -> tuple[RunRecords, Any, str, str | None]:
    """(records, the validated config or None, config.yaml's text, why the config could not be read or None)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReportError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory: pass the run directory (moe-train's hydra.run.dir)")
    for name in (METRICS_FILE, CONFIG_FILE):
        if not (run_dir / name).is_file():
            raise ReportError(f"{run_dir} has no {name} yet: pass a moe-train run directory (its hydra.run.dir)")
    records = read_records(run_dir / METRICS_FILE)
    if not records.train:
        raise ReportError(f"{run_dir / METRICS_FILE} holds no training record yet: wait for the first logged step")
    config_text = (run_dir / CONFIG_FILE).read_text()
    from moe_platform.config import load_run_config

    try:
        config, problem = load_run_config(run_dir / CONFIG_FILE), None
    except Exception as err:  # an unreadable config still leaves the curves; the page says why the ledger is missing
        config, problem = None, f"{type(err).__name__}: {err}"
    return records, config, config_text, problem


def render(run_dir: Path) -> str:
    """The whole report as one HTML string (plotly's JS inlined once, in the first figure)."""
    records, config, config_text, problem = load_run(run_dir)
    floor = entropy_floor(config)
    figures = build_figures(records, config, floor)
    divs = {
        name: fig.to_html(full_html=False, include_plotlyjs=n == 0, div_id=name, config={"displaylogo": False})
        for n, (name, fig) in enumerate(figures.items())
    }
    ledger = ledger_text(config, world_size(records.train)) if config is not None else f"unavailable: {problem}"
    parts = [
        f"<h1>moe-report: {html.escape(Path(run_dir).resolve().name)}</h1>",
        _summary(records, config, floor, Path(run_dir).resolve()),
        "<h2>Alerts</h2>",
        _alerts_table(records.alerts),
        "<h2>Training curves</h2>",
        *(divs[name] for name in ("fig-loss", "fig-throughput", "fig-optimizer")),
    ]
    if "fig-data-mix" in divs:
        parts += ["<h2>Data mixture</h2>", divs["fig-data-mix"]]
    if "fig-expert-load" in divs:
        parts += ["<h2>Experts</h2>", divs["fig-expert-load"], divs["fig-routing"]]
    else:
        parts.append("<p class='note'>No expert statistics in metrics.jsonl (a dense model).</p>")
    parts += [
        "<h2>Ledger</h2>",
        f"<pre id='ledger'>{html.escape(ledger)}</pre>",
        "<h2>Resolved config (config.yaml)</h2>",
        f"<pre id='config'>{html.escape(config_text)}</pre>",
    ]
    body = "\n".join(parts)
    title = html.escape(f"moe-report {Path(run_dir).resolve().name}")
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{title}</title><style>{CSS}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


def _summary(records: RunRecords, config, floor: float | None, run_dir: Path) -> str:
    last = records.train[-1]
    max_steps = config.trainer.max_steps if config is not None else None
    rows = [
        ("run directory", str(run_dir)),
        (
            "logged steps",
            f"{records.train[0]['step']}–{last['step']}"
            + (f" of trainer.max_steps={max_steps}" if max_steps else "")
            + (" (still running, stopped early or preempted)" if max_steps and last["step"] < max_steps else ""),
        ),
        ("last train loss", f"{last['loss']:.4f}"),
    ]
    if records.evals:
        eval_loss = records.evals[-1]["eval/loss"]
        rows.append(("last eval loss", f"{eval_loss:.4f} at step {records.evals[-1]['step']}"))
    if floor is not None:
        line = f"{floor:.4f} nats/token"
        if records.evals:
            line += f" (last eval loss is {100 * (records.evals[-1]['eval/loss'] / floor - 1):+.1f}% above)"
        rows.append(("entropy floor", line))
    else:
        rows.append(("entropy floor", "unknown (not synthetic data, or config.yaml unreadable)"))
    rows.append(("alerts", str(len(records.alerts))))
    notes = []
    if records.repeated:
        notes.append(
            f"{records.repeated} record(s) of steps logged again after a resume: the last one per step is shown"
        )
    if records.unreadable:
        notes.append(
            f"{records.unreadable} line(s) of metrics.jsonl are not complete JSON (still being written, or "
            "cut short) and were skipped"
        )
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table id='summary'>{table}</table>" + "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes)


def _alerts_table(alerts: list[dict[str, Any]]) -> str:
    if not alerts:
        return "<p id='alerts'>No alert records.</p>"
    columns = ("step", "alert", "layer", "expert", "metric", "value", "threshold", "consecutive_logs", "message")
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(alert.get(c)))}</td>" for c in columns) + "</tr>" for alert in alerts
    )
    return f"<table id='alerts' class='alert'><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="moe-report", description="One self-contained HTML report of a moe-train run directory."
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (moe-train's hydra.run.dir)")
    parser.add_argument("-o", "--output", type=Path, help="where to write the HTML (default: RUN_DIR/report.html)")
    args = parser.parse_args(argv)
    try:
        page = render(args.run_dir)
    except ReportError as err:
        print(f"moe-report: {err}", file=sys.stderr)
        sys.exit(2)
    output = args.output or args.run_dir / "report.html"
    output.write_text(page)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
