"""Checkpoints are complete and verified or not used: a manifest with every file's size and checksum, a truncated,
corrupted or tampered checkpoint passed over for the previous one (with one line saying why), no pickle of ours,
no foreign pickle opened, a full disk or a flaky one never costing the last good checkpoint."""

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from moe_platform.checkpoint import manifest
from moe_platform.checkpoint.catalog import REMOVING_PREFIX, is_complete, latest_checkpoint, step_dirname, step_dirs
from moe_platform.checkpoint.consolidate import export_fp32_state_dict, verify_checkpoint
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.testing import assert_resumes_exactly, metric_steps, moe_train

STEPS = 6
SAVING = [f"trainer.max_steps={STEPS}", "trainer.save_every=2", "trainer.keep_last=3", "trainer.save_final=true"]


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / step_dirname(step)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """An uninterrupted run saving at steps 2, 4 and 6: the reference every recovered run must equal."""
    run_dir = tmp_path_factory.mktemp("straight")
    moe_train(run_dir, *SAVING)
    return run_dir


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """The same run, stopped after its step-4 checkpoint (a job's time slice)."""
    run_dir = tmp_path_factory.mktemp("stopped")
    moe_train(run_dir, *SAVING, "trainer.stop_at=4")
    return run_dir


@pytest.fixture
def stopped_at_4(tmp_path: Path, stopped: Path):
    """A fresh copy of the stopped run for each test to damage (paths inside it are relative or recomputed)."""

    def copy(_: Path) -> Path:
        shutil.copytree(stopped, tmp_path / "run", symlinks=True)
        return tmp_path / "run"

    return copy


def test_the_manifest_lists_every_file_with_its_size_and_checksum(straight: Path) -> None:
    path = checkpoint(straight, 4)
    saved = json.loads((path / manifest.MANIFEST).read_text())
    assert saved["step"] == 4 and saved["world_size"] == 1 and saved["strategy"] == "single"
    assert saved["zero_stage"] == 0 and len(saved["config_sha256"]) == 64
    assert set(saved["files"]) == set(manifest.listed_files(path))
    for name, entry in saved["files"].items():
        assert entry == {"bytes": (path / name).stat().st_size, "sha256": manifest.sha256(path / name)}
    # The platform's own state is JSON; no pickle of ours (Accelerate's custom_checkpoint_*.pkl) is written.
    assert json.loads((path / "trainer_state.json").read_text())["trainer"]["step"] == 4
    assert not list(path.glob("custom_checkpoint_*"))


def test_resume_finds_the_newest_checkpoint_on_disk_not_by_the_pointer(
    tmp_path: Path, straight: Path, stopped_at_4
) -> None:
    """A job killed between the rename and the pointer update leaves `latest` one checkpoint behind."""
    run_dir = stopped_at_4(tmp_path)
    (run_dir / "checkpoints" / "latest").write_text(step_dirname(2))
    assert latest_checkpoint(run_dir) == checkpoint(run_dir, 4)
    moe_train(run_dir, *SAVING, "resume=auto")
    assert_resumes_exactly(run_dir, straight, weights=True)


@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])  # found by size before a process group; by checksum
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_previous_one(
    tmp_path: Path, straight: Path, stopped_at_4, damage: str
) -> None:
    run_dir = stopped_at_4(tmp_path)
    newest = checkpoint(run_dir, 4)
    target = newest / ("optimizer.bin" if damage == "flipped byte" else "model.safetensors")
    data = bytearray(target.read_bytes())
    if damage == "truncated":
        target.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(data)
    result = moe_train(run_dir, *SAVING, "resume=auto")
    output = result.stdout + result.stderr
    reported = [line for line in output.splitlines() if "passed over" in line or "is not used" in line]
    assert len(reported) == 1, output[-3000:]  # one line naming the checkpoint and the damaged file
    assert step_dirname(4) in reported[0] and target.name in reported[0]
    assert f"resumed from {checkpoint(run_dir, 2)} at step 2" in output
    assert_resumes_exactly(run_dir, straight, weights=True)
    # The damaged one is set aside, not deleted: nothing is lost.
    assert (run_dir / "checkpoints" / "abandoned" / step_dirname(4) / target.name).exists()


def test_resuming_a_damaged_checkpoint_by_name_is_refused_in_one_line(tmp_path: Path, stopped_at_4) -> None:
    run_dir = stopped_at_4(tmp_path)
    (checkpoint(run_dir, 4) / "model.safetensors").write_bytes(b"")
    result = moe_train(run_dir, *SAVING, f"resume={checkpoint(run_dir, 4)}", check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("checkpoint error:")]
    assert len(errors) == 1 and "model.safetensors has 0 bytes" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_run_dir_with_only_damaged_checkpoints_is_an_error_not_a_fresh_start(tmp_path: Path, stopped_at_4) -> None:
    run_dir = stopped_at_4(tmp_path)
    for step in (2, 4):
        (checkpoint(run_dir, step) / "trainer_state.json").write_text("{}")
    result = moe_train(run_dir, *SAVING, "resume=auto", check=False)
    assert result.returncode == 2 and "no usable checkpoint" in result.stderr and "Traceback" not in result.stderr
    assert metric_steps(run_dir) == [1, 2, 3, 4], "the failed start touched nothing"


