"""The planner's peak memory per rank (plan/memory.py): its properties, and within 10% of real runs' measured peaks.

The real runs are `moe-train` on 2 or 4 gloo ranks with logging.peak_memory=true: the trainer measures every rank's
second step and records each rank's measured peak beside the prediction for that rank (monitor/peak_memory.py's
`rank_peak`, which `rank_memory` is). Seven runs cover DDP, ZeRO-1, ZeRO-3, FSDP2, HSDP, EP under DDP and FSDP2, a
1F1B pipeline and activation checkpointing, most of them in combination, each start costing seconds on two cores.
bench/plan_memory.py runs the whole grid.
"""

import dataclasses
from pathlib import Path

import pytest

from moe_platform.launch.compose import train_config
from moe_platform.monitor.peak_memory import DEEPSPEED_REDUCE_BUCKET_ELEMENTS, predicted_peak_per_rank
from moe_platform.plan.memory import RankMemory, rank_memory
from moe_platform.testing import moe_train, read_metrics

SHAPE = ["model=moe_tiny", "data.seq_len=64", "data.global_batch_size=16", "trainer.micro_batch_size=2"]


def config_of(*overrides: str):
    return train_config([*SHAPE, *overrides])


def test_one_process_has_no_communication_buffers_and_ddp_one_bucket_byte_per_gradient_byte() -> None:
    single = rank_memory(config_of("distributed=single"), 1)
    assert single.buffers == single.gathered == single.offloaded == 0
    ddp = rank_memory(config_of("distributed=ddp"), 4)
    assert ddp.buffers == ddp.gradients  # without EP DDP reduces every gradient through its own buckets
    assert dataclasses.replace(ddp, buffers=0).total == pytest.approx(single.total)


def test_deepspeed_reduce_buffer_is_its_default_bucket_doubled_by_overlap_comm_on_gpus_only() -> None:
    for stage, copies_on_gpu in ((1, 2), (2, 2), (3, 1)):
        config = config_of(f"distributed=zero{stage}")
        on_cpu, on_gpu = rank_memory(config, 4, on_gpu=False), rank_memory(config, 4, on_gpu=True)
        assert on_cpu.buffers == DEEPSPEED_REDUCE_BUCKET_ELEMENTS * 4  # fp32: the weights' dtype
        assert on_gpu.buffers == copies_on_gpu * on_cpu.buffers
    bf16 = rank_memory(config_of("distributed=zero2", "trainer.precision=bf16"), 4, on_gpu=False)
    assert bf16.buffers == DEEPSPEED_REDUCE_BUCKET_ELEMENTS * 2


def test_imbalance_grows_only_the_expert_parallel_ranks_memory_and_monotonically() -> None:
    ep = config_of("distributed=fsdp", "distributed.expert_parallel_size=2")
    totals = [rank_memory(ep, 4, imbalance=f).total for f in (1.0, 1.5, 2.0, 3.0)]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    without_ep = config_of("distributed=fsdp")
    assert rank_memory(without_ep, 4, imbalance=3.0) == rank_memory(without_ep, 4)
    with pytest.raises(ValueError, match="at least 1"):
        rank_memory(ep, 4, imbalance=0.5)


def test_offload_moves_bytes_out_of_the_total_and_keeps_their_sum() -> None:
    for base, offload in (
        (["distributed=zero3"], ["distributed=zero3_offload"]),
        (["distributed=zero2"], ["distributed=zero2", "distributed.offload_optimizer=true"]),
        (["distributed=fsdp"], ["distributed=fsdp", "distributed.fsdp.cpu_offload=true"]),
    ):
        kept, moved = rank_memory(config_of(*base), 4), rank_memory(config_of(*offload), 4)
        assert kept.offloaded == 0 < moved.offloaded
        assert moved.total == pytest.approx(kept.total - moved.offloaded)
        assert moved.total + moved.offloaded == pytest.approx(kept.total)


def test_pipeline_ranks_split_the_model_and_the_worst_is_the_default() -> None:
    pp = config_of("distributed=ddp", "distributed.pipeline_parallel_size=2")
    ranks = [rank_memory(pp, 4, pipeline_rank=p) for p in range(2)]
    whole = rank_memory(config_of("distributed=single"), 1)
    assert sum(m.weights for m in ranks) == pytest.approx(whole.weights)  # the stages hold the model once
    assert rank_memory(pp, 4) == max(ranks, key=lambda m: m.total)
    # the trainer's per-rank figures are these: ranks 0, 1 run pipeline rank 0 (W/PP = 2 data-parallel ranks)
    expected = [ranks[r // 2].total for r in range(4)]
    assert predicted_peak_per_rank(pp, 4, on_gpu=True) == pytest.approx(expected)
    assert isinstance(ranks[0], RankMemory)


# name: (ranks, overrides); each run validates every one of its ranks.
RUNS = {
    "ddp_checkpointing_full": (2, ["distributed=ddp", "trainer.activation_checkpointing=full"]),
    "ddp_ep2": (4, ["distributed=ddp", "distributed.expert_parallel_size=2"]),
    "zero1": (2, ["distributed=zero1"]),
    "zero3": (2, ["distributed=zero3"]),
    "fsdp_ep2": (4, ["distributed=fsdp", "distributed.expert_parallel_size=2"]),
    "hsdp": (4, ["distributed=hsdp"]),
    "ddp_pp2_1f1b": (2, ["distributed=ddp", "distributed.pipeline_parallel_size=2"]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_predicted_peak_is_within_10_percent_of_every_ranks_measured_peak(tmp_path: Path, name: str) -> None:
    """Two steps (the second measured), 16 rows of 64 tokens per step in micro-batches of 2."""
    ranks, overrides = RUNS[name]
    moe_train(
        tmp_path, *SHAPE[1:], *overrides, "trainer.max_steps=2", "logging.peak_memory=true", nproc=ranks
    )  # fmt: skip
    record = read_metrics(tmp_path)[0][2]
    measured, predicted = record["memory/peak_bytes_per_rank"], record["plan/peak_bytes_per_rank"]
    assert len(measured) == len(predicted) == ranks
    # The worst rank, the one a layout's fit is decided by, within 10%. Every rank within 10% too, except under
    # FSDP2: on gloo its asynchronous all-gathers finish at varying times, so whether the prefetched block is live at
    # a rank's peak varies, and ranks of one run spread by up to ±9% around the one figure the model gives them
    # (nine runs of fsdp_ep2 and hsdp, 2026-12-03); each of its ranks is held within 15%.
    assert max(predicted) == pytest.approx(max(measured), rel=0.10), (name, measured, predicted)
    per_rank = 0.15 if "fsdp" in name or "hsdp" in name else 0.10
    for rank, (held, planned) in enumerate(zip(measured, predicted, strict=True)):
        assert planned == pytest.approx(held, rel=per_rank), (name, rank, measured, predicted)
