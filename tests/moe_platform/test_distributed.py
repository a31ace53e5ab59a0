"""Real multi-process runs: torchrun starts 2 gloo processes on 127.0.0.1, each a real Accelerate/DeepSpeed rank.

Each strategy must reproduce the single-process losses (same global batches, same initial weights; only the
order of floating-point reductions differs), and ZeRO must really shard: the optimizer state each rank holds is
measured from the optimizer itself.
"""

import subprocess
from pathlib import Path

import pytest

from moe_platform.testing import BIN, FAST, free_port, moe_train, read_metrics, subprocess_env

LAUNCH = Path(__file__).resolve().parents[2] / "slurm" / "launch.sh"

pytestmark = pytest.mark.slow
STEPS = range(1, 7)


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory) -> tuple[dict, dict]:
    run_dir = tmp_path_factory.mktemp("single")
    moe_train(run_dir)
    return read_metrics(run_dir)


@pytest.mark.parametrize(
    ("strategy", "engine", "wrapper"),
    [
        ("ddp", "MULTI_CPU", "DistributedDataParallel"),
        ("zero1", "DEEPSPEED", "DeepSpeedEngine"),
        ("zero2", "DEEPSPEED", "DeepSpeedEngine"),
        ("zero3", "DEEPSPEED", "DeepSpeedEngine"),
    ],
)
def test_two_ranks_reproduce_the_single_process_losses(
    tmp_path: Path, single_process_run, strategy: str, engine: str, wrapper: str
) -> None:
    result = moe_train(tmp_path, f"distributed={strategy}", nproc=2)
    assert f"2 rank(s), {engine}, model wrapped as {wrapper}" in result.stdout, "two ranks, the requested engine"
    train, _ = read_metrics(tmp_path)
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-5), step
        assert train[step]["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-4), step
    # Expert statistics are all-reduced: the two ranks' counts add up to the single process's.
    for layer in range(4):
        key = f"moe/layer_{layer}/tokens_per_expert"
        assert sum(train[6][key]) == sum(single[6][key])

    per_rank = train[1]["memory/optimizer_state_bytes_per_rank"]
    full = single[1]["memory/optimizer_state_bytes_per_rank"][0]
    assert len(per_rank) == 2
    if strategy == "ddp":
        assert per_rank == [full, full], "DDP replicates the optimizer state"
    else:
        # ZeRO ≥ 1 partitions m and v: each rank holds half (up to DeepSpeed's alignment padding).
        for held in per_rank:
            assert abs(held - full / 2) <= 0.01 * full, (held, full)
        assert per_rank[0] == pytest.approx(train[1]["ledger/optimizer_state_bytes_per_rank"], rel=0.01)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_deepspeed_runs_as_one_plain_process_without_a_launcher(tmp_path: Path, single_process_run, strategy) -> None:
    """`moe-train distributed=zero3` on one GPU (or CPU) with no torchrun: a one-rank process group is made."""
    result = moe_train(tmp_path, f"distributed={strategy}")
    assert "1 rank(s), DEEPSPEED, model wrapped as DeepSpeedEngine" in result.stdout
    assert "no launcher: DeepSpeed runs as a one-rank process group" in result.stdout + result.stderr
    train, _ = read_metrics(tmp_path)
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-5), step


