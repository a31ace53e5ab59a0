"""The dev Slurm cluster is a real 2-node cluster with what the platform's Slurm path relies on: multi-node srun
steps, signals to the batch shell, requeue (with a fast restart), and accounting that submitit can read."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body).lstrip())
    path.chmod(0o755)
    return path


def wait_for_file(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def test_two_node_job_runs_one_task_per_node(slurm, tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "two_nodes.sbatch",
        """
        srun bash -c 'echo "TASK $SLURM_NODEID $SLURMD_NODENAME $SLURM_PROCID"'
        for host in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
            echo "HOST $host $(getent hosts "$host" | awk '{print $1}')"
        done
        """,
    )
    job = slurm.submit(script, "--nodes=2", "--ntasks-per-node=1", "--time=2", "--output=out.txt")
    slurm.wait_for_state(job, "COMPLETED", timeout=60)

    lines = (tmp_path / "out.txt").read_text().splitlines()
    tasks = sorted(tuple(line.split()[1:]) for line in lines if line.startswith("TASK "))
    assert tasks == [("0", "node1", "0"), ("1", "node2", "1")], lines
    hosts = sorted(tuple(line.split()[1:]) for line in lines if line.startswith("HOST "))
    assert hosts == [("node1", "127.0.0.1"), ("node2", "127.0.0.1")], lines
    assert slurm.job_info(job)["nodes"] == ["node1", "node2"]


def test_usr1_reaches_the_batch_shell(slurm, tmp_path: Path) -> None:
    """What `--signal=B:USR1@N` does before the time limit, sent now: `scancel --signal=USR1 --batch`."""
    script = write_script(
        tmp_path / "signal.sbatch",
        """
        trap 'echo "USR1 $(date +%s.%N)" > usr1.marker; exit 0' USR1
        touch ready
        sleep 120 & wait $!  # `wait` returns at once for a trapped signal; a foreground sleep would delay the trap
        """,
    )
    job = slurm.submit(script, "--time=3", "--output=out.txt")
    slurm.wait_for_state(job, "RUNNING", timeout=30)
    assert wait_for_file(tmp_path / "ready", timeout=30), slurm.output_tail(job)

    sent = time.time()
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    slurm.wait_for_state(job, "COMPLETED", timeout=30)
    marker = tmp_path / "usr1.marker"
    assert marker.exists(), slurm.output_tail(job)
    print(f"USR1 reached the batch shell {float(marker.read_text().split()[1]) - sent:.2f} s after scancel")


@pytest.mark.slow
def test_signal_before_time_limit_reaches_the_batch_shell(slurm, tmp_path: Path) -> None:
    """`--signal=B:USR1@55` with a 1-minute limit: slurmctld sends it at its next time-limit check (every 30 s)."""
    script = write_script(
        tmp_path / "time_limit.sbatch",
        """
        trap 'echo "USR1 $(date +%s.%N)" > usr1.marker; exit 0' USR1
        sleep 120 & wait $!
        """,
    )
    start = time.time()
    job = slurm.submit(script, "--time=1", "--signal=B:USR1@55", "--output=out.txt")
    slurm.wait_for_state(job, "COMPLETED", timeout=60)
    marker = tmp_path / "usr1.marker"
    assert marker.exists(), slurm.output_tail(job)
    print(f"USR1 (time-limit warning) reached the batch shell {float(marker.read_text().split()[1]) - start:.1f} s in")


def test_requeued_job_runs_again_and_completes(slurm, tmp_path: Path) -> None:
    """The platform's preemption path: the job requeues itself; its second run (SLURM_RESTART_COUNT=1) finishes."""
    script = write_script(
        tmp_path / "requeue.sbatch",
        """
        echo "RUN ${SLURM_RESTART_COUNT:-0} $(date +%s.%N) $SLURMD_NODENAME"
        if [[ ${SLURM_RESTART_COUNT:-0} == 0 ]]; then
            scontrol requeue "$SLURM_JOB_ID"
            sleep 60 & wait $!  # the requeue ends this run
            exit 1
        fi
        echo done > requeue.marker
        """,
    )
    job = slurm.submit(script, "--requeue", "--open-mode=append", "--time=3", "--output=out.txt")
    slurm.wait_for_state(job, "COMPLETED", timeout=90)

    runs = [line.split() for line in (tmp_path / "out.txt").read_text().splitlines() if line.startswith("RUN ")]
    assert [run[1] for run in runs] == ["0", "1"], slurm.output_tail(job)
    assert (tmp_path / "requeue.marker").read_text().strip() == "done"
    info = slurm.job_info(job)
    assert info["restarts"] == 1, info
    assert info["exit_code"] == "0:0", info
    restart = float(runs[1][2]) - float(runs[0][2])
    print(f"requeued job started again {restart:.1f} s after its first run began")
    # ~11 s with AuthInfo=cred_expire=10 and sched_interval=1; Slurm's defaults make it ~2 min.
    assert restart < 45, f"restart took {restart:.1f} s: is AuthInfo=cred_expire=10 in slurm.conf?"


def test_accounting_reports_completed_and_cancelled(slurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit reads job states with sacct: a finished job must read COMPLETED, a cancelled one CANCELLED."""
    done = slurm.submit(write_script(tmp_path / "done.sbatch", "true\n"), "--time=1", "--output=done.txt")
    slow = slurm.submit(write_script(tmp_path / "slow.sbatch", "sleep 300\n"), "--time=10", "--output=slow.txt")
    slurm.wait_for_state(slow, "RUNNING", timeout=30)
    slurm.run("scancel", slow)

    for job, wanted in ((done, "COMPLETED"), (slow, "CANCELLED")):
        deadline = time.monotonic() + 30
        while not (state := slurm.sacct_state(job)).startswith(wanted):  # slurmdbd records it within a second or so
            assert time.monotonic() < deadline, f"sacct says {state!r} for job {job}, expected {wanted}"
            time.sleep(0.2)
        assert slurm.job_state(job) == wanted  # slurmctld's view agrees
    # Once a job has left slurmctld's memory (MinJobAge, 300 s), job_state answers from accounting alike.
    monkeypatch.setattr(slurm, "_scontrol_job", lambda job_id: None)
    assert (slurm.job_state(done), slurm.job_state(slow)) == ("COMPLETED", "CANCELLED")
    assert slurm.job_info(done)["source"] == "sacct"
