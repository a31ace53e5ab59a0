"""Chaos: a 2-rank DDP run on CPU is SIGKILLed again and again, at points drawn at random (inside the forward, the
backward, between steps, inside a checkpoint write, between a checkpoint's rename and the `latest` pointer, or at a
random moment from outside), and resumed with resume=auto after each kill. It must end exactly where an
uninterrupted run ends: every step once in metrics.jsonl, each loss and the final weights bit-identical (fp32).

A 2-rank FSDP run gets the one kill that is its own (the checkpointer around its save is the same): inside DCP's
save, after a rank wrote its shards and before rank 0 writes the index (checkpoint/sharded.py). A 2-stage pipeline
gets a kill at a point drawn at random and one inside DCP's save of its stages."""

import os
import random
import signal
import time
from pathlib import Path

import pytest

from moe_platform.checkpoint.catalog import latest_checkpoint, step_dirname, step_of
from moe_platform.testing import (
    assert_resumes_exactly,
    finish,
    moe_train,
    rank_exit_codes,
    start_moe_train,
    wait_for_logged_step,
    worker_pids,
)

pytestmark = pytest.mark.slow
# The DDP chain kills once at every kind of point (from outside, the 3 in a save, the 3 in a step); three more kills
# drawn at random would cost a 2-rank start each (~12 s under CI's load) and add no kind of point the seven lack.
STEPS, SAVE_EVERY, KILLS = 12, 2, 7
RUN = [
    f"trainer.max_steps={STEPS}",
    f"trainer.save_every={SAVE_EVERY}",
    "trainer.keep_last=2",
    "trainer.save_final=true",
    "resume=auto",
]
# Where faults.py can kill a rank; the checkpoint's rename and pointer happen on rank 0 only.
IN_STEP = ("forward", "backward", "step_end")
IN_SAVE = ("checkpoint_write", "checkpoint_rename", "checkpoint_pointer")
IN_DCP_SAVE = "checkpoint_shards"
OUTSIDE = "sigkill from outside"
# Per layout: how many kills, the points the first ones must cover (None: every kind of point once; a None entry: drawn
# at random), and the run's overrides; the rest are drawn from IN_STEP and IN_SAVE.
CHAOS = {
    "ddp": (KILLS, None, ["distributed=ddp"]),
    "fsdp": (1, [IN_DCP_SAVE], ["distributed=fsdp"]),
    # two stages, one rank each: a kill anywhere in a step (drawn), then one inside DCP's save of the stages
    "pipeline": (2, [None, IN_DCP_SAVE], ["distributed=ddp", "distributed.pipeline_parallel_size=2"]),
}


def resumable_step(run_dir: Path) -> int:
    checkpoint = latest_checkpoint(run_dir)
    return step_of(checkpoint) if checkpoint else 0


def draw_kill(rng: random.Random, after: int, must: str | None) -> tuple[str, int, int]:
    """(point, step, rank) of the next kill: a step this launch will reach (after the checkpoint it resumes from);
    a checkpoint point only at a step that saves, before the last step's save so the chain can still end."""
    point = must or rng.choice([*IN_STEP, *IN_SAVE])
    saving_steps = [s for s in range(after + 1, STEPS) if s % SAVE_EVERY == 0]
    in_save = point in (*IN_SAVE, IN_DCP_SAVE)
    if in_save and not saving_steps:
        point, in_save = rng.choice(IN_STEP), False
    # one of the next two saves: a kill after the rename makes that checkpoint the resume point, so a late one
    # would leave no save ahead for the kills still to come
    step = rng.choice(saving_steps[:2]) if in_save else rng.randint(after + 1, STEPS)
    rank = 0 if point in ("checkpoint_rename", "checkpoint_pointer") else rng.randint(0, 1)
    return point, step, rank


