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
size only (see `check_layout`). ZeRO shards of an expert-parallel run cannot be converted by ds_to_universal (it
joins every rank's expert partitions as one tensor's), so such a run writes its universal copy itself on every save
(`expert_parallel.write_universal`), and resumes from it at another world size or EP size.
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

from moe_platform.redact import redact_text, secret_values

CHECKPOINT_DIRNAME = "checkpoints"
LATEST = "latest"
LAYOUT = "layout.json"
DEEPSPEED_TAG = "pytorch_model"  # the tag Accelerate gives DeepSpeed's save_checkpoint
UNIVERSAL_DIRNAME = "universal"  # DeepSpeed's universal checkpoint beside the ZeRO shards
EXPERTS_DIRNAME = "experts"  # expert shards by global expert id (expert_parallel.ExpertCheckpoint)
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


class Checkpointer:
    def __init__(
        self, run_dir: Path, accelerator: Accelerator, keep_last: int, layout: dict[str, Any], experts=None
    ) -> None:
        """`layout` (see `sharding_layout`) is saved beside the state, so a resume knows how it was sharded;
        `experts` (an `expert_parallel.ExpertCheckpoint`) writes and reads expert shards by global expert id."""
        self.root = Path(run_dir) / CHECKPOINT_DIRNAME
        self.accelerator = accelerator
        self.keep_last = keep_last
        self.layout = layout
        self.experts = experts
        if experts is not None:
            accelerator.register_save_state_pre_hook(experts.drop_experts_from_model_file)

    def save(self, step: int, config_yaml: str) -> Path:
        """Collective: every rank calls it. Returns the final directory."""
        final = self.root / step_dirname(step)
        tmp = self.root / f".tmp_{step_dirname(step)}"
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        if self.experts is not None:
            self.experts.save(tmp)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            (tmp / "config.yaml").write_text(redact_text(config_yaml, secret_values()))  # env secrets too
            (tmp / LAYOUT).write_text(json.dumps(self.layout))
            if (tmp / UNIVERSAL_DIRNAME).is_dir():  # written by `experts.save` (ZeRO with EP)
                _link_shared_files(tmp, tmp / UNIVERSAL_DIRNAME)
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
        universal = needs_universal_load(saved, self.layout)
        if universal:
            path = self._universal_copy(path)
        self.accelerator.load_state(str(path))
        if universal:
            _restore_buffers(self.accelerator.deepspeed_engine_wrapped.engine.module, path)
        if self.experts is not None:
            self.experts.load(path)

    def _universal_copy(self, path: Path) -> Path:
        """`path/universal`: the ZeRO shards converted to DeepSpeed's universal format, next to the other files."""
        universal = path / UNIVERSAL_DIRNAME
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
            _link_shared_files(path, tmp)
            os.replace(tmp, universal)
        self.accelerator.wait_for_everyone()
        return universal


@torch.no_grad()
def _restore_buffers(model: torch.nn.Module, universal: Path) -> None:
    """A universal load restores parameters only; the buffers (the router's balancing bias and load counts) come
    from rank 0's model file, as on a same-size load. Without this the first resumed steps route differently."""
    saved = torch.load(universal / DEEPSPEED_TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    names = set(saved.get("buffer_names") or [])
    for name, buffer in model.named_buffers():
        if name in names:
            buffer.copy_(saved["module"][name])


def _link_shared_files(checkpoint: Path, universal: Path) -> None:
    """Trainer state, data position, RNG states, config: linked into the universal copy, not copied. The links are
    relative, so they survive the rename of `.tmp_step_…` and a move of the checkpoint."""
    for item in checkpoint.iterdir():
        if item.is_file():
            (universal / item.name).symlink_to(os.path.relpath(item, universal))


def sharding_layout(strategy: str, zero_stage: int, world_size: int, expert_parallel_size: int = 1) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "zero_stage": zero_stage,
        "world_size": world_size,
        "expert_parallel_size": expert_parallel_size,
    }


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
    model_file = torch.load(universal / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    state = dict(model_file["module"])  # buffers; its parameters (EP rank 0's experts) are all replaced below
    for directory in (universal / "zero").iterdir():
        if directory.is_dir():
            state[directory.name] = torch.load(directory / "fp32.pt", map_location="cpu", weights_only=False)["param"]
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
