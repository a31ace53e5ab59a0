"""Metric records: expert-load statistics reduced across micro-batches and ranks, and the sinks.

Every logged step becomes one flat dict (`step`, `loss`, `lr`, `grad_norm`, `tokens_per_s`, FLOP/s figures from
`throughput.py`, `eval/loss`, `moe/layer_{i}/<metric>` per MoE layer, and `moe/all/<metric>_<summary>` across
layers), written by rank 0 to metrics.jsonl always, and to wandb and TensorBoard when enabled.

Across layers, each metric m of `dashboards.ACROSS_LAYER_METRICS` gets `moe/all/{m}_min`, `_p50`, `_p95`, `_max` and
`_worst_layer` (the layer id with the highest value, or the lowest for entropy; the lowest id on a tie). The percentiles
interpolate linearly between the sorted per-layer values (numpy's default `method="linear"`): with L layers,
p is read at position p/100 · (L − 1), so with one layer every summary is that layer's value.
"""

import json
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from moe.stats import MoEStats, summarize
from moe_platform.monitor import dashboards
from moe_platform.redact import redact, redacted_argv, secret_values

LAYER_METRICS = (
    "tokens_per_expert",
    "utilisation",
    "maxvio",
    "dead_experts",
    "drop_frac",
    "max_over_mean",
    "cv",
    "entropy",
    "aux_loss",
    "z_loss",
)
LOW_IS_WORSE = ("entropy",)  # a router whose distribution narrows towards one expert is the unhealthy one


def reduce_moe_stats(accelerator: Accelerator, stats_by_layer: dict[int, MoEStats]) -> dict[str, Any]:
    """Sum the raw counts of every layer over ranks in one all-reduce, then compute each layer's ratios from the
    summed counts (averaging per-rank ratios would weight a rank with few tokens like one with many).

    The trainer hands in counts already summed over the log window's micro-batches, so `dead_experts` counts the
    experts that received no token in the whole window, on any rank."""
    if not stats_by_layer:
        return {}
    layers = sorted(stats_by_layer)
    sizes = [stats_by_layer[i].to_vector().numel() for i in layers]
    vector = torch.cat([stats_by_layer[i].to_vector() for i in layers]).to(accelerator.device)
    if accelerator.num_processes > 1:
        vector = accelerator.reduce(vector, reduction="sum")
    summaries = {}
    for layer, piece in zip(layers, torch.split(vector.cpu(), sizes), strict=True):
        num_experts = stats_by_layer[layer].tokens_per_expert_before.numel()
        summaries[layer] = summarize(MoEStats.from_vector(piece, num_experts))
    return moe_record(summaries)


