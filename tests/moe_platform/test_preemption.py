"""Preemption without Slurm: a signal (or the batch shell's request file) stops every rank after the same step with a
complete checkpoint and exit 0; resume=auto continues with no step lost or repeated, bit-exact on CPU in fp32."""

import os
import signal
from pathlib import Path

import pytest

from moe_platform.testing import (
    Job,
    assert_resumes_exactly,
    finish,
    metric_steps,
    start_moe_train,
    wait_for_logged_step,
    worker_pids,
)
from moe_platform.train.preemption import REQUEST_FILE

pytestmark = pytest.mark.slow
STEPS = 20
LONG = [f"trainer.max_steps={STEPS}", "trainer.save_final=true"]
SINGLE, ZERO2 = Job(*LONG), Job(*LONG, "distributed=zero2", nproc=2)  # each run, and the job that resumes it


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, Path]:
    runs = {}
    for name, job in (("single", SINGLE), ("zero2", ZERO2)):
        runs[name] = tmp_path_factory.mktemp(name)
        job.run(runs[name])
    return runs


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])  # SIGUSR1: the ZeRO test below sends it
def test_a_signal_stops_one_process_after_a_checkpoint_and_resume_is_exact(tmp_path, uninterrupted, signum) -> None:
    """SIGTERM (preempted, cancelled) and SIGINT (Ctrl-C on a local run) alike: a checkpoint at the next step."""
    run_dir = tmp_path / "run"
    process = start_moe_train(run_dir, *LONG)
    wait_for_logged_step(run_dir, 3, process)
    process.send_signal(signum)
    assert finish(process) == 0, (tmp_path / "run.log").read_text()[-3000:]
    log = (tmp_path / "run.log").read_text()
    assert f"{signum.name}: stopping after this step with a checkpoint (send {signum.name} again" in log
    assert f"({signum.name}); checkpoint" in log and "continue with resume=auto" in log
    assert_resumes_exactly(run_dir, uninterrupted["single"], SINGLE, weights=True)


def test_a_signal_to_one_zero_rank_stops_both_at_the_same_step(tmp_path, uninterrupted) -> None:
    """Only rank 1 is told; the all-reduced flag stops rank 0 too, and both write their ZeRO-2 shards."""
    run_dir = tmp_path / "run"
    launcher = start_moe_train(run_dir, *ZERO2.overrides, nproc=ZERO2.nproc)
    wait_for_logged_step(run_dir, 3, launcher)
    os.kill(worker_pids(launcher)[1], signal.SIGUSR1)
    assert finish(launcher) == 0, (tmp_path / "run.log").read_text()[-3000:]
    (stopped_at,) = assert_resumes_exactly(run_dir, uninterrupted["zero2"], ZERO2, weights=True)
    shards = run_dir / "checkpoints" / f"step_{stopped_at:08d}" / "pytorch_model"
    for rank in (0, 1):  # each rank saved its own shard of the optimizer state at the same step
        assert (shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()


def test_the_request_file_of_the_batch_shell_stops_every_rank(tmp_path, uninterrupted) -> None:
    """slurm/train.sbatch's trap writes RUN_DIR/.preempt when `--signal=B:USR1` reaches the batch shell."""
    run_dir = tmp_path / "run"
    launcher = start_moe_train(run_dir, *ZERO2.overrides, nproc=ZERO2.nproc)
    wait_for_logged_step(run_dir, 3, launcher)
    (run_dir / REQUEST_FILE).touch()
    assert finish(launcher) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert f"({REQUEST_FILE} request)" in (tmp_path / "run.log").read_text()
    assert_resumes_exactly(run_dir, uninterrupted["zero2"], ZERO2, weights=True)


def test_past_the_last_allowed_requeue_the_job_stops_with_a_message(tmp_path) -> None:
    run_dir = tmp_path / "run"
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "2"}
    process = start_moe_train(run_dir, *LONG, "preemption.max_requeues=2", env=slurm)
    wait_for_logged_step(run_dir, 2, process)
    process.send_signal(signal.SIGUSR1)
    assert finish(process) == 3
    log = (tmp_path / "run.log").read_text()
    assert "job 4242 was already requeued 2 times (preemption.max_requeues=2): it is not requeued again" in log
    assert "Traceback" not in log
    stopped_at = max(metric_steps(run_dir))
    assert (run_dir / "checkpoints" / f"step_{stopped_at:08d}").is_dir(), "the checkpoint is written all the same"
