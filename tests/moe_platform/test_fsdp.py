"""distributed=fsdp / hsdp (parallel/fsdp.py) through the real trainer: gloo ranks on 127.0.0.1 train exactly like one
process, alone, as HSDP and with the experts split (EP), for moe_tiny, deepseek_v3_like_tiny and a Mixtral-shaped tiny
model; and the trainer's features keep their properties under FSDP2 (activation checkpointing, torch.compile,
document masks, init.from_path and init.upcycle, the NaN guard, liveness, preemption). Bad FSDP configs:
test_bad_inputs.py and test_configs.py. Checkpoints and resume of FSDP runs (DCP): test_fsdp_checkpoint.py."""

import json
import os
import re
import signal
from pathlib import Path

import pytest

from moe_platform.checkpoint.catalog import latest_checkpoint, step_dirname
from moe_platform.checkpoint.checkpointer import TRAINER_STATE
from moe_platform.checkpoint.sharded import DCP_DIRNAME
from moe_platform.testing import (
    ROUTING,
    assert_trains_like,
    finish,
    first_batch_loss,
    metric_steps,
    moe_train,
    rank_exit_codes,
    start_moe_train,
    wait_for_logged_step,
    worker_pids,
)
from moe_platform.train.liveness import EXIT_CODE
from moe_platform.train.preemption import REQUEST_FILE

pytestmark = pytest.mark.slow


def ep(size: int) -> str:
    return f"distributed.expert_parallel_size={size}"


# DeepSeek-V3's design (MLA, a dense first layer, a shared expert, group-limited sigmoid routing), dropless: a null
# capacity factor routes every assignment.
DEEPSEEK = ["model=deepseek_v3_like_tiny", *ROUTING, "model.moe.capacity_factor=null"]
# Mixtral-8x7B's shape (8 SwiGLU experts, top-2, GQA 4:1, rope_theta 1e6) at moe_tiny's size, with ROUTING's drops;
# attention masked to each document (block-diagonal causal), an input the layout must not change either.
MIXTRAL = [
    "model=mixtral_like", "model.vocab_size=258", "model.d_model=64", "model.n_layers=2", "model.n_heads=8",
    "model.n_kv_heads=2", "model.d_ff=128", "model.moe.expert_d_ff=64", "model.max_seq_len=256", *ROUTING,
    "data.document_mask=true",
]  # fmt: skip
# 12 of ROUTING's 20 steps: a 4-rank FSDP2 step costs ~1 s of CPU on 2 cores, and 12 steps see the drops and the
# bias's updates act on the routing as 20 do.
STEPS_12 = "trainer.max_steps=12"
RUNS = {
    "moe_tiny": [*ROUTING, STEPS_12],
    "deepseek_v3_like_tiny": [*DEEPSEEK, STEPS_12],
    "mixtral_tiny": [*MIXTRAL, STEPS_12],
}
# ROUTING's runs on 4 ranks (global batch 16 = micro 2 × 4 ranks × accumulation 2, capacity drops, the aux-free
# bias), each layout once; the model families take the layouts moe_tiny does not, to keep the file's runs few.
LAYOUTS = {
    "moe_tiny-fsdp": ("moe_tiny", ["distributed=fsdp"]),
    "moe_tiny-fsdp_ep2": ("moe_tiny", ["distributed=fsdp", ep(2)]),  # experts: ep 2 × edp 2
    # replicate 2 × shard 2, experts too: their shards are counted once in the norm, not R times
    "moe_tiny-hsdp_2x2": ("moe_tiny", ["distributed=hsdp"]),
    # dense: replicate 2 × shard 2; experts: ep 2 × edp 2
    "deepseek_v3_like_tiny-hsdp_2x2_ep2-dropless": ("deepseek_v3_like_tiny", ["distributed=hsdp", ep(2)]),
    # experts: ep 4 × edp 1, each block on one rank
    "mixtral_tiny-fsdp_ep4-document_mask": ("mixtral_tiny", ["distributed=fsdp", ep(4)]),
}