def moe_record(summaries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The record's MoE keys from each layer's `summarize()` output: per-layer metrics, then across-layer ones."""
    record: dict[str, Any] = {}
    for layer in sorted(summaries):
        for name in LAYER_METRICS:
            record[f"moe/layer_{layer}/{name}"] = summaries[layer][name]
    record.update(across_layers(summaries))
    return record


def across_layers(summaries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Each of `dashboards.ACROSS_LAYER_STATS` (min / p50 / p95 / max, and the worst layer's id) of each
    `dashboards.ACROSS_LAYER_METRICS` metric over the MoE layers."""
    if not summaries:
        return {}
    layers = sorted(summaries)
    record: dict[str, Any] = {}
    for name in dashboards.ACROSS_LAYER_METRICS:
        values = np.array([float(summaries[layer][name]) for layer in layers])
        worst = int(np.argmin(values) if name in LOW_IS_WORSE else np.argmax(values))  # first index on a tie
        p50, p95 = np.percentile(values, [50, 95], method="linear")
        stats = {"min": float(values.min()), "p50": float(p50), "p95": float(p95), "max": float(values.max())}
        stats["worst_layer"] = layers[worst]
        record.update({f"moe/all/{name}_{stat}": stats[stat] for stat in dashboards.ACROSS_LAYER_STATS})
    return record


WANDB_ID_FILE = "wandb_run_id"
METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"


def supersede_records_after(path: Path, step: int) -> int:
    """Keep in `path` the records of steps ≤ `step`; move the later ones (and a line cut short by a kill) to
    metrics.superseded.jsonl beside it, so every step is in metrics.jsonl once after a resume and nothing is lost.
    Returns how many lines moved."""
    if not path.is_file():
        return 0
    kept, superseded = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            later = record["step"] > step
        except (ValueError, KeyError, TypeError):
            later = True  # the last line of a killed job, half written
        (superseded if later else kept).append(line)
    if superseded:
        with open(path.with_name(SUPERSEDED_FILE), "a") as f:
            f.write("".join(line + "\n" for line in superseded))
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return len(superseded)


def wandb_run_id(run_dir: Path) -> str:
    """The run directory's wandb id: made once, kept in the run directory, reused by every job that resumes it."""
    path = run_dir / WANDB_ID_FILE
    if not path.is_file():
        path.write_text(secrets.token_hex(8))  # wandb accepts any letters and digits as a run id
    return path.read_text().strip()


class MetricSinks:
    """metrics.jsonl on rank 0 always; wandb / TensorBoard on rank 0 when enabled. Other ranks write nothing.

    The dashboards get the scalars `dashboards.scalar_metrics` keeps for `logging.moe_detail` (a bounded set in
    "brief"), and every `logging.visuals_every` logs that carry expert load, the expert × layer utilisation heatmap and
    histograms of tokens per expert. Alert records (an "alert" key) go to metrics.jsonl, plus a running count and the
    message as text in TensorBoard. The wandb config is the run's config with secrets replaced (redact.py).
    """

    def __init__(self, run_dir: Path, config_dict: dict, logging_config, is_main: bool, start_step: int = 0) -> None:
        """`start_step`: the step this job starts from (a resume's); records of later steps, written by a job that
        was killed after that checkpoint, are superseded (see `supersede_records_after`)."""
        self.is_main = is_main
        self.moe_detail = logging_config.moe_detail
        self.visuals_every = logging_config.visuals_every
        self.jsonl = None
        self.wandb_run = None
        self.tensorboard = None
        self.load_logs = 0  # logs carrying expert load so far in this job: pictures on every visuals_every-th
        self.alerts = 0
        if not is_main:
            return
        supersede_records_after(Path(run_dir) / METRICS_FILE, start_step)
        self.jsonl = open(Path(run_dir) / METRICS_FILE, "a", buffering=1)
        if logging_config.wandb:
            import wandb

            secrets = secret_values(config_dict)
            with redacted_argv(secrets):  # wandb keeps the command line in the run's metadata
                self.wandb_run = wandb.init(
                    project=logging_config.wandb_project,
                    entity=logging_config.wandb_entity,
                    group=logging_config.wandb_group,
                    tags=list(logging_config.wandb_tags) or None,
                    name=logging_config.wandb_name or Path(run_dir).name,
                    dir=str(run_dir),
                    config=redact(config_dict, secrets),
                    mode=logging_config.wandb_mode,
                    id=wandb_run_id(Path(run_dir)),
                    resume="allow",  # a resumed or requeued job continues the same wandb run
                )
        if logging_config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops the events a killed job wrote after the step this one resumes from
            self.tensorboard = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        step = record["step"]
        if "alert" in record:
            self._write_alert(record, step)
            return
        scalars = dashboards.scalar_metrics(record, self.moe_detail)
        if self.wandb_run is not None:  # with a step, wandb keeps the row open: eval and alerts of a step join it
            self.wandb_run.log(scalars, step=step)
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        loads = dashboards.tokens_per_expert_by_layer(record)
        if loads:
            if dashboards.should_draw(self.load_logs, self.visuals_every):
                self._write_visuals(record, loads, step)
            self.load_logs += 1

    def _write_visuals(self, record: dict[str, Any], loads: dict[int, list[int]], step: int) -> None:
        """The heatmap and the all-layer utilisation histogram; per-layer histograms only when detailed."""
        _, util_LE = dashboards.utilisation_LE(record)
        image_HW3 = dashboards.heatmap_image(util_LE)
        utilisation = util_LE[~np.isnan(util_LE)]
        per_layer = loads if self.moe_detail == "detailed" else {}
        if self.wandb_run is not None:
            import wandb

            media: dict[str, Any] = {
                dashboards.HEATMAP_KEY: wandb.Image(
                    image_HW3, caption="rows: MoE layers, columns: experts; red over-, blue under-loaded, black dead"
                ),
                dashboards.ALL_UTILISATION_KEY: wandb.Histogram(utilisation.tolist()),
            }
            for layer, tokens in per_layer.items():
                media[f"moe/layer_{layer}/tokens_per_expert"] = wandb.Histogram(
                    np_histogram=dashboards.expert_histogram(tokens)
                )
            self.wandb_run.log(media, step=step)
        if self.tensorboard is not None:
            self.tensorboard.add_image(dashboards.HEATMAP_KEY, image_HW3, step, dataformats="HWC")
            if utilisation.size:
                self.tensorboard.add_histogram(dashboards.ALL_UTILISATION_KEY, utilisation, step)
            for layer, tokens in per_layer.items():
                counts_E, edges = dashboards.expert_histogram(tokens)
                if counts_E.sum() == 0:
                    continue
                ids_E = edges[:-1] + 0.5
                used = np.flatnonzero(counts_E)
                self.tensorboard.add_histogram_raw(
                    f"moe/layer_{layer}/tokens_per_expert",
                    min=float(ids_E[used[0]]),
                    max=float(ids_E[used[-1]]),
                    num=float(counts_E.sum()),
                    sum=float((ids_E * counts_E).sum()),
                    sum_squares=float((ids_E**2 * counts_E).sum()),
                    bucket_limits=edges[1:].tolist(),
                    bucket_counts=counts_E.tolist(),
                    global_step=step,
                )

    def _write_alert(self, record: dict[str, Any], step: int) -> None:
        self.alerts += 1
        if self.wandb_run is not None:
            self.wandb_run.log({dashboards.ALERTS_KEY: self.alerts}, step=step)
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(dashboards.ALERTS_KEY, self.alerts, step)
            self.tensorboard.add_text(dashboards.ALERTS_KEY, record.get("message", record["alert"]), step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