def kill_from_outside(run_dir: Path, run: list[str], rng: random.Random, after: int, rank: int) -> int:
    """Start the run, wait until it has logged a step past its resume point, then SIGKILL one rank a random moment
    later. Returns the launcher's exit code."""
    process = start_moe_train(run_dir, *run, nproc=2)
    try:
        wait_for_logged_step(run_dir, after + 1, process, timeout=120)
        time.sleep(rng.uniform(0.0, 0.3))
        workers = worker_pids(process)
        if process.poll() is None and rank in workers:
            os.kill(workers[rank], signal.SIGKILL)
    finally:
        code = finish(process, timeout=120)
    return code


@pytest.mark.parametrize("layout", CHAOS)
def test_sigkill_at_random_points_then_resume_ends_bit_identical(tmp_path: Path, layout: str) -> None:
    kills, must, overrides = CHAOS[layout]
    run = [*overrides, *RUN]
    uninterrupted = tmp_path / "uninterrupted"
    moe_train(uninterrupted, *run, nproc=2)
    rng = random.Random(20261130)
    run_dir = tmp_path / "chaos"
    # The first kills cover every kind of point once: from outside first (a moment picked at random lands inside
    # the run only while most of it is still ahead), then inside a save (a saving step must be ahead); the rest are
    # drawn freely.
    must = must or [OUTSIDE, *rng.sample(IN_SAVE, k=len(IN_SAVE)), *rng.sample(IN_STEP, k=len(IN_STEP))]
    log = []
    for kill in range(kills):
        after = resumable_step(run_dir)
        point, step, rank = draw_kill(rng, after, must[kill] if kill < len(must) else None)
        if point == OUTSIDE:
            code = kill_from_outside(run_dir, run, rng, after, rank)
        else:
            fault = {"MOE_FAULTS": f"kill@{point}:step={step}:rank={rank}"}
            result = moe_train(run_dir, *run, nproc=2, env=fault, check=False, timeout=180)
            code = result.returncode
            killed = rank_exit_codes(result).get(rank) == -signal.SIGKILL
            assert code != 0 and killed, f"kill {kill} ({point} at step {step}) missed: {rank_exit_codes(result)}"
        log.append((point, step, rank, after, resumable_step(run_dir), code))
        if point == "checkpoint_pointer":
            # killed after the rename, before the pointer: the checkpoint is complete and the next job takes it
            assert resumable_step(run_dir) == step
            pointer = run_dir / "checkpoints" / "latest"
            assert not pointer.exists() or pointer.read_text() != step_dirname(step)
        if point in ("checkpoint_write", "checkpoint_rename", IN_DCP_SAVE):
            assert resumable_step(run_dir) < step, "a checkpoint cut short must not count as complete"
    resumable = resumable_step(run_dir)
    final = moe_train(run_dir, *run, nproc=2, timeout=180)
    if resumable:
        assert f"at step {resumable}" in final.stdout + final.stderr

    assert sum(1 for entry in log if entry[5] != 0) >= kills, log
    assert {point for point in must if point is not None} <= {entry[0] for entry in log}, log
    print("kills (point, step, rank, resumable before, after, exit):", *log, sep="\n  ")  # shown if what follows fails
    # Every step once, each loss as in the uninterrupted run, bit for bit, and the same final weights.
    assert_resumes_exactly(run_dir, uninterrupted, weights=True)


def test_fault_specs_parse_as_written_and_bad_ones_say_the_form(monkeypatch) -> None:
    """MOE_FAULTS: a stall sleeps for its seconds and returns; a spec that mixes up the options names the form."""
    from moe_platform import faults

    stall, kill = faults.parse("stall@step_end:step=2:seconds=1, kill@backward:step=3:rank=1")
    assert (stall.kind, stall.where, stall.step, stall.seconds) == ("stall", "step_end", 2, 1)
    assert (kill.kind, kill.step, kill.rank, kill.seconds) == ("kill", 3, 1, 0)
    monkeypatch.setattr(faults, "_faults", [stall])
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    faults.point("step_end", 1)  # another step: nothing
    assert slept == [] and stall.fired == 0
    faults.point("step_end", 2)
    assert slept == [1] and stall.fired == 1
    for spec in ("stall@step_end", "kill@forward:seconds=3", "stall@step_end:seconds=x", "hang@forward"):
        with pytest.raises(ValueError, match="MOE_FAULTS entry"):
            faults.parse(spec)
