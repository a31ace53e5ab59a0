"""The checkpointer: every rank saves into one directory that is complete and verified or not used; a resume loads
the newest one that passes its checks.

    checkpoints/step_00000050/   Accelerate's save_state: model + optimizer (DeepSpeed writes its ZeRO shards
                                 itself, one file per rank) and every rank's RNG state; trainer_state.json (step,
                                 tokens seen, data position: JSON, never a pickle), config.yaml, layout.json
                                 (checkpoint/layout.py), the parts the run adds (expert shards: experts.py; a
                                 universal copy: universal.py), and manifest.json, written last: every file's size and
                                 SHA-256, the step, the config's hash (manifest.py)
(where they are found, and the `latest` pointer and `abandoned/`: catalog.py)

Saving: every rank writes into `.tmp_step_…`; the ranks agree that every write succeeded; the files are hashed (each
by one rank) and the manifest written; the directory is renamed; `latest` is updated; older ones are pruned. A job
killed at any point leaves renamed directories that are complete, and debris that nothing takes for a checkpoint. A
transient I/O error (EIO, ESTALE, …) is retried `trainer.save_retries` times; a full disk stops the run with a clear
message and the previous checkpoint intact. Pruning keeps the newest `keep_last`, the one just written, and the one
this run resumed from.

Resuming: `catalog.resume_candidates` lists the renamed checkpoints, newest step first, whose files are all present
at their recorded sizes (a `stat` on every rank, before any process group: it catches a save cut short or a truncated
copy). `Checkpointer.load` then verifies the first one's checksums and scans its pickles (each file read by one rank),
falls back to the next on a mismatch, and only then lets Accelerate and DeepSpeed open anything: DeepSpeed unpickles
its shards with weights_only=False, so a file that is not what was saved never reaches it. ZeRO shards written at
another world or EP size load through their universal copy (layout.py says when, universal.py how).

FSDP runs: Accelerate holds none of their state but the RNG, so its files are the RNG states alone, and `dcp/` holds
every rank's shards (sharded.py). Between an FSDP run and a DDP or single-process one (either way) Accelerate loads
only the RNG states and the part that reads the other format converts (`CheckpointPart.reads`).
"""

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from accelerate import Accelerator
from accelerate.checkpointing import load_accelerator_state
from accelerate.utils import gather_object

from moe_platform import faults
from moe_platform.checkpoint import manifest
from moe_platform.checkpoint.catalog import (
    ABANDONED_DIRNAME,
    CHECKPOINT_DIRNAME,
    LATEST,
    REMOVING_PREFIX,
    complete_checkpoints,
    latest_checkpoint,
    removing_name,
    step_dirname,
    step_dirs,
    step_of,
)
from moe_platform.checkpoint.errors import CheckpointError, CheckpointWriteError
from moe_platform.checkpoint.layout import DCP, CheckpointLayout
from moe_platform.checkpoint.universal import (
    UNIVERSAL_DIRNAME,
    convert_zero_shards,
    link_shared_files,
    restore_buffers,
)
from moe_platform.redact import redact_text, secret_values

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
# I/O errors worth another attempt (a flaky network filesystem), and those that mean the disk or quota is full.
TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.EINTR, errno.ECONNRESET}
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# torch.save and safetensors wrap the OSError of a full disk in their own error types; these phrases say it.
FULL_DISK_PHRASES = ("No space left", "StorageFull", "os error 28", "Disk quota exceeded")
RETRY_BACKOFF_S = 1.0


class CheckpointPart(Protocol):
    """State a run keeps in its own files beside Accelerate's (expert shards, a universal copy, DCP shards): written
    into the checkpoint directory after Accelerate's save_state, read after its load_state. `load` is called for
    checkpoints of the run's own format (`CheckpointLayout.format`) unless the part names the formats it reads in a
    `reads` attribute (sharded.py's convert between DCP shards and Accelerate's files)."""

    def save(self, directory: Path) -> None: ...

    def load(self, checkpoint: Path) -> None: ...


