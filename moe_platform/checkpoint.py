"""Checkpoints: complete and verified or not used, found on disk, the last K kept, and a consolidated fp32 export.

Layout under the run directory:
    checkpoints/step_00000050/   Accelerate's save_state: model + optimizer (DeepSpeed writes its ZeRO shards
                                 itself, one file per rank) and every rank's RNG state; trainer_state.json (step,
                                 tokens seen, data position: JSON, never a pickle), config.yaml, layout.json
                                 (strategy, ZeRO stage, world size), and manifest.json, written last: every file's
                                 size and SHA-256, the step, the config's hash (manifest.py)
    checkpoints/latest           the newest checkpoint's name, for people and tools; resume does not rely on it
    checkpoints/abandoned/       checkpoints later than the step a run started from (a rollback, or a corrupt one
                                 passed over on resume): set aside, never deleted

Saving: every rank writes into `.tmp_step_…`; the ranks agree that every write succeeded; the files are hashed (each
by one rank) and the manifest written; the directory is renamed; `latest` is updated; older ones are pruned. A job
killed at any point leaves renamed directories that are complete, and debris that nothing takes for a checkpoint. A
transient I/O error (EIO, ESTALE, …) is retried `trainer.save_retries` times; a full disk stops the run with a clear
message and the previous checkpoint intact. Pruning keeps the newest `keep_last`, the one just written, and the one
this run resumed from.

Resuming: `resume_candidates` lists the renamed checkpoints, newest step first, whose files are all present at their
recorded sizes (a `stat` on every rank, before any process group: it catches a save cut short or a truncated copy).
`Checkpointer.load` then verifies the first one's checksums and scans its pickles (each file read by one rank), falls
back to the next on a mismatch, and only then lets Accelerate and DeepSpeed open anything: DeepSpeed unpickles its
shards with weights_only=False, so a file that is not what was saved never reaches it.

ZeRO shards are partitioned for the world size that wrote them. Resuming ZeRO-1/2 on another world size goes through
DeepSpeed's universal checkpoint: rank 0 converts the shards once into `step_…/universal/` (ds_to_universal), and
the engine, built with `checkpoint.load_universal`, re-partitions them on load. ZeRO-3 resumes on its own world
size only (see `check_layout`). ZeRO shards of an expert-parallel run cannot be converted by ds_to_universal (it
joins every rank's expert partitions as one tensor's), so such a run writes its universal copy itself on every save
(`expert_parallel.write_universal`), and resumes from it at another world size or EP size.
"""

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from moe_platform import faults, manifest
from moe_platform.redact import redact_text, secret_values

log = logging.getLogger(__name__)

