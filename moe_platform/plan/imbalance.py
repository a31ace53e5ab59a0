"""How uneven expert load is planned for: the busiest expert-parallel rank's received assignments over the mean.

Under EP a rank holds E/EP consecutive experts of each MoE layer, so its load is the sum of theirs, and the rank
that receives the most sets the all-to-all's and the experts' pace (and sizes its dispatch buffers). The factor,
by EP size:
  * from the config: a capacity factor C caps every expert at C × its mean share (more is dropped), so no rank
    gets more than C × the mean: the factor is C. Dropless routing has no cap; the planner then assumes balance
    (1.0) and says so, and a measured run (below) is the better guide;
  * measured (`moe-plan --from-run RUN_DIR`): the run's logged tokens_per_expert counts per MoE layer, grouped
    into the EP blocks the layout would hold: max over layers of (max block / mean block), the median over the
    run's second half of training records (routing settles after the first steps; a median, not the worst record:
    one noisy window should not size the whole plan). 1 + MaxVio at EP = E.
  * given (`--imbalance X`): X for every EP > 1.
EP = 1 keeps every expert on every rank: whatever the imbalance, each rank's work is the mean, so the factor is 1.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from moe.config import ModelConfig
from moe_platform.monitor.dashboards import tokens_per_expert_by_layer


@dataclass(frozen=True)
class Imbalance:
    """The busiest EP rank's load over the mean, by EP size (`factor`), and where the figure comes from."""

    source: str
    constant: float = 1.0
    # Measured: per training record, per MoE layer, tokens per expert (the run's counts).
    counts: tuple[tuple[tuple[float, ...], ...], ...] = ()

    def __post_init__(self) -> None:
        if self.constant < 1:
            raise ValueError(f"--imbalance {self.constant} is below 1: it is the busiest EP rank's load over the mean")

    def factor(self, ep_size: int) -> float:
        if ep_size == 1:
            return 1.0
        if not self.counts:
            return self.constant
        per_record = []
        for layers in self.counts:
            worst = 1.0
            for load_E in layers:
                if len(load_E) % ep_size:
                    raise ValueError(
                        f"the measured run has {len(load_E)} experts per layer, which EP={ep_size} does not divide: "
                        "plan the model the run trained, or give --imbalance"
                    )
                block = len(load_E) // ep_size
                loads = [sum(load_E[i : i + block]) for i in range(0, len(load_E), block)]
                mean = sum(loads) / ep_size
                worst = max(worst, max(loads) / mean if mean > 0 else 1.0)
            per_record.append(worst)
        return statistics.median(per_record)


def from_config(model: ModelConfig) -> Imbalance:
    if model.moe is None:
        return Imbalance("dense model: no experts")
    if model.moe.capacity_factor is None:
        return Imbalance("dropless routing, assumed balanced (give --from-run RUN_DIR or --imbalance X)")
    return Imbalance(f"capacity factor {model.moe.capacity_factor}", constant=model.moe.capacity_factor)


def from_run(run_dir: str | Path) -> Imbalance:
    """The counts a run logged, from its metrics.jsonl (the second half of its training records)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"--from-run {run_dir}: {path} does not exist: give a run directory moe-train wrote")
    from moe_platform.monitor.report import read_records  # here: the report's plotly is ~0.3 s of every start

    train = read_records(path).train
    with_counts = [record for record in train if tokens_per_expert_by_layer(record)]
    if not with_counts:
        raise ValueError(
            f"--from-run {run_dir}: its metrics.jsonl has no tokens_per_expert counts (a dense run, or one logged "
            "without expert load): give --imbalance X instead"
        )
    later = with_counts[len(with_counts) // 2 :]
    counts = tuple(
        tuple(tuple(float(c) for c in load) for _, load in sorted(tokens_per_expert_by_layer(record).items()))
        for record in later
    )
    return Imbalance(f"measured in {run_dir} ({len(later)} records)", counts=counts)