class _RunsCode:
    """Unpickling this calls os.system: what a tampered checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def tamper(path: Path, marker: Path, fix_manifest: bool) -> None:
    """Replace `path` with a pickle that runs code when loaded; optionally rewrite the manifest to match, as an
    attacker with write access to the checkpoint could."""
    size = path.stat().st_size
    payload = pickle.dumps({"random_state": _RunsCode(marker)}, protocol=4)
    path.write_bytes(payload + b"\0" * (size - len(payload)))  # the same size: only the checksum can tell
    if fix_manifest:
        directory = path.parent
        saved = json.loads((directory / manifest.MANIFEST).read_text())
        saved["files"][path.name] = {"bytes": path.stat().st_size, "sha256": manifest.sha256(path)}
        (directory / manifest.MANIFEST).write_text(json.dumps(saved))


@pytest.mark.parametrize("fix_manifest", [False, True], ids=["checksum differs", "manifest rewritten too"])
def test_a_malicious_pickle_is_refused_before_anything_executes(
    tmp_path: Path, straight: Path, stopped_at_4, fix_manifest
) -> None:
    run_dir = stopped_at_4(tmp_path)
    marker = tmp_path / "code_ran"
    tamper(checkpoint(run_dir, 4) / "random_states_0.pkl", marker, fix_manifest)
    result = moe_train(run_dir, *SAVING, "resume=auto")
    assert not marker.exists(), "the pickle's code ran"
    why = "would call posix.system" if fix_manifest else "differs from the checksum"
    assert why in result.stderr + result.stdout
    assert_resumes_exactly(run_dir, straight, weights=True)
    assert not marker.exists()


def test_export_refuses_a_tampered_checkpoint(tmp_path: Path, stopped_at_4) -> None:
    run_dir = stopped_at_4(tmp_path)
    marker = tmp_path / "code_ran"
    tamper(checkpoint(run_dir, 4) / "optimizer.bin", marker, fix_manifest=True)
    with pytest.raises(CheckpointError, match=r"would call posix\.system"):
        export_fp32_state_dict(checkpoint(run_dir, 4))
    assert not marker.exists()
    verify_checkpoint(checkpoint(run_dir, 2))  # the untouched one passes


def test_the_pickle_scan_reads_every_protocol_without_running_anything(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{protocol}.pkl"
        path.write_bytes(pickle.dumps([1, {"a": _RunsCode(marker)}], protocol=protocol))
        assert manifest.unsafe_globals(path) == {"posix.system"}, protocol
        path.write_bytes(pickle.dumps({"step": 3, "seed": [1, 2]}, protocol=protocol))
        assert manifest.unsafe_globals(path) == set(), protocol
    safe = tmp_path / "tensors.pt"
    torch.save({"w": torch.ones(2), "moments": [torch.zeros(3, dtype=torch.bfloat16)]}, safe)
    assert manifest.unsafe_globals(safe) == set()
    assert not marker.exists()


def test_a_transient_io_error_while_saving_is_retried(tmp_path: Path, straight: Path) -> None:
    faults = {"MOE_FAULTS": "eio@checkpoint_write:step=4:times=2"}
    result = moe_train(tmp_path, *SAVING, "trainer.save_retries=2", env=faults)
    assert "retry 2 of 2" in result.stderr + result.stdout
    verify_checkpoint(checkpoint(tmp_path, 4))
    assert_resumes_exactly(tmp_path, straight, weights=True)


def test_a_lasting_io_error_stops_the_run_with_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    faults = {"MOE_FAULTS": "eio@checkpoint_write:step=4"}
    result = moe_train(tmp_path, *SAVING, "trainer.save_retries=1", env=faults, check=False)
    assert result.returncode == 6, result.stderr[-2000:]
    stopped = [line for line in result.stderr.splitlines() if line.startswith("stopped:")]
    assert len(stopped) == 1 and "after 2 attempts" in stopped[0] and step_dirname(2) in stopped[0]
    assert "Traceback" not in result.stderr
    verify_checkpoint(checkpoint(tmp_path, 2))
    assert not checkpoint(tmp_path, 4).exists()
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs of a given size mounted at RUN_DIR/checkpoints, a disk that really fills up (ENOSPC; RLIMIT_FSIZE
    would fail writes with EFBIG instead, and leave the free space the pre-save check reads untouched). Mounting
    needs root (CAP_SYS_ADMIN): without it the tests are skipped, or fail where MOE_TMPFS_REQUIRED=1 (CI, .ci/run)."""
    mounts = []

    def mount(run_dir: Path, size_kib: int) -> Path:
        target = run_dir / "checkpoints"
        target.mkdir(parents=True)
        command = ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(target)]
        try:
            result = subprocess.run(command, capture_output=True, text=True)
            why = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
        except FileNotFoundError:
            result, why = None, "no mount command"
        if result is None or result.returncode != 0:
            reason = f"mounting a {size_kib} KiB tmpfs needs root (CAP_SYS_ADMIN): {' '.join(command)}: {why}"
            if os.environ.get("MOE_TMPFS_REQUIRED") == "1":
                pytest.fail(f"MOE_TMPFS_REQUIRED=1 but {reason}", pytrace=False)
            pytest.skip(f"{reason} (CI sets MOE_TMPFS_REQUIRED=1 and fails here)")
        mounts.append(target)
        return target

    yield mount
    for target in mounts:
        subprocess.run(["umount", "-l", str(target)], check=False)