CHECKPOINT_DIRNAME = "checkpoints"
LATEST = "latest"
LAYOUT = "layout.json"
TRAINER_STATE = "trainer_state.json"
ABANDONED_DIRNAME = "abandoned"
DEEPSPEED_TAG = "pytorch_model"  # the tag Accelerate gives DeepSpeed's save_checkpoint
UNIVERSAL_DIRNAME = "universal"  # DeepSpeed's universal checkpoint beside the ZeRO shards
EXPERTS_DIRNAME = "experts"  # expert shards by global expert id (expert_parallel.ExpertCheckpoint)
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# I/O errors worth another attempt (a flaky network filesystem), and those that mean the disk or quota is full.
TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.EINTR, errno.ECONNRESET}
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# torch.save and safetensors wrap the OSError of a full disk in their own error types; these phrases say it.
FULL_DISK_PHRASES = ("No space left", "StorageFull", "os error 28", "Disk quota exceeded")
RETRY_BACKOFF_S = 1.0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (a full disk, a lasting I/O error); earlier checkpoints are intact."""


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int:
    return int(_STEP_DIR.match(Path(path).name).group(1))


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
        layout: dict[str, Any],
        state: dict[str, Any],
        experts=None,
        save_retries: int = 3,
    ) -> None:
        """`layout` (see `sharding_layout`) is saved beside the state, so a resume knows how it was sharded; `state`
        names the objects (`state_dict`/`load_state_dict` of plain JSON values: trainer counters, data position)
        saved as trainer_state.json; `experts` (expert_parallel.py) writes and reads expert shards by global id."""
        self.root = Path(run_dir) / CHECKPOINT_DIRNAME
        self.accelerator = accelerator
        self.keep_last, self.save_retries = keep_last, save_retries
        self.layout, self.state, self.experts = layout, state, experts
        self.resumed_from: Path | None = None
        if experts is not None:
            accelerator.register_save_state_pre_hook(experts.drop_experts_from_model_file)

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
            shutil.rmtree(final, ignore_errors=True)  # re-saving the same step (e.g. after a resume)
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
        if failure is None and self.experts is not None:
            failure, _ = self._phase(self.experts.save, tmp)  # collective under DeepSpeed
        if failure is None:
            failure, _ = self._phase(self._write_metadata, tmp, config_yaml, main_only=True)
        if failure is None:
            failure, hashed = self._phase(self._hash_share, tmp)
        if failure is None:
            files = {name: entry for share in hashed for name, entry in share.items()}
            about = {"step": step, "config_sha256": hashlib.sha256(config_yaml.encode()).hexdigest(), **self.layout}
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
        (tmp / LAYOUT).write_text(json.dumps(self.layout))
        state = {name: obj.state_dict() for name, obj in self.state.items()}
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))
        if (tmp / UNIVERSAL_DIRNAME).is_dir():  # written by `experts.save` (ZeRO with EP)
            _link_shared_files(tmp, tmp / UNIVERSAL_DIRNAME)

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
                shutil.rmtree(old, ignore_errors=True)

    def _on_main(self, action, *args, **kwargs) -> None:
        if self.accelerator.is_main_process:
            action(*args, **kwargs)
        self.accelerator.wait_for_everyone()

    # ---- resuming ------------------------------------------------------------------------------------------------

    def load(self, candidates: list[Path]) -> Path:
        """Collective: restores model, optimizer, RNG states, trainer state and data position from the first of
        `candidates` (see `resume_candidates`) whose checksums and pickles pass; returns that checkpoint."""
        checkpoint = self._first_intact(candidates)
        saved = read_layout(checkpoint)
        check_layout(checkpoint, saved, self.layout)
        universal = needs_universal_load(saved, self.layout)
        path = self._universal_copy(checkpoint) if universal else checkpoint
        self.accelerator.load_state(str(path))
        if universal:
            _restore_buffers(self.accelerator.deepspeed_engine_wrapped.engine.module, path)
        if self.experts is not None:
            self.experts.load(path)
        self._load_trainer_state(checkpoint)
        self.resumed_from = checkpoint
        return checkpoint

    def set_aside_later_than(self, step: int) -> None:
        """Collective: checkpoints of steps after `step` (the one this run starts from) move to `abandoned/`: they
        belong to a trajectory this run replaces, and `resume=auto` must not pick them up later."""
        if self.accelerator.is_main_process:
            for later in [c for c in _step_dirs(self.root) if step_of(c) > step]:
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
        first_universal = needs_universal_load(read_layout(candidates[0]), self.layout)
        rejected = []
        for candidate in candidates:
            if needs_universal_load(read_layout(candidate), self.layout) != first_universal:
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
            command = [
                sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                "--input_folder", str(path / DEEPSPEED_TAG), "--output_folder", str(tmp / DEEPSPEED_TAG),
                "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state",
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise CheckpointError(
                    f"converting {path} to a universal checkpoint failed: {result.stderr.strip().splitlines()[-1]}"
                )
            _link_shared_files(path, tmp)
            names = manifest.listed_files(tmp)
            manifest.write(tmp, manifest.describe_files(tmp, names), {"converted_from": path.name})
            shutil.rmtree(universal, ignore_errors=True)
            os.replace(tmp, universal)
        self.accelerator.wait_for_everyone()
        return universal


@torch.no_grad()
def _restore_buffers(model: torch.nn.Module, universal: Path) -> None:
    """A universal load restores parameters only; the buffers (the router's balancing bias and load counts) come
    from rank 0's model file, as on a same-size load. Without this the first resumed steps route differently."""
    saved = torch.load(universal / DEEPSPEED_TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    names = set(saved.get("buffer_names") or [])
    for name, buffer in model.named_buffers():
        if name in names:
            buffer.copy_(saved["module"][name])


def _link_shared_files(checkpoint: Path, universal: Path) -> None:
    """Trainer state, RNG states, config: linked into the universal copy, not copied. The links are relative, so
    they survive the rename of `.tmp_step_…` and a move of the checkpoint."""
    for item in checkpoint.iterdir():
        if item.is_file() and item.name != manifest.MANIFEST:
            (universal / item.name).symlink_to(os.path.relpath(item, universal))


def _free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def sharding_layout(strategy: str, zero_stage: int, world_size: int, expert_parallel_size: int = 1) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "zero_stage": zero_stage,
        "world_size": world_size,
        "expert_parallel_size": expert_parallel_size,
    }


def is_complete(path: Path) -> bool:
    """Its manifest, written last before the rename, is there (`manifest.check_files` also checks the files)."""
    return (Path(path) / manifest.MANIFEST).is_file()


def read_layout(path: Path) -> dict[str, Any]:
    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint ({manifest.MANIFEST} missing): pick another or resume=none"
        )
    return json.loads((path / LAYOUT).read_text())


