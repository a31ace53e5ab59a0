"""At scale, by simulation: one rank of a large layout built for real (meta device, torch's fake process group;
plan/simulate.py) holds exactly the weights, gradients and optimizer state the planner counts for it.

Each case is a layout the planner weighs for a published-scale model, checked on the first and the last rank, and
under PP a middle one (so the embedding's stage, a middle one and the head's):
  * DeepSeek-V3 (671 B) at PP 16 × EP 64 on 2048 GPUs, data-parallel in each stage by DDP and by FSDP2. DeepSeek's
    own run used ZeRO-1 there, which the platform refuses under PP (DeepSpeed's engine drives its own backward):
    DDP holds the most optimizer state of the three and FSDP2 the least, so the two bracket it;
  * Mixtral 8×7B at FSDP + EP 8 on 64 GPUs;
  * Qwen3-235B-A22B's shape at EP 16 on 128 GPUs, DDP and FSDP2.
The planner's figures are bytes (plan/memory.py `rank_memory`); a rank holds them in fp32 under DDP and FSDP2 in
either precision, so elements are bytes / 4, and the comparison is of integers: equal, not within a tolerance.
"""

from __future__ import annotations

import math

import pytest

from moe_platform.config import validate_launch
from moe_platform.launch.compose import train_config
from moe_platform.plan.memory import rank_memory
from moe_platform.plan.simulate import chunk_rows, simulate_rank

DEEPSEEK_V3 = ["model=deepseek_v3_like", "model.mtp.depth=0", "trainer.precision=bf16", "data.seq_len=4096",
               "data.global_batch_size=15360", "trainer.micro_batch_size=1", "distributed.expert_parallel_size=64",
               "distributed.pipeline_parallel_size=16", "distributed.pipeline.schedule=dualpipev"]  # fmt: skip
MIXTRAL = ["model=mixtral_like", "trainer.precision=bf16", "data.seq_len=4096", "data.global_batch_size=512",
           "trainer.micro_batch_size=1"]  # fmt: skip
QWEN3 = ["model=qwen3_235b_like", "trainer.precision=bf16", "data.seq_len=4096", "data.global_batch_size=1024",
         "trainer.micro_batch_size=1", "distributed.expert_parallel_size=16"]  # fmt: skip

# name: (world size, overrides)
LAYOUTS = {
    "deepseek_v3_pp16_ep64_ddp_2048": (2048, [*DEEPSEEK_V3, "distributed=ddp"]),
    "deepseek_v3_pp16_ep64_fsdp_2048": (2048, [*DEEPSEEK_V3, "distributed=fsdp"]),
    "mixtral_fsdp_ep8_64": (64, [*MIXTRAL, "distributed=fsdp", "distributed.expert_parallel_size=8"]),
    "qwen3_235b_ep16_ddp_128": (128, [*QWEN3, "distributed=ddp"]),
    "qwen3_235b_ep16_fsdp_128": (128, [*QWEN3, "distributed=fsdp"]),
}

FP32_BYTES = 4


def _ranks(world_size: int, pipeline: bool) -> tuple[int, ...]:
    """The first and last rank (their shards are torch.chunk's extremes); under PP a middle one too (a middle
    stage holds neither the embedding nor the head)."""
    return (0, world_size // 2 - 1, world_size - 1) if pipeline else (0, world_size - 1)


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_simulated_rank_holds_what_the_planner_counts(name: str) -> None:
    world_size, overrides = LAYOUTS[name]
    config = train_config(overrides)
    validate_launch(config, world_size, True)  # a layout the platform runs, as moe-plan would print it
    pipeline_ranks = set()
    for rank in _ranks(world_size, config.distributed.pipeline_parallel_size > 1):
        simulated = simulate_rank(config, world_size, rank)
        pipeline_ranks.add(simulated.pipeline_rank)
        pipeline_rank = simulated.pipeline_rank if config.distributed.pipeline_parallel_size > 1 else None
        planned = rank_memory(config, world_size, pipeline_rank=pipeline_rank)
        even = simulated.even
        assert (even.param_bytes, even.grad_bytes, even.optimizer_bytes) == (
            planned.weights, planned.gradients, planned.optimizer,
        ), f"rank {rank} (pipeline rank {simulated.pipeline_rank})"  # fmt: skip
        assert even.params * FP32_BYTES == even.param_bytes  # fp32 throughout: elements = bytes / 4
        assert even.grads == even.params and even.optimizer_state == 2 * even.params  # AdamW: m and v
        _check_splits(simulated, config.distributed.strategy)
    if config.distributed.pipeline_parallel_size > 1:
        assert pipeline_ranks == {0, config.distributed.pipeline_parallel_size // 2 - 1,
                                  config.distributed.pipeline_parallel_size - 1}  # fmt: skip


def _check_splits(simulated, strategy: str) -> None:
    """What the rank holds is the even split wherever dim 0 divides, and torch.chunk's piece of it elsewhere:
    the planner's even count is the shard group's mean, exact when every shard count divides every tensor's rows."""
    if strategy == "ddp":
        assert simulated.held == simulated.even  # nothing sharded: a DDP rank holds its tensors whole
    for split in simulated.tensors:
        row = math.prod(split.shape[1:])
        assert split.local_numel == chunk_rows(split.shape[0], split.shards, split.index) * row, split.name
        assert split.shards == 1 or strategy == "fsdp", split.name


def test_a_second_simulation_in_one_process_starts_clean() -> None:
    """DTensor's sharding caches hold meshes by value: without simulate's cleanup a second FSDP simulation in the
    same process failed to resolve the first one's process groups."""
    world_size, overrides = LAYOUTS["mixtral_fsdp_ep8_64"]
    config = train_config(overrides)
    first = simulate_rank(config, world_size, 1)
    again = simulate_rank(config, world_size, 1)
    assert first.even == again.even and first.held == again.held