def one_process_run(tmp_path_factory, name: str, *overrides: str, env: dict[str, str] | None = None) -> Path:
    run_dir = tmp_path_factory.mktemp(name)
    moe_train(run_dir, *overrides, env=env)
    return run_dir


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process run of RUNS[name], run once for the module."""
    runs: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in runs:
            runs[name] = one_process_run(tmp_path_factory, name, *RUNS[name])
        return runs[name]

    return run


@pytest.mark.parametrize("layout", LAYOUTS)
def test_four_ranks_shard_and_train_like_one_process(tmp_path: Path, one_process, layout: str) -> None:
    name, strategy = LAYOUTS[layout]
    result = moe_train(tmp_path, *RUNS[name], *strategy, nproc=4)
    assert "4 rank(s), MULTI_CPU, model wrapped as FSDPTransformer" in result.stdout
    assert_trains_like(tmp_path, one_process(name))


# ---- the trainer's features under FSDP2, two ranks -----------------------------------------------------------------

UPCYCLE = ["model=moe_tiny", "model.moe.expert_d_ff=256", "init.upcycle=true"]  # dropless: upcycling is exact
NAN_AT_3 = "nan@blocks.1.ffn.experts:step=3"


@pytest.fixture(scope="module")
def dense_source(tmp_path_factory) -> Path:
    return one_process_run(tmp_path_factory, "dense", "model=dense_tiny", "trainer.save_final=true")


def test_compiled_recomputed_blocks_train_from_a_checkpoint_like_one_eager_process(
    tmp_path_factory, tmp_path: Path, dense_source: Path
) -> None:
    """trainer.compile=true and activation_checkpointing=full change the speed, not the run: an FSDP run with both,
    started from a checkpoint (init.from_path), logs the one-process eager run's training from its first loss on.
    (No validation split: compiling the eval-mode graphs too would double the compile time.)"""
    run = ["model=dense_tiny", f"init.from_path={dense_source}", "data.val.fraction=0"]
    reference = one_process_run(tmp_path_factory, "from_path", *run)
    options = ["trainer.compile=true", "trainer.activation_checkpointing=full"]
    moe_train(tmp_path, *run, *options, "distributed=fsdp", nproc=2, timeout=600)
    train = assert_trains_like(tmp_path, reference)
    assert train[1]["loss"] == pytest.approx(first_batch_loss(dense_source, data_of=tmp_path), rel=1e-6)


def test_an_upcycled_run_skips_a_nan_step_and_names_a_killed_rank(
    tmp_path_factory, tmp_path: Path, dense_source: Path
) -> None:
    """FSDP with EP=2, each MoE layer recomputed in backward, upcycled from a dense checkpoint: step 1 is the dense
    model's loss; a NaN in rank 1's experts at step 3 is skipped on both ranks, named, and the update withheld (the
    following step is the one-process run's with the same skip); rank 1 killed in step 5 is named by rank 0."""
    run = [*UPCYCLE, f"init.from_path={dense_source}", "trainer.on_nan=skip", "model.moe.router.bias_update_rate=0.01"]
    reference = one_process_run(tmp_path_factory, "upcycled", *run, env={"MOE_FAULTS": NAN_AT_3})
    faults = f"{NAN_AT_3}:rank=1,kill@backward:step=5:rank=1"
    layout = ["distributed=fsdp", ep(2), "trainer.activation_checkpointing=moe"]
    result = moe_train(tmp_path, *run, *layout, nproc=2, env={"MOE_FAULTS": faults}, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]

    train = assert_trains_like(tmp_path, reference, steps=[1, 2, 4])
    assert train[1]["loss"] == pytest.approx(first_batch_loss(dense_source), rel=1e-6)
    assert [train[step]["nan/skipped_steps_total"] for step in range(1, 5)] == [0, 0, 1, 1]
    assert "step 3, skipped: it first appears in the output of blocks.1.ffn.experts (rank 1, micro-batch 0)" in output
    assert max(train) == 4
    assert re.search(r"distributed error: rank 1 \(pid \d+ on .+\) stopped responding after step 4 ", output), output
    # rank 1 killed, rank 0 left with the liveness exit code after naming it
    assert rank_exit_codes(result) == {0: EXIT_CODE, 1: -9}, output[-3000:]


def test_a_signal_to_one_rank_stops_both_after_the_same_step_with_a_checkpoint(tmp_path: Path) -> None:
    """Preemption under FSDP + EP: only rank 1 is told (SIGUSR1); the all-reduced flag stops rank 0 after the same
    step, every rank writes its DCP shards of that step, and the run exits 0 saying how to continue. (That such a
    checkpoint resumes exactly, at any layout: test_fsdp_checkpoint.py.)"""
    run_dir = tmp_path / "run"
    launcher = start_moe_train(run_dir, "trainer.max_steps=20", "distributed=fsdp", ep(2), nproc=2)
    wait_for_logged_step(run_dir, 2, launcher)
    os.kill(worker_pids(launcher)[1], signal.SIGUSR1)
    assert finish(launcher) == 0, (tmp_path / "run.log").read_text()[-3000:]
    stopped = max(metric_steps(run_dir))
    assert metric_steps(run_dir) == list(range(1, stopped + 1)) and stopped < 20
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint == run_dir / "checkpoints" / step_dirname(stopped)
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    assert (state["trainer"]["step"], state["data"]["samples_consumed"]) == (stopped, 8 * stopped)  # FAST's batch
    assert len(list((checkpoint / DCP_DIRNAME).glob("*.distcp"))) == 2, "each rank wrote its shards"
    assert not (run_dir / REQUEST_FILE).exists()
    log = (tmp_path / "run.log").read_text()
    assert f"stopped at step {stopped} (a signal to another rank)" in log and "continue with resume=auto" in log
