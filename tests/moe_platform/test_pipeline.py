"""distributed.pipeline_parallel_size through the real trainer (train/pipeline_step.py): gloo ranks on 127.0.0.1.

One chain of runs serves the layouts and the resume (a start of 8 ranks costs ~30 s on two cores):
  one_process  ROUTING's training (capacity drops, the aux-free bias) in one process, 12 steps: the reference
  the chain    8 ranks FSDP, PP=2 × EP=2 × edp 2, to step 3 → one process (PP=1) to 6 → PP=4 DDP on 4 ranks,
               each block recomputed in backward, to 9 → 8 ranks DDP, PP=2 × EP=2 × DP 2, to 12: every step
               logged once, within 1e-5 of one_process (loss, grad norm, aux loss; tokens per expert exactly), its
               data position, and the last checkpoint exported whole equals one_process's weights
A NaN is named where it began, in stage order, and the step skipped on every stage; a stage that hangs (its rank
stalled inside a step) ends every rank within distributed.timeout_s, named, exit 5; bf16 runs under DDP (autocast:
fp32 hidden states, bf16 logits between stages). The schedules and the mechanics against one process:
test_pipeline_schedules.py; a SIGKILL at random points: test_chaos.py."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from moe_platform.checkpoint.catalog import step_dirname
from moe_platform.checkpoint.checkpointer import TRAINER_STATE
from moe_platform.checkpoint.consolidate import export_fp32_state_dict
from moe_platform.testing import (
    EXACT,
    ROUTING,
    Job,
    assert_resumes_exactly,
    metric_steps,
    moe_train,
    rank_exit_codes,
    read_metrics,
)
from moe_platform.train.liveness import EXIT_CODE

pytestmark = pytest.mark.slow
STEPS = 12
RUN = [*ROUTING, f"trainer.max_steps={STEPS}", "trainer.save_every=3", "trainer.keep_last=2"]
PP2_EP2 = ["distributed.pipeline_parallel_size=2", "distributed.expert_parallel_size=2"]
CLOSE = {
    "loss": (1e-5, 1e-6),
    "grad_norm": (1e-5, 1e-6),
    "aux_loss": (1e-5, 1e-7),
    **{f"moe/layer_{layer}/tokens_per_expert": EXACT for layer in range(4)},
}


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / step_dirname(step)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one_process")
    Job(*RUN, "trainer.save_final=true").run(run_dir)
    return run_dir


def test_a_chain_of_pipeline_layouts_trains_and_resumes_like_one_process(tmp_path: Path, one_process: Path):
    run_dir = tmp_path / "run"
    first = Job(*RUN, "distributed=fsdp", *PP2_EP2, nproc=8, stop_at=3).run(run_dir)
    assert "data-parallel ranks 4; a pipeline of 2 ranks, 2 stages, 1f1b over 2 micro-batches" in first.stdout
    stops = assert_resumes_exactly(
        run_dir,
        one_process,
        Job(*RUN, stop_at=6),
        Job(
            *RUN,
            "distributed=ddp",
            "distributed.pipeline_parallel_size=4",
            "trainer.activation_checkpointing=full",
            nproc=4,
            stop_at=9,
        ),
        Job(*RUN, "distributed=ddp", *PP2_EP2, "trainer.save_final=true", nproc=8),
        match=CLOSE,
    )
    assert stops == [3, 6, 9]
    final = [json.loads((checkpoint(run, STEPS) / TRAINER_STATE).read_text()) for run in (run_dir, one_process)]
    assert final[0] == final[1], "the same step, tokens seen and data position: the same global sample order"
    # the stages' DCP shards exported whole: the one-process model's keys, shapes and weights
    ours, theirs = (export_fp32_state_dict(checkpoint(run, STEPS)) for run in (run_dir, one_process))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    evals = [{r["step"]: r["eval/loss"] for r in read_metrics(run)[1].values()} for run in (run_dir, one_process)]
    assert evals[1] and evals[1].keys() <= evals[0].keys()  # (each stop evaluated too)
    for step, loss in evals[1].items():
        assert evals[0][step] == pytest.approx(loss, rel=1e-5), step


def test_a_nan_is_named_in_stage_order_and_a_hung_stage_ends_every_rank(tmp_path: Path) -> None:
    """bf16 under DDP, two stages. A NaN out of the first stage's experts in step 2 turns every later module's output
    NaN on the second stage too: the step is skipped on both, and the first stage's module is named. Then rank 1
    (the last stage) stalls inside step 3 for far longer than distributed.timeout_s: rank 0, waiting on it, names it
    and exits 5."""
    # (the launcher SIGTERMs the stalled rank once rank 0 has left; with preemption on that only sets a flag, and the
    # agent would SIGKILL it 30 s later)
    faults = {"MOE_FAULTS": "nan@blocks.0.ffn.experts:step=2,stall@step_end:step=3:rank=1:seconds=120"}
    result = moe_train(
        tmp_path, "distributed=ddp", "distributed.pipeline_parallel_size=2", "trainer.precision=bf16",
        "trainer.max_steps=6", "distributed.timeout_s=6", "preemption.enabled=false",
        "trainer.on_nan=skip", nproc=2, env=faults, check=False, timeout=150,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert re.search(r"distributed error: rank 1 \(pid \d+ on .+\) stopped responding after step 2 ", output), output
    assert rank_exit_codes(result)[0] == EXIT_CODE, output[-3000:]
    assert "step 2, skipped: it first appears in the output of blocks.0.ffn.experts (rank 0, micro-batch 0)" in output
    train = read_metrics(tmp_path)[0]
    assert metric_steps(tmp_path) == [1, 2] and math.isfinite(train[1]["loss"])
    assert [train[step]["nan/skipped_steps_total"] for step in (1, 2)] == [0, 1]
