"""Metric records: expert-load statistics reduced across micro-batches and ranks, and the sinks.

Every logged step becomes one flat dict (`step`, `loss`, `lr`, `grad_norm`, `tokens_per_s`, FLOP/s figures from
`throughput.py`, `eval/loss`,
and `moe/layer_{i}/<metric>` per MoE layer), written by rank 0 to metrics.jsonl always, and to wandb and
TensorBoard when enabled.
"""

import json
import secrets
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from moe.stats import MoEStats, summarize

LAYER_METRICS = ("tokens_per_expert", "drop_frac", "max_over_mean", "cv", "entropy", "aux_loss", "z_loss")


def reduce_moe_stats(accelerator: Accelerator, stats_by_layer: dict[int, MoEStats]) -> dict[str, Any]:
    """Sum the raw counts of every layer over ranks in one all-reduce, then compute each layer's ratios from the
    summed counts (averaging per-rank ratios would weight a rank with few tokens like one with many)."""
    if not stats_by_layer:
        return {}
    layers = sorted(stats_by_layer)
    sizes = [stats_by_layer[i].to_vector().numel() for i in layers]
    vector = torch.cat([stats_by_layer[i].to_vector() for i in layers]).to(accelerator.device)
    if accelerator.num_processes > 1:
        vector = accelerator.reduce(vector, reduction="sum")
    record: dict[str, Any] = {}
    for layer, piece in zip(layers, torch.split(vector.cpu(), sizes), strict=True):
        num_experts = stats_by_layer[layer].tokens_per_expert_before.numel()
        summary = summarize(MoEStats.from_vector(piece, num_experts))
        for name in LAYER_METRICS:
            record[f"moe/layer_{layer}/{name}"] = summary[name]
    return record


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: Path) -> str:
    """The run directory's wandb id: made once, kept in the run directory, reused by every job that resumes it."""
    path = run_dir / WANDB_ID_FILE
    if not path.is_file():
        path.write_text(secrets.token_hex(8))  # wandb accepts any letters and digits as a run id
    return path.read_text().strip()


class MetricSinks:
    """metrics.jsonl on rank 0 always; wandb / TensorBoard on rank 0 when enabled. Other ranks write nothing."""

    def __init__(self, run_dir: Path, config_dict: dict, logging_config, is_main: bool) -> None:
        self.is_main = is_main
        self.jsonl = None
        self.wandb_run = None
        self.tensorboard = None
        if not is_main:
            return
        self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        if logging_config.wandb:
            import wandb

            self.wandb_run = wandb.init(
                project=logging_config.wandb_project,
                dir=str(run_dir),
                config=config_dict,
                mode=logging_config.wandb_mode,
                name=Path(run_dir).name,
                id=wandb_run_id(Path(run_dir)),
                resume="allow",  # a resumed or requeued job continues the same wandb run
            )
        if logging_config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        step = record["step"]
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            for key, value in record.items():
                if key.endswith("/tokens_per_expert"):
                    self.tensorboard.add_histogram(
                        key, torch.repeat_interleave(torch.arange(len(value)), torch.tensor(value)), step
                    )

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