def checkpoint_kib(straight: Path) -> int:
    return sum(e["bytes"] for e in manifest.read(checkpoint(straight, 2))["files"].values()) // 1024


def test_a_full_disk_stops_the_run_with_the_previous_checkpoint_intact(tmp_path: Path, straight, small_disk) -> None:
    """Room for one checkpoint and a half: the second save cannot fit beside the first."""
    run_dir = tmp_path / "run"
    small_disk(run_dir, checkpoint_kib(straight) * 3 // 2)
    result = moe_train(run_dir, *SAVING, check=False)
    assert result.returncode == 6, result.stderr[-2000:]
    stopped = [line for line in result.stderr.splitlines() if line.startswith("stopped:")]
    assert len(stopped) == 1 and "the disk is full" in stopped[0] and step_dirname(2) in stopped[0], stopped
    assert "Traceback" not in result.stderr
    verify_checkpoint(checkpoint(run_dir, 2))
    assert not list((run_dir / "checkpoints").glob(".tmp_*")), "the partial save was removed to free the space"
    assert max(metric_steps(run_dir)) == 4


def test_a_disk_that_fills_up_mid_write_is_reported_as_full(tmp_path: Path, straight, small_disk) -> None:
    """Smaller than one checkpoint: the writer itself fails (ENOSPC inside torch.save or safetensors)."""
    run_dir = tmp_path / "run"
    small_disk(run_dir, checkpoint_kib(straight) // 2)
    result = moe_train(run_dir, *SAVING, check=False)
    assert result.returncode == 6, result.stderr[-2000:]
    stopped = [line for line in result.stderr.splitlines() if line.startswith("stopped:")]
    assert len(stopped) == 1 and "the disk is full" in stopped[0] and "no earlier checkpoint" in stopped[0], stopped
    assert not list((run_dir / "checkpoints").iterdir()), "the partial save was removed"


def test_a_rollback_keeps_the_checkpoint_it_resumed_from_and_sets_later_ones_aside(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    moe_train(run_dir, *SAVING, "trainer.keep_last=3")
    moe_train(run_dir, *SAVING, "trainer.keep_last=1", f"resume={checkpoint(run_dir, 2)}")
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == [step_dirname(2), step_dirname(6)], "the resumed-from checkpoint and the newest survive pruning"
    abandoned = sorted(p.name for p in (run_dir / "checkpoints" / "abandoned").iterdir())
    assert abandoned == [step_dirname(4), step_dirname(6)], "the replaced trajectory is set aside, not deleted"
    assert metric_steps(run_dir) == list(range(1, STEPS + 1))
    superseded = [json.loads(line) for line in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in superseded if "loss" in r}) == [3, 4, 5, 6]


def test_a_kill_while_pruning_leaves_debris_never_a_step_dir_without_manifest(tmp_path: Path, stopped_at_4) -> None:
    """`rmtree` deletes manifest.json among the first files: an old checkpoint is renamed out of the `step_…` names
    before its files go, and the next prune sweeps what a kill left."""
    run_dir = stopped_at_4(tmp_path)
    prune = {"MOE_FAULTS": "kill@checkpoint_prune:step=2"}  # the step-6 save prunes step 2 (keep_last=1)
    result = moe_train(run_dir, *SAVING, "trainer.keep_last=1", "resume=auto", env=prune, check=False)
    assert result.returncode == -9, result.stderr[-2000:]
    root = run_dir / "checkpoints"
    assert [p.name for p in step_dirs(root)] == [step_dirname(4), step_dirname(6)]
    assert all(is_complete(p) for p in step_dirs(root)), "a directory named step_… is always complete"
    assert (root / f"{REMOVING_PREFIX}{step_dirname(2)}").is_dir()
    moe_train(run_dir, *SAVING, "trainer.keep_last=1", "trainer.max_steps=8", "resume=auto")
    assert sorted(p.name for p in root.iterdir()) == ["latest", step_dirname(6), step_dirname(8)], "the debris is swept"
    assert metric_steps(run_dir) == list(range(1, 9))