def check_layout(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """A checkpoint loads into the same kind of engine, and ZeRO shards into the same stage."""
    if (saved["strategy"] == "deepspeed") != (current["strategy"] == "deepspeed"):
        raise CheckpointError(
            f"{path} was saved with distributed.strategy={saved['strategy']} but this job uses "
            f"{current['strategy']}: resume with the same kind of strategy, or export it with moe-export"
        )
    if saved["strategy"] == "deepspeed" and saved["zero_stage"] != current["zero_stage"]:
        raise CheckpointError(
            f"{path} holds ZeRO-{saved['zero_stage']} state but this job runs ZeRO-{current['zero_stage']}: "
            f"resume with distributed=zero{saved['zero_stage']}"
        )
    _check_expert_parallel_layout(path, saved, current)
    if saved["strategy"] == "deepspeed" and saved["zero_stage"] == 3 and saved["world_size"] != current["world_size"]:
        # Measured with deepspeed 0.19.8: a ZeRO-3 universal load continues the losses only to ~3e-4, not exactly
        # (ZeRO-1/2 continue to 1e-5), so it is refused rather than silently perturbing the run.
        raise CheckpointError(
            f"{path} holds ZeRO-3 shards of {saved['world_size']} ranks but this job has {current['world_size']}: "
            "ZeRO-3 resumes on the same world size only (ZeRO-1/2 re-partition); or moe-export the weights"
        )


def _check_expert_parallel_layout(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """DDP checkpoints store experts by global id and resume at any EP size; ZeRO-1/2 checkpoints of an EP run
    resume at another world or EP size through the universal copy written on save."""
    saved_ep, current_ep = saved.get("expert_parallel_size", 1), current.get("expert_parallel_size", 1)
    if saved["strategy"] != "deepspeed" or (saved_ep == 1 and current_ep == 1):
        return
    if (saved_ep, saved["world_size"]) == (current_ep, current["world_size"]):
        return
    if not (path / UNIVERSAL_DIRNAME / DEEPSPEED_TAG / "zero").is_dir():
        # ds_to_universal cannot convert these shards (measured with deepspeed 0.19.8: it mis-reads the experts)
        raise CheckpointError(
            f"{path} holds ZeRO shards of {saved['world_size']} ranks with expert_parallel_size={saved_ep} and no "
            f"universal copy (saved without expert parallelism, or by an older version), so it resumes only on "
            f"{saved['world_size']} ranks with expert_parallel_size={saved_ep}, not {current['world_size']} with "
            f"{current_ep}"
        )


def needs_universal_load(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """ZeRO optimizer shards written by another number of ranks, or another EP size, must be re-partitioned on load."""
    sharded = saved["strategy"] == "deepspeed" and saved["zero_stage"] >= 1
    resized = saved["world_size"] != current["world_size"]
    return sharded and (resized or saved.get("expert_parallel_size", 1) != current.get("expert_parallel_size", 1))


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _step_dirs(root: Path) -> list[Path]:
    """Renamed checkpoint directories (complete or not), oldest step first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=step_of)


def complete_checkpoints(root: Path) -> list[Path]:
    """Renamed checkpoint directories with their manifest, oldest step first."""
    return [p for p in _step_dirs(root) if is_complete(p)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest checkpoint whose files are all there at their recorded sizes, found on disk: the `latest`
    pointer lags behind by one rename when a job is killed between the two."""
    usable, _ = _usable_checkpoints(Path(run_dir) / CHECKPOINT_DIRNAME)
    return usable[0] if usable else None


def _usable_checkpoints(root: Path) -> tuple[list[Path], list[str]]:
    """(checkpoints whose files pass `manifest.check_files`, newest first; one line per one passed over)."""
    usable, passed_over = [], []
    for path in reversed(_step_dirs(root)):
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
    if _STEP_DIR.match(path.name) is not None:
        try:
            manifest.check_files(path)
        except manifest.ManifestError as err:
            raise CheckpointError(f"resume={resume} cannot be used: {err}") from None
        return [path], []
    usable, passed_over = _usable_checkpoints(path / CHECKPOINT_DIRNAME)
    if not usable and (passed_over or resume != "auto"):
        found = "; ".join(passed_over) or "no checkpoint"
        raise CheckpointError(
            f"resume={resume}: no usable checkpoint under {path / CHECKPOINT_DIRNAME} ({found}): restore the files, "
            "point resume= at another checkpoint, or start afresh with resume=none"
        )
    return usable, passed_over


def verify_checkpoint(checkpoint: Path) -> None:
    """In one process: every file of `checkpoint` present, at its size and checksum, its pickles safe."""
    try:
        names = sorted(manifest.check_files(checkpoint)["files"])
    except manifest.ManifestError as err:
        raise CheckpointError(f"{checkpoint} cannot be used: {err}") from None
    problems = manifest.verify_share(checkpoint, names)
    if problems:
        raise CheckpointError(f"{checkpoint} cannot be used: {problems[0]}")


def export_fp32_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """One fp32 state dict of the whole model, whether the checkpoint holds ZeRO shards or a plain model file;
    nothing is opened before the checkpoint's files match their manifest."""
    checkpoint = Path(checkpoint)
    verify_checkpoint(checkpoint)
    layout = json.loads((checkpoint / LAYOUT).read_text()) if (checkpoint / LAYOUT).is_file() else {}
    if (checkpoint / DEEPSPEED_TAG).is_dir() and layout.get("expert_parallel_size", 1) > 1:
        # Measured with deepspeed 0.19.8: zero_to_fp32 reads every rank's expert partition as one tensor's.
        state = _state_dict_from_universal(checkpoint)
    elif (checkpoint / DEEPSPEED_TAG).is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DEEPSPEED_TAG)
    elif (checkpoint / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(checkpoint / "model.safetensors"))
    elif (checkpoint / "pytorch_model.bin").is_file():
        state = torch.load(checkpoint / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise CheckpointError(f"{checkpoint} holds neither ZeRO shards nor a model file: is it a checkpoint dir?")
    state.update(consolidated_experts(checkpoint))
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}


def _state_dict_from_universal(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model of a ZeRO checkpoint from its universal copy: every parameter's fp32 file (experts already whole,
    [E, …]), and from rank 0's model file the buffers and the second names of tied parameters."""
    universal = checkpoint / UNIVERSAL_DIRNAME / DEEPSPEED_TAG
    if not (universal / "zero").is_dir():
        raise CheckpointError(
            f"{checkpoint} holds ZeRO shards of an expert-parallel run but no {UNIVERSAL_DIRNAME}/ copy (an older "
            "version wrote it), and DeepSpeed's zero_to_fp32 cannot consolidate them: resume it once and save again"
        )
    model_file = torch.load(universal / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    state = dict(model_file["module"])  # buffers; its parameters (EP rank 0's experts) are all replaced below
    for directory in (universal / "zero").iterdir():
        if directory.is_dir():
            state[directory.name] = torch.load(directory / "fp32.pt", map_location="cpu", weights_only=True)["param"]
    for name, source in (model_file.get("shared_params") or {}).items():
        state[name] = state[source]
    return state


def consolidated_experts(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every expert tensor [E, …] of an expert-parallel checkpoint, its blocks joined in global-id order."""
    from safetensors import safe_open

    shards = expert_shard_files(Path(checkpoint) / EXPERTS_DIRNAME)
    if not shards:
        return {}
    with safe_open(str(next(iter(shards.values()))), framework="pt") as f:
        names = [key for key in f.keys() if not key.endswith((".exp_avg", ".exp_avg_sq"))]
    num_experts = max(ids.stop for ids in shards)
    return {name: read_expert_rows(shards, name, range(0, num_experts)) for name in names}


def expert_shard_files(directory: Path) -> dict[range, Path]:
    """{global expert ids: file} of a checkpoint's expert shards (empty when it has none)."""
    if not directory.is_dir():
        return {}
    found = {}
    for path in directory.glob("experts_*_*.safetensors"):
        first, stop = (int(part) for part in path.stem.split("_")[1:3])
        found[range(first, stop)] = path
    return found


def read_expert_rows(shards: dict[range, Path], key: str, block: range) -> torch.Tensor:
    """Rows [block.start, block.stop) of tensor `key`, gathered from the shard files that overlap them."""
    from safetensors import safe_open

    pieces, covered = [], block.start
    for ids in sorted(shards, key=lambda r: r.start):
        start, stop = max(ids.start, covered), min(ids.stop, block.stop)
        if start >= stop or start != covered:
            continue
        with safe_open(str(shards[ids]), framework="pt") as f:
            if key not in f.keys():
                raise CheckpointError(f"{shards[ids]} has no tensor {key}: the checkpoint is incomplete or foreign")
            pieces.append(f.get_slice(key)[start - ids.start : stop - ids.start])
        covered = stop
    if covered != block.stop:
        raise CheckpointError(
            f"the expert shards in {next(iter(shards.values())).parent} do not cover experts "
            f"{block.start}…{block.stop - 1}: the checkpoint is incomplete"
        )
    return torch.cat(pieces)
