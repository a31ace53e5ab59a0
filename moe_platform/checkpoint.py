"""Checkpoints: complete or absent, a `latest` pointer, the last K kept, and a consolidated fp32 export.

Layout under the run directory:
    checkpoints/step_00000050/   Accelerate's save_state: model + optimizer (DeepSpeed writes its ZeRO shards
                                 itself, one file per rank), RNG states of every rank, and the registered
                                 objects (trainer state, data-loader position), plus config.yaml and
                                 layout.json (strategy, ZeRO stage, world size)
    checkpoints/latest           the name of the newest complete checkpoint

A checkpoint is written to `.tmp_step_…` and renamed once every rank has finished writing, so a job killed
mid-save never leaves a directory that looks complete; `resume=auto` only ever sees renamed ones.
"""

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

CHECKPOINT_DIRNAME = "checkpoints"
LATEST = "latest"
LAYOUT = "layout.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


class Checkpointer:
    def __init__(self, run_dir: Path, accelerator: Accelerator, keep_last: int, layout: dict[str, Any]) -> None:
        """`layout` describes how state is sharded (strategy, ZeRO stage, world size); it is saved beside the
        state so a resume that cannot read it fails with a sentence instead of deep inside DeepSpeed."""
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
        if not (path / "config.yaml").is_file() or not (path / LAYOUT).is_file():
            raise CheckpointError(
                f"{path} is not a complete checkpoint (config.yaml or {LAYOUT} missing): pick another or resume=none"
            )
        self._check_layout(path, json.loads((path / LAYOUT).read_text()))
        self.accelerator.load_state(str(path))

    def _check_layout(self, path: Path, saved: dict[str, Any]) -> None:
        if (saved["strategy"] == "deepspeed") != (self.layout["strategy"] == "deepspeed"):
            raise CheckpointError(
                f"{path} was saved with distributed.strategy={saved['strategy']} but this job uses "
                f"{self.layout['strategy']}: resume with the same kind of strategy, or export it with moe-export"
            )
        sharded = saved["strategy"] == "deepspeed" and saved["zero_stage"] >= 1
        if sharded and (saved["zero_stage"], saved["world_size"]) != (
            self.layout["zero_stage"],
            self.layout["world_size"],
        ):
            raise CheckpointError(
                f"{path} holds ZeRO-{saved['zero_stage']} optimizer shards of {saved['world_size']} ranks but this job "
                f"runs ZeRO-{self.layout['zero_stage']} on {self.layout['world_size']}: DeepSpeed cannot re-partition "
                "them on load, so resume with the same stage and world size (the data order does not depend on it)"
            )


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
        if named.is_dir() and (named / LAYOUT).is_file():
            return named
    complete = [p for p in complete_checkpoints(root) if (p / LAYOUT).is_file()]
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
    deepspeed_dir = checkpoint / "pytorch_model"
    if deepspeed_dir.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")
    elif (checkpoint / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(checkpoint / "model.safetensors"))
    elif (checkpoint / "pytorch_model.bin").is_file():
        state = torch.load(checkpoint / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise CheckpointError(f"{checkpoint} holds neither ZeRO shards nor a model file: is it a checkpoint dir?")
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}