@dataclass
class WriteFailure:
    """Why one rank's part of a save failed, as every rank learns it."""

    rank: int
    message: str
    transient: bool
    full: bool

    @classmethod
    def of(cls, err: BaseException, rank: int, where: Path) -> "WriteFailure":
        code, text = getattr(err, "errno", None), f"{type(err).__name__}: {err}"
        full = code in FULL_ERRNOS or any(phrase in text for phrase in FULL_DISK_PHRASES)
        if not full and not isinstance(err, OSError):
            full = _free_bytes(where) < (1 << 20)  # a writer's own error type hiding ENOSPC: the disk says it
        return cls(rank, text.strip().splitlines()[0], code in TRANSIENT_ERRNOS and not full, full)


class Checkpointer:
    def __init__(
        self,
        run_dir: Path,
        accelerator: Accelerator,
        keep_last: int,
        layout: CheckpointLayout,
        state: dict[str, Any],
        parts: list[CheckpointPart] | None = None,
        save_retries: int = 3,
    ) -> None:
        """`layout` is saved beside the state, so a resume knows how it was sharded; `state` names the objects
        (`state_dict`/`load_state_dict` of plain JSON values: trainer counters, data position) saved as
        trainer_state.json; `parts` write and read their own files (expert shards by global id, a universal copy)."""
        self.root = Path(run_dir) / CHECKPOINT_DIRNAME
        self.accelerator = accelerator
        self.keep_last, self.save_retries = keep_last, save_retries
        self.layout, self.state, self.parts = layout, state, list(parts or [])
        self.resumed_from: Path | None = None

    # ---- saving --------------------------------------------------------------------------------------------------

    def save(self, step: int, config_yaml: str) -> Path:
        """Collective: every rank calls it. Returns the final directory; raises CheckpointWriteError on every rank
        when the checkpoint could not be written, with the earlier checkpoints untouched."""
        final = self.root / step_dirname(step)
        tmp = self.root / f".tmp_{final.name}"
        for attempt in range(1, self.save_retries + 2):
            failure = self._write(tmp, step, config_yaml)
            if failure is None:
                break
            self._on_main(shutil.rmtree, tmp, ignore_errors=True)  # a full disk needs the space back
            if not failure.transient or attempt > self.save_retries:
                raise CheckpointWriteError(self._describe_failure(final, failure, attempt))
            if self.accelerator.is_main_process:
                log.warning("checkpoint %s: %s (rank %d); retry %d of %d", final.name, failure.message,
                            failure.rank, attempt, self.save_retries)  # fmt: skip
            time.sleep(RETRY_BACKOFF_S * attempt)
        if self.accelerator.is_main_process:
            faults.point("checkpoint_rename", step)
            if final.exists():  # re-saving the same step (e.g. after a resume)
                _remove_checkpoint(final)
            os.replace(tmp, final)
            faults.point("checkpoint_pointer", step)
            _write_atomically(self.root / LATEST, final.name)
            self._prune(keep=final)
        self.accelerator.wait_for_everyone()
        return final

    def _write(self, tmp: Path, step: int, config_yaml: str) -> WriteFailure | None:
        """The save's phases into `tmp`. After each, the ranks exchange outcomes, so every rank sees the same failure
        and none is left waiting in a collective that another has abandoned."""
        failure, _ = self._phase(self._prepare, tmp, main_only=True)
        if failure is None:
            failure, _ = self._phase(self._write_state, tmp, step)
        for part in self.parts:
            if failure is None:
                failure, _ = self._phase(part.save, tmp)  # collective for a universal copy
        if failure is None:
            failure, _ = self._phase(self._write_metadata, tmp, config_yaml, main_only=True)
        if failure is None:
            failure, hashed = self._phase(self._hash_share, tmp)
        if failure is None:
            files = {name: entry for share in hashed for name, entry in share.items()}
            config_sha256 = hashlib.sha256(config_yaml.encode()).hexdigest()
            about = {"step": step, "config_sha256": config_sha256, **self.layout.as_dict()}
            failure, _ = self._phase(manifest.write, tmp, files, about, main_only=True)
        return failure

    def _phase(self, action, *args, main_only: bool = False) -> tuple[WriteFailure | None, list]:
        """Run `action` on every rank (or rank 0 alone) with its errors caught; returns the first rank's failure, if
        any, and every rank's result."""
        outcome = None
        if not main_only or self.accelerator.is_main_process:
            try:
                outcome = action(*args)
            except Exception as err:
                outcome = WriteFailure.of(err, self.accelerator.process_index, self.root)
        outcomes = gather_object([outcome]) if self.accelerator.num_processes > 1 else [outcome]
        failures = [o for o in outcomes if isinstance(o, WriteFailure)]
        return (failures[0] if failures else None), outcomes

    def _prepare(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
        tmp.mkdir(parents=True)
        previous = latest_checkpoint(self.root.parent)
        if previous is None:
            return
        needed = sum(entry["bytes"] for entry in manifest.read(previous)["files"].values())
        free = _free_bytes(self.root)
        if free < needed:  # the previous one stays until this one is complete: both must fit
            raise OSError(
                errno.ENOSPC,
                f"{free / 2**20:.1f} MiB free under {self.root}, a checkpoint needs about {needed / 2**20:.1f} MiB "
                f"(the size of {previous.name})",
            )

    def _write_state(self, tmp: Path, step: int) -> None:
        faults.point("checkpoint_write", step)
        self.accelerator.save_state(str(tmp))

    def _write_metadata(self, tmp: Path, config_yaml: str) -> None:
        (tmp / "config.yaml").write_text(redact_text(config_yaml, secret_values()))  # env secrets too
        self.layout.write(tmp)
        state = {name: obj.state_dict() for name, obj in self.state.items()}
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))
        if (tmp / UNIVERSAL_DIRNAME).is_dir():  # written by a part's `save` (ZeRO with EP)
            link_shared_files(tmp, tmp / UNIVERSAL_DIRNAME)

    def _hash_share(self, tmp: Path) -> dict[str, dict[str, Any]]:
        names = manifest.listed_files(tmp)
        share = manifest.shard(names, self.accelerator.process_index, self.accelerator.num_processes)
        return manifest.describe_files(tmp, share)

    def _describe_failure(self, final: Path, failure: WriteFailure, attempts: int) -> str:
        previous = latest_checkpoint(self.root.parent)
        kept = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
        tried = f" after {attempts} attempts" if attempts > 1 else ""
        if failure.full:
            fix = f"free space under {self.root} (or lower trainer.keep_last) and resume with resume=auto"
            why = f"the disk is full ({failure.message}, rank {failure.rank})"
            return f"checkpoint {final.name} was not written, {why}; {kept}: {fix}"
        return (
            f"checkpoint {final.name} was not written{tried} ({failure.message}, rank {failure.rank}); {kept}: "
            "resume with resume=auto once the storage is healthy"
        )

    def _prune(self, keep: Path) -> None:
        """Keep the newest `keep_last` by step, the one just written and the one this run resumed from."""
        protected = {keep, self.resumed_from}
        for old in complete_checkpoints(self.root)[: -self.keep_last]:
            if old not in protected:
                _remove_checkpoint(old)
        for debris in self.root.glob(f"{REMOVING_PREFIX}*"):  # deletions a kill cut short
            shutil.rmtree(debris, ignore_errors=True)

    def _on_main(self, action, *args, **kwargs) -> None:
        if self.accelerator.is_main_process:
            action(*args, **kwargs)
        self.accelerator.wait_for_everyone()

    # ---- resuming ------------------------------------------------------------------------------------------------

    def load(self, candidates: list[Path]) -> Path:
        """Collective: restores model, optimizer, RNG states, trainer state and data position from the first of
        `candidates` (see `resume_candidates`) whose checksums and pickles pass; returns that checkpoint."""
        checkpoint = self._first_intact(candidates)
        saved = CheckpointLayout.read(checkpoint)
        saved.check_resumable_as(self.layout, checkpoint)
        universal = saved.needs_universal_load(self.layout)
        path = self._universal_copy(checkpoint) if universal else checkpoint
        if saved.format == self.layout.format or self.layout.format == DCP:
            self.accelerator.load_state(str(path))  # under FSDP Accelerate holds the RNG states alone
        else:  # DCP shards into a DDP or single-process run: Accelerate's model and optimizer files are not there
            load_accelerator_state(str(path), [], [], [], [], self.accelerator.process_index, map_location="cpu")
        if universal:
            restore_buffers(self.accelerator.deepspeed_engine_wrapped.engine.module, path)
        for part in self.parts:
            if saved.format in getattr(part, "reads", (self.layout.format,)):
                part.load(path)
        self._load_trainer_state(checkpoint)
        self.resumed_from = checkpoint
        return checkpoint

    def set_aside_later_than(self, step: int) -> None:
        """Collective: checkpoints of steps after `step` (the one this run starts from) move to `abandoned/`: they
        belong to a trajectory this run replaces, and `resume=auto` must not pick them up later."""
        if self.accelerator.is_main_process:
            for later in [c for c in step_dirs(self.root) if step_of(c) > step]:
                target = self.root / ABANDONED_DIRNAME / later.name
                while target.exists():
                    target = target.with_name(target.name + "+")
                target.parent.mkdir(exist_ok=True)
                os.replace(later, target)
                log.warning("set aside %s (later than step %d, where this run starts) in %s", later.name, step, target)
        self.accelerator.wait_for_everyone()

    def _first_intact(self, candidates: list[Path]) -> Path:
        """The first candidate whose files match their checksums and whose pickles call nothing unsafe. Only
        candidates that load like the first are tried: the engine was built for its layout."""
        first_universal = CheckpointLayout.read(candidates[0]).needs_universal_load(self.layout)
        rejected = []
        for candidate in candidates:
            if CheckpointLayout.read(candidate).needs_universal_load(self.layout) != first_universal:
                break
            problems = self._verify(candidate)
            if not problems:
                return candidate
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            rejected.append(f"{candidate}: {problems[0]}{more}")
            if self.accelerator.is_main_process:
                log.warning("checkpoint %s is not used: %s%s", candidate.name, problems[0], more)
        raise CheckpointError(
            f"no checkpoint could be verified ({'; '.join(rejected)}): restore the files, or start with resume=none"
        )

    def _verify(self, directory: Path) -> list[str]:
        """Collective: every problem with `directory`'s files, each file checked by one rank."""
        names = sorted(manifest.read(directory)["files"])
        share = manifest.shard(names, self.accelerator.process_index, self.accelerator.num_processes)
        problems = manifest.verify_share(directory, share)
        if self.accelerator.num_processes > 1:
            problems = [p for rank_problems in gather_object([problems]) for p in rank_problems]
        return problems

    def _load_trainer_state(self, checkpoint: Path) -> None:
        path = checkpoint / TRAINER_STATE
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path} cannot be read ({err}): the checkpoint is damaged") from None
        for name, obj in self.state.items():
            if not isinstance(saved.get(name), dict):
                raise CheckpointError(f"{path} has no {name!r} state: it was written by another program or version")
            obj.load_state_dict(saved[name])

    def _universal_copy(self, path: Path) -> Path:
        """`path/universal`: the ZeRO shards in DeepSpeed's universal format, next to the other files. Written on
        save under EP (then in the checkpoint's manifest); otherwise converted once here, with its own manifest."""
        universal = path / UNIVERSAL_DIRNAME
        covered = any(name.startswith(f"{UNIVERSAL_DIRNAME}/") for name in manifest.read(path)["files"])
        if covered:
            return universal
        converted = (universal / manifest.MANIFEST).is_file() and not self._verify(universal)
        if self.accelerator.is_main_process and not converted:
            tmp = path / ".universal.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            convert_zero_shards(path, tmp)
            link_shared_files(path, tmp)
            names = manifest.listed_files(tmp)
            manifest.write(tmp, manifest.describe_files(tmp, names), {"converted_from": path.name})
            shutil.rmtree(universal, ignore_errors=True)
            os.replace(tmp, universal)
        self.accelerator.wait_for_everyone()
        return universal


def _free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _remove_checkpoint(path: Path) -> None:
    """Rename, then delete: `rmtree` removes manifest.json among the first files, so a kill part-way through would
    leave a `step_…` directory that is not a checkpoint (catalog.removing_name)."""
    doomed = removing_name(path)
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    faults.point("checkpoint_prune", step_of(path))
    shutil.rmtree(doomed, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
