"""Checkpoints: complete or absent, a `latest` pointer, the last K kept, and a consolidated fp32 export.

Layout under the run directory:
    checkpoints/step_00000050/   Accelerate's save_state: model + optimizer (DeepSpeed writes its ZeRO shards
                                 itself, one file per rank), RNG states of every rank, and the registered
                                 objects (trainer state, data-loader position), plus config.yaml and
                                 layout.json (strategy, ZeRO stage, world size)
    checkpoints/latest           the name of the newest complete checkpoint

A checkpoint is written to `.tmp_step_…` and renamed once every rank has finished writing, so a job killed
mid-save never leaves a directory that looks complete; `resume=auto` only ever sees renamed ones.

ZeRO shards are partitioned for the world size that wrote them. Resuming ZeRO-1/2 on another world size goes through
DeepSpeed's universal checkpoint: rank 0 converts the shards once into `step_…/universal/` (ds_to_universal), and
the engine, built with `checkpoint.load_universal`, re-partitions them on load. ZeRO-3 resumes on its own world
size only (see `check_layout`).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

CHECKPOINT_DIRNAME = "checkpoints"
LATEST = "latest"
LAYOUT = "layout.json"
DEEPSPEED_TAG = "pytorch_model"  # the tag Accelerate gives DeepSpeed's save_checkpoint
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


class Checkpointer:
    def __init__(self, run_dir: Path, accelerator: Accelerator, keep_last: int, layout: dict[str, Any]) -> None:
        """`layout` (see `sharding_layout`) is saved beside the state, so a resume knows how it was sharded."""
        self.root = Path(run_dir) / CHECKPOINT_DIRNAME
        self.accelerator = accelerator
        self.keep_last = keep_last
        self.layout = layout

    def save(self, step: int, config_yaml: str) -> Path:
        """Collective: every rank calls it. Returns the final directory."""
        final = self.root / step_dirname(step)
        tmp = self.root / f".tmp_{step_dirname(step)}"
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            (tmp / "config.yaml").write_text(config_yaml)
            (tmp / LAYOUT).write_text(json.dumps(self.layout))
            shutil.rmtree(final, ignore_errors=True)  # re-saving the same step (e.g. after a resume)
            os.replace(tmp, final)
            _write_atomically(self.root / LATEST, final.name)
            self._prune()
        self.accelerator.wait_for_everyone()
        return final

    def _prune(self) -> None:
        for old in complete_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path) -> None:
        """Collective: restores model, optimizer, RNG states and the registered objects."""
        saved = read_layout(path)
        check_layout(path, saved, self.layout)
        if needs_universal_load(saved, self.layout):
            path = self._universal_copy(path)
        self.accelerator.load_state(str(path))

    def _universal_copy(self, path: Path) -> Path:
        """`path/universal`: the ZeRO shards converted to DeepSpeed's universal format, next to the other files."""
        universal = path / "universal"
        if self.accelerator.is_main_process and not universal.is_dir():
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
            for item in path.iterdir():  # trainer state, data position, RNG states, config: shared, not copied
                if item.is_file():
                    (tmp / item.name).symlink_to(item.resolve())
            os.replace(tmp, universal)
        self.accelerator.wait_for_everyone()
        return universal


def sharding_layout(strategy: str, zero_stage: int, world_size: int) -> dict[str, Any]:
    return {"strategy": strategy, "zero_stage": zero_stage, "world_size": world_size}


def is_complete(path: Path) -> bool:
    """config.yaml and layout.json are written last, just before the rename: both present means complete."""
    return (path / "config.yaml").is_file() and (path / LAYOUT).is_file()


def read_layout(path: Path) -> dict[str, Any]:
    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (config.yaml or {LAYOUT} missing): pick another or resume=none"
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
    if saved["strategy"] == "deepspeed" and saved["zero_stage"] == 3 and saved["world_size"] != current["world_size"]:
        # Measured with deepspeed 0.19.8: a ZeRO-3 universal load continues the losses only to ~3e-4, not exactly
        # (ZeRO-1/2 continue to 1e-5), so it is refused rather than silently perturbing the run.
        raise CheckpointError(
            f"{path} holds ZeRO-3 shards of {saved['world_size']} ranks but this job has {current['world_size']}: "
            "ZeRO-3 resumes on the same world size only (ZeRO-1/2 re-partition); or moe-export the weights"
        )


def needs_universal_load(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """ZeRO optimizer shards written by another number of ranks must be re-partitioned on load."""
    sharded = saved["strategy"] == "deepspeed" and saved["zero_stage"] >= 1
    return sharded and saved["world_size"] != current["world_size"]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def complete_checkpoints(root: Path) -> list[Path]:
    """Renamed (hence complete) checkpoint directories, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The `latest` pointer if it names a complete checkpoint, else the newest complete one, else None."""
    root = Path(run_dir) / CHECKPOINT_DIRNAME
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
    complete = [p for p in complete_checkpoints(root) if is_complete(p)]
    return complete[-1] if complete else None


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """`none` → None; `auto` → the latest complete checkpoint of this run dir (None on a fresh run); else a path."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if path.is_dir() and _STEP_DIR.match(path.name) is None:  # a run dir: take its latest checkpoint
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"resume={resume} holds no complete checkpoint: check the path or use resume=none")
        return found
    if not path.is_dir():
        raise CheckpointError(f"resume={resume} does not exist: give a checkpoint or run directory, or resume=none")
    return path


def export_fp32_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """One fp32 state dict of the whole model, whether the checkpoint holds ZeRO shards or a plain model file."""
    checkpoint = Path(checkpoint)
    if (checkpoint / DEEPSPEED_TAG).is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DEEPSPEED_TAG)
    elif (checkpoint / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(checkpoint / "model.safetensors"))
    elif (checkpoint / "pytorch_model.bin").is_file():
        state = torch.load(checkpoint / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise CheckpointError(f"{checkpoint} holds neither ZeRO shards nor a model file: is it a checkpoint dir?")
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}