def test_global_aux_scope_on_two_ranks_equals_one_process_on_their_pooled_micro_batches(tmp_path: Path) -> None:
    """aux_loss_scope=global pools each micro-batch's expert counts over the ranks: 2 DDP ranks with micro-batches
    of 4 train exactly like 1 process with micro-batches of 8 (the same 8 samples per micro-step)."""
    scope = ["model.moe.aux_loss_scope=global", "data.global_batch_size=8"]
    moe_train(tmp_path / "one", *scope, "trainer.micro_batch_size=8")
    moe_train(tmp_path / "two", *scope, "trainer.micro_batch_size=4", "distributed=ddp", nproc=2)
    one, _ = read_metrics(tmp_path / "one")
    two, _ = read_metrics(tmp_path / "two")
    for step in STEPS:
        for key in ("aux_loss", "loss", "grad_norm"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_two_node_launchers_on_loopback_form_one_job_without_slurm(tmp_path: Path, single_process_run) -> None:
    """slurm/launch.sh from MASTER_ADDR/MASTER_PORT/NNODES/NODE_RANK, one launcher per "node": node ranks 0 and 1
    join one process group of world size 2 and train like one process."""
    env = {
        **subprocess_env(),
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NNODES": "2", "NPROC_PER_NODE": "1"},
        "MOE_BIN": str(BIN),
    }
    args = [*FAST, "distributed=ddp", f"hydra.run.dir={tmp_path / 'run'}"]
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]  # files, not pipes: a full pipe would stall a rank
    launchers = []
    for rank, log in enumerate(logs):
        with log.open("w") as out:
            node_env = {**env, "NODE_RANK": str(rank)}
            launchers.append(subprocess.Popen([str(LAUNCH), *args], env=node_env, stdout=out, stderr=subprocess.STDOUT))
    for launcher, log in zip(launchers, logs, strict=True):
        assert launcher.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert "launch: node 0/2" in logs[0].read_text() and "launch: node 1/2" in logs[1].read_text()
    assert "2 rank(s), MULTI_CPU, model wrapped as DistributedDataParallel" in logs[0].read_text()
    train, _ = read_metrics(tmp_path / "run")
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-5), step


def test_accelerate_launch_starts_real_ranks_too(tmp_path: Path, single_process_run) -> None:
    result = moe_train(tmp_path, "distributed=zero2", nproc=2, launcher="accelerate")
    assert "2 rank(s), DEEPSPEED, model wrapped as DeepSpeedEngine" in result.stdout
    train, _ = read_metrics(tmp_path)
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-5), step


def test_bf16_zero2_trains_close_to_fp32(tmp_path: Path, single_process_run) -> None:
    moe_train(tmp_path, "distributed=zero2", "trainer.precision=bf16", nproc=2)
    train, _ = read_metrics(tmp_path)
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=2e-2), step


def test_run_dir_is_shared_and_only_rank_zero_writes(tmp_path: Path) -> None:
    moe_train(tmp_path, "distributed=ddp", "trainer.save_final=true", nproc=2)
    train, _ = read_metrics(tmp_path)
    assert sorted(train) == list(STEPS), "one record per step: rank 1 wrote nothing"
    assert (tmp_path / "checkpoints" / "step_00000006" / "random_states_1.pkl").is_file()


def test_resume_on_a_different_world_size_continues_the_same_samples(tmp_path: Path, single_process_run) -> None:
    """Three steps on 2 DDP ranks, then resume on 1 process: the losses continue as if nothing happened."""
    moe_train(tmp_path, "distributed=ddp", "trainer.stop_at=3", nproc=2)
    moe_train(tmp_path, "resume=auto")
    train, _ = read_metrics(tmp_path)
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-5), step


# A ZeRO-2 run stopped and resumed on the same world size: test_deepseek_v3_training.py (bit-identical losses, the
# router's balancing bias restored), on the richest model the platform trains.


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_shards_resume_on_another_world_size(tmp_path: Path, single_process_run, strategy: str) -> None:
    """Three steps on 2 ZeRO ranks, then 3 more on 1: the shards go through DeepSpeed's universal checkpoint and
    the losses continue those of the uninterrupted single-process run."""
    moe_train(tmp_path, f"distributed={strategy}", "trainer.stop_at=3", nproc=2)
    moe_train(tmp_path, f"distributed={strategy}", "resume=auto", nproc=1, launcher="torchrun")
    assert (tmp_path / "checkpoints" / "step_00000003" / "universal").is_dir()
    train, _ = read_metrics(tmp_path)
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-5), step


def test_zero_checkpoint_refuses_another_stage_and_zero3_another_world_size(tmp_path: Path) -> None:
    zero2, zero3 = tmp_path / "zero2", tmp_path / "zero3"
    moe_train(zero2, "distributed=zero2", "trainer.stop_at=3", nproc=2)
    with pytest.raises(AssertionError, match="holds ZeRO-2 state but this job runs ZeRO-1"):
        moe_train(zero2, "distributed=zero1", "resume=auto", nproc=2)
    moe_train(zero3, "distributed=zero3", "trainer.stop_at=3", nproc=2)
    with pytest.raises(AssertionError, match="ZeRO-3 resumes on the same world size only"):
        moe_train(zero3, "distributed=zero3", "resume=auto", nproc=1, launcher="torchrun")
