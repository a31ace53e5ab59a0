"""A run directory's checkpoints, found on disk: their names, which are complete, which are usable, the newest.

    checkpoints/step_00000050/   a checkpoint; complete once its manifest.json, written last, is there
    checkpoints/.tmp_step_…      a save in progress, or one a kill cut short: never taken for a checkpoint
    checkpoints/.removing_step_… a pruned or replaced checkpoint whose deletion a kill cut short: renamed out of the
                                 `step_…` names before its files go, swept by the next prune
    checkpoints/latest           the newest checkpoint's name, for people and tools; nothing here relies on it
    checkpoints/abandoned/       checkpoints later than the step a run started from (a rollback, or a corrupt one
                                 passed over on resume): set aside by the checkpointer, never deleted

Everything here is a `stat` or a small read that every rank can make before any process group exists, so every rank
decides the same.
"""

import re
from pathlib import Path

from moe_platform.checkpoint import manifest
from moe_platform.checkpoint.errors import CheckpointError

CHECKPOINT_DIRNAME = "checkpoints"
LATEST = "latest"
ABANDONED_DIRNAME = "abandoned"
REMOVING_PREFIX = ".removing_"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def removing_name(path: Path) -> Path:
    """Where a checkpoint goes while it is deleted: out of the `step_…` names first, so that a kill part-way through
    the deletion leaves debris, never a `step_…` directory without its manifest."""
    return Path(path).with_name(REMOVING_PREFIX + Path(path).name)


def step_of(path: Path) -> int:
    return int(_STEP_DIR.match(Path(path).name).group(1))


def is_step_dir(path: Path) -> bool:
    return _STEP_DIR.match(Path(path).name) is not None


def is_complete(path: Path) -> bool:
    """Its manifest, written last before the rename, is there (`manifest.check_files` also checks the files)."""
    return (Path(path) / manifest.MANIFEST).is_file()


def step_dirs(root: Path) -> list[Path]:
    """Renamed checkpoint directories under `root` (complete or not), oldest step first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and is_step_dir(p)), key=step_of)


def complete_checkpoints(root: Path) -> list[Path]:
    """Renamed checkpoint directories with their manifest, oldest step first."""
    return [p for p in step_dirs(root) if is_complete(p)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest checkpoint whose files are all there at their recorded sizes, found on disk: the `latest`
    pointer lags behind by one rename when a job is killed between the two."""
    usable, _ = usable_checkpoints(Path(run_dir) / CHECKPOINT_DIRNAME)
    return usable[0] if usable else None


def usable_checkpoints(root: Path) -> tuple[list[Path], list[str]]:
    """(checkpoints whose files pass `manifest.check_files`, newest first; one line per one passed over)."""
    usable, passed_over = [], []
    for path in reversed(step_dirs(root)):
        try:
            manifest.check_files(path)
            usable.append(path)
        except manifest.ManifestError as err:
            passed_over.append(f"{path.name}: {err}")
    return usable, passed_over


def resume_candidates(resume: str, run_dir: Path) -> tuple[list[Path], list[str]]:
    """Checkpoints to resume from, newest first, each with all its files at their recorded sizes (no process group
    needed: every rank decides the same), and one line per checkpoint passed over.

    `none` → none; `auto` → this run dir's (none on a fresh run); a run dir → its; a checkpoint dir → that one only.
    A run dir whose checkpoints are all unusable is an error, not a fresh start: starting over silently would
    discard the run."""
    if resume == "none":
        return [], []
    path = Path(run_dir) if resume == "auto" else Path(resume)
    if resume != "auto" and not path.is_dir():
        raise CheckpointError(f"resume={resume} does not exist: give a checkpoint or run directory, or resume=none")
    if is_step_dir(path):
        try:
            manifest.check_files(path)
        except manifest.ManifestError as err:
            raise CheckpointError(f"resume={resume} cannot be used: {err}") from None
        return [path], []
    usable, passed_over = usable_checkpoints(path / CHECKPOINT_DIRNAME)
    if not usable and (passed_over or resume != "auto"):
        found = "; ".join(passed_over) or "no checkpoint"
        raise CheckpointError(
            f"resume={resume}: no usable checkpoint under {path / CHECKPOINT_DIRNAME} ({found}): restore the files, "
            "point resume= at another checkpoint, or start afresh with resume=none"
        )
    return usable, passed_over
