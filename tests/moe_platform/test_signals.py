"""Signals and failed ranks on real runs: a second Ctrl-C stops at once and leaves nothing that looks complete (the
first one checkpoints and resumes exactly: test_preemption.py); a rank that hangs or dies makes the other one exit
within distributed.timeout_s, naming it (train/preemption.py, train/liveness.py)."""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import psutil
import pytest

from moe_platform.checkpoint.catalog import (
    CHECKPOINT_DIRNAME,
    LATEST,
    REMOVING_PREFIX,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
)
from moe_platform.testing import (
    finish,
    metric_steps,
    start_moe_train,
    subprocess_env,
    wait_for_logged_step,
    worker_pids,
)
from moe_platform.train.liveness import EXIT_CODE, REPORT_GRACE_S

pytestmark = pytest.mark.slow
STEPS = 20
LONG = [f"trainer.max_steps={STEPS}", "trainer.save_final=true"]
HUNDREDS_OF_STEPS = ["trainer.max_steps=1000"]  # a run that is still training when the test acts on it
TIMEOUT_S = 10  # distributed.timeout_s of the two-rank runs: long enough for a start-up on a busy 2-core machine


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `condition()` held; fails after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.005)
    return time.monotonic() - start


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_second_ctrl_c_stops_at_once_and_leaves_no_checkpoint_that_looks_complete(tmp_path) -> None:
    """With a save every step the second signal lands inside a save about as often as not."""
    run_dir = tmp_path / "run"
    process = start_moe_train(run_dir, *LONG, "trainer.save_every=1")
    wait_for_logged_step(run_dir, 3, process)
    process.send_signal(signal.SIGINT)
    log = tmp_path / "run.log"
    wait_until(lambda: "SIGINT: stopping" in log.read_text() or process.poll() is not None, 30, "the first SIGINT")
    process.send_signal(signal.SIGINT)
    start = time.monotonic()
    assert finish(process, timeout=10) == -signal.SIGINT, log.read_text()[-3000:]
    assert time.monotonic() - start < 2.0
    root = run_dir / CHECKPOINT_DIRNAME
    complete = complete_checkpoints(root)
    assert all(is_complete(path) for path in complete), "a directory named step_… is always complete"
    leftovers = {p.name for p in root.iterdir()} - {p.name for p in complete} - {LATEST}
    debris = (".tmp_step_", f"{REMOVING_PREFIX}step_", f".{LATEST}.")  # a save, a deletion, a pointer cut short
    assert all(name.startswith(debris) for name in leftovers), leftovers
    latest = latest_checkpoint(run_dir)
    assert latest is not None and latest in complete and int(latest.name[5:]) <= max(metric_steps(run_dir))


def test_every_process_group_waits_the_configured_timeout() -> None:
    """The default group and those made later (DeepSpeed's data-parallel group, expert_parallel's): torch gives a
    new_group() its own default (30 min on gloo), not the default group's timeout (parallel/accelerator.py)."""
    script = """
import os, torch, torch.distributed as dist
from moe_platform.launch.compose import train_config
from moe_platform.config import validate_launch
from moe_platform.parallel.accelerator import build_accelerator
from moe_platform.testing import FAST
config = train_config([*FAST, "distributed=zero2", "distributed.timeout_s=17"])
build_accelerator(config, validate_launch(config, 1, has_gpu=False), 1)  # a lone DeepSpeed rank has a group too
groups = [dist.distributed_c10d._get_default_group(), dist.new_group([0])]
print([g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups], flush=True)
os._exit(0)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[17.0, 17.0]"


def test_a_hung_rank_is_named_by_the_other_within_the_timeout(tmp_path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_moe_train(
        run_dir,
        *HUNDREDS_OF_STEPS,
        "distributed=ddp",
        f"distributed.timeout_s={TIMEOUT_S}",
        "trainer.save_every=2",
        nproc=2,
    )
    log = tmp_path / "run.log"
    workers: dict[int, int] = {}
    try:
        wait_for_logged_step(run_dir, 3, launcher)
        workers = worker_pids(launcher)
        os.kill(workers[1], signal.SIGSTOP)
        # Rank 0's collective times out, it waits REPORT_GRACE_S for rank 1's report of the failure, and leaves.
        took = wait_until(lambda: gone(workers[0]), TIMEOUT_S + REPORT_GRACE_S + 15, "rank 0 exits")
        assert took >= TIMEOUT_S - 1, f"rank 0 left after {took:.1f} s, before its collective could time out"
        text = log.read_text()
        assert re.search(
            rf"distributed error: rank 1 \(pid {workers[1]} on .+\) stopped responding after step \d+ "
            rf"\(this rank 0 waited distributed.timeout_s={TIMEOUT_S} s in a collective\); "
            rf"the last complete checkpoint is {re.escape(str(latest_checkpoint(run_dir)))}; resume with resume=auto\n",
            text,
        ), text[-3000:]
        assert "Traceback" not in text.split("distributed error:")[0][-2000:], "rank 0 printed one line, no trace"
        # torchrun SIGTERMs the stopped rank, then waits 30 s (fixed for a failed worker) before SIGKILL: do it now.
        os.kill(workers[1], signal.SIGKILL)
        assert finish(launcher, timeout=30) != 0
        assert f"exitcode  : {EXIT_CODE} (pid: {workers[0]})" in log.read_text()
    finally:
        for pid in workers.values():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    wait_until(lambda: all(gone(pid) for pid in workers.values()), 10, "every worker is gone")


def test_a_killed_rank_ends_the_run_and_is_named(tmp_path) -> None:
    """Under ZeRO-2: DeepSpeed's collectives fail on a dead peer as DDP's do."""
    run_dir = tmp_path / "run"
    launcher = start_moe_train(
        run_dir, *HUNDREDS_OF_STEPS, "distributed=zero2", f"distributed.timeout_s={TIMEOUT_S}", nproc=2
    )
    wait_for_logged_step(run_dir, 3, launcher)
    workers = worker_pids(launcher)
    os.kill(workers[1], signal.SIGKILL)
    start = time.monotonic()
    assert finish(launcher, timeout=60) != 0
    assert time.monotonic() - start < REPORT_GRACE_S + 10  # the dead peer's sockets close: no timeout to wait out
    text = (tmp_path / "run.log").read_text()
    assert re.search(rf"distributed error: rank 1 \(pid {workers[1]} on .+\) stopped responding after step", text)
    assert re.search(rf"rank +: 1 \(local_rank: 1\)\n +exitcode +: -9 \(pid: {workers[1]}\)", text)  # torchrun's
    assert all(gone(pid) for pid in workers.values())
