"""DeepSpeed's universal checkpoint beside the ZeRO shards (`step_…/universal/`): the form that re-partitions on load.

ZeRO shards load only at the world size and expert-parallel size that wrote them. DeepSpeed's universal format holds
each parameter whole (fp32 master, AdamW moments), and an engine built with `checkpoint.load_universal` slices it for
its own partition. Two ways to get one:
  * `convert_zero_shards`: DeepSpeed's ds_to_universal, run once when a resize first needs it (no expert
    parallelism);
  * `write_universal`, on every save of an expert-parallel ZeRO-1/2 run: ds_to_universal joins every rank's expert
    partitions as if they were one tensor's (measured with deepspeed 0.19.8), so the live engine writes each
    parameter whole itself, expert blocks gathered over the EP group (`UniversalExpertCopy`).
The files both share with the checkpoint (trainer state, RNG states, config) are linked, not copied.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_platform.checkpoint import manifest
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.checkpoint.experts import ADAMW_MOMENTS

DEEPSPEED_TAG = "pytorch_model"  # the tag Accelerate gives DeepSpeed's save_checkpoint
UNIVERSAL_DIRNAME = "universal"
MODEL_STATES = "mp_rank_00_model_states.pt"  # rank 0's module file among the ZeRO shards


def convert_zero_shards(checkpoint: Path, target: Path) -> None:
    """ds_to_universal of `checkpoint`'s ZeRO shards into `target` (in one process: rank 0's job)."""
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(checkpoint / DEEPSPEED_TAG), "--output_folder", str(target / DEEPSPEED_TAG),
        "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CheckpointError(
            f"converting {checkpoint} to a universal checkpoint failed: {result.stderr.strip().splitlines()[-1]}"
        )


def link_shared_files(checkpoint: Path, universal: Path) -> None:
    """Trainer state, RNG states, config: linked into the universal copy, not copied. The links are relative, so
    they survive the rename of `.tmp_step_…` and a move of the checkpoint."""
    for item in checkpoint.iterdir():
        if item.is_file() and item.name != manifest.MANIFEST:
            (universal / item.name).symlink_to(os.path.relpath(item, universal))


@torch.no_grad()
def restore_buffers(model: torch.nn.Module, universal: Path) -> None:
    """A universal load restores parameters only; the buffers (the router's balancing bias and load counts) come
    from rank 0's model file, as on a same-size load. Without this the first resumed steps route differently."""
    saved = torch.load(universal / DEEPSPEED_TAG / MODEL_STATES, map_location="cpu", weights_only=True)
    names = set(saved.get("buffer_names") or [])
    for name, buffer in model.named_buffers():
        if name in names:
            buffer.copy_(saved["module"][name])


class UniversalExpertCopy:
    """ZeRO-1/2 with expert parallelism. The ZeRO shards hold every rank's expert block, but DeepSpeed loads the
    module's weights from rank 0's model file (EP rank 0's experts) and does not copy its fp32 master back: `load`
    does. The shards load only at the world and EP sizes that wrote them, so `save` also writes the universal copy
    (`write_universal`) that loads at any size."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def save(self, directory: Path) -> None:
        """Collective: every rank calls it, after Accelerate's save_state into `directory`."""
        write_universal(self.engine, Path(directory))

    def load(self, checkpoint: Path) -> None:
        self.engine.optimizer.update_lp_params()


def write_universal(engine, checkpoint: Path) -> None:
    """Collective: `checkpoint/universal/<tag>/`, DeepSpeed's universal checkpoint of the live ZeRO-1/2 engine.

    DeepSpeed's universal loader slices a stacked [E, …] tensor by (ep_rank, ep_size) when its file says
    `is_expert_param` and `ep_num_experts`, so we write each parameter whole: fp32 master and AdamW moments gathered
    over the parameter's ZeRO group (safe_get_full_*), expert blocks then over the EP group. Rank 0 writes; the
    checkpointer links the non-DeepSpeed files beside it, as for a converted copy.
    """
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        EP_IS_EXPERT_PARAM,
        EP_NUM_EXPERTS,
        PARAM,
        PARAM_GROUPS,
        PARAM_SLICE_MAPPINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer, rank = engine.optimizer, dist.get_rank()
    target = Path(checkpoint) / UNIVERSAL_DIRNAME / DEEPSPEED_TAG
    # ZeRO links the moments' fragments after the first param group's first step, before the expert group has
    # any, and never again (safe_get_full_optimizer_state: "exp_avg not found"): relink them.
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()
    step = None
    for parameter in (p for p in engine.module.parameters() if p.requires_grad):
        # the loader opens zero/<name>/ with the name the engine gave the parameter
        name = optimizer.param_names[parameter]
        states = {"fp32": safe_get_full_fp32_param(parameter)}
        states.update({key: safe_get_full_optimizer_state(parameter, key) for key in ADAMW_MOMENTS})
        is_expert = getattr(parameter, "allreduce", True) is False
        if is_expert:  # (E_local, …) → (E, …): the EP ranks hold consecutive blocks in EP-rank order
            ep_group = groups._get_expert_parallel_group(parameter.group_name)
            states = {key: _gather_blocks(value, ep_group) for key, value in states.items()}
        if rank != 0:
            continue
        (target / "zero" / name).mkdir(parents=True, exist_ok=True)
        for key, value in states.items():
            saved = {PARAM: value.float().cpu()}
            if is_expert:
                saved.update({EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: value.shape[0]})
            torch.save(saved, target / "zero" / name / f"{key}.pt")
        if step is None:
            first = optimizer.optimizer.param_groups[0]["params"][0]
            step = optimizer.optimizer.state[first]["step"]
        torch.save(step, target / "zero" / name / "step.pt")
    if rank == 0:
        state = optimizer.state_dict()
        global_state = {
            key: value
            for key, value in state.items()
            if key not in (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)
        }
        # The loader copies every key of a saved param group into the live one: without 'name' and 'moe', a
        # run at another EP size keeps its own group names (ep_size_<its EP>).
        global_state[PARAM_GROUPS] = [
            {key: value for key, value in group.items() if key not in ("params", "name", "moe")}
            for group in state[BASE_OPTIMIZER_STATE][PARAM_GROUPS]
        ]
        torch.save(global_state, target / "zero" / "optimizer_state.pt")
        # metadata the engine reads on load (step counters, dp_world_size); its module weights are not used
        shutil.copy2(Path(checkpoint) / DEEPSPEED_TAG / MODEL_STATES, target)
        (target.parent / "latest_universal").write_text(DEEPSPEED_TAG)
    dist.barrier()


def _gather_blocks(block: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    blocks = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
    dist.all_gather(blocks, block.contiguous(), group=group)
    return torch.cat(blocks)


def state_dict_from_universal(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model of a ZeRO checkpoint from its universal copy: every parameter's fp32 file (experts already whole,
    [E, …]), and from rank 0's model file the buffers and the second names of tied parameters."""
    universal = checkpoint / UNIVERSAL_DIRNAME / DEEPSPEED_TAG
    if not (universal / "zero").is_dir():
        raise CheckpointError(
            f"{checkpoint} holds ZeRO shards of an expert-parallel run but no {UNIVERSAL_DIRNAME}/ copy (an older "
            "version wrote it), and DeepSpeed's zero_to_fp32 cannot consolidate them: resume it once and save again"
        )
    model_file = torch.load(universal / MODEL_STATES, map_location="cpu", weights_only=True)
    state = dict(model_file["module"])  # buffers; its parameters (EP rank 0's experts) are all replaced below
    for directory in (universal / "zero").iterdir():
        if directory.is_dir():
            state[directory.name] = torch.load(directory / "fp32.pt", map_location="cpu", weights_only=True)["param"]
    for name, source in (model_file.get("shared_params") or {}).items():
        state[name] = state[source]
    return state
