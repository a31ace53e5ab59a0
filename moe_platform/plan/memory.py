"""The planner's peak memory per rank: `rank_memory` of a config at W ranks, by part.

    total = weights + gradients + optimizer (+ master)      the ledger's training state per rank
          + activations                                     the ledger's, at the peak (PP: every micro-batch in flight)
          + gathered                                        FSDP2 / ZeRO-3 gathered units (ZeRO-3: + persistent params)
          + buffers                                         DDP buckets, DeepSpeed IPG buffers, flat reductions
    offloaded (not in total)                                what ZeRO-Offload / FSDP cpu_offload keeps in host memory

The formula is monitor/peak_memory.py's `rank_peak`, which the trainer uses to record its prediction for every rank
beside the measured peak (train may not import plan): one formula for the plan and the check of it.
tests/moe_platform/test_plan_memory.py holds it to within 10% of real runs' measured peaks, every rank;
bench/plan_memory.py runs the whole grid.
"""

from __future__ import annotations

from moe_platform.config import TrainConfig
from moe_platform.monitor.peak_memory import RankMemory, rank_peak

__all__ = ["RankMemory", "rank_memory"]


def rank_memory(
    config: TrainConfig, world_size: int, *, pipeline_rank: int | None = None, imbalance: float = 1.0,
    on_gpu: bool = True,
) -> RankMemory:  # fmt: skip
    """Peak bytes of one rank of `config` at `world_size` ranks, by part. `pipeline_rank` None: the pipeline rank
    whose total is largest (without PP there is one). `imbalance` >= 1: the most-loaded EP rank's received
    assignments over the mean (1 + MaxVio), which scales what grows with them on that rank. `on_gpu`: DeepSpeed's
    overlap_comm doubles its reduce buffer with GPUs only (parallel/accelerator.py)."""
    pipeline_ranks = range(config.distributed.pipeline_parallel_size) if pipeline_rank is None else [pipeline_rank]
    if config.distributed.pipeline_parallel_size == 1:
        pipeline_ranks = [pipeline_rank]
    peaks = (rank_peak(config, world_size, p, imbalance=imbalance, on_gpu=on_gpu) for p in pipeline_ranks)
    return max(peaks, key=lambda memory: memory.total)
