"""Expert weights and their optimizer moments (AdamW's, or Muon's momentum) stored by global expert id, so a run
resumes at any expert-parallel size.

    step_…/experts/experts_{first:05d}_{stop:05d}.safetensors   the expert rows [first, stop) of every MoE layer's
                                                                w_gate / w_up / w_down, and `<name>.exp_avg(_sq)`
                                                                (AdamW) or `<name>.momentum_buffer` (Muon)

Under EP the ranks 0…EP-1 (one per expert block) each write their block and Accelerate's model file carries no
expert tensor. A resume reads the rows its own block needs from whichever files hold them. A checkpoint written
without EP has the whole expert tensors in Accelerate's model and optimizer files instead; they are sliced the same
way. (Accelerate's optimizer file still holds rank 0's expert moments under EP: they are overwritten on load, at the
cost of some disk.) ZeRO checkpoints keep the experts in DeepSpeed's shards instead (checkpoint/universal.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from moe.expert_parallel import ExpertParallel, expert_parameters, is_expert_parameter
from moe_platform.checkpoint.errors import CheckpointError

EXPERTS_DIRNAME = "experts"
ADAMW_MOMENTS = (
    "exp_avg",
    "exp_avg_sq",
)  # AdamW's per-element state; its scalar `step` is the same for every parameter
MOMENTS = (*ADAMW_MOMENTS, "momentum_buffer")  # and Muon's (train/optimizers.py): a parameter has one kind or the other


class ExpertCheckpoint:
    """Saves and loads this rank's expert block (all experts without EP) by global id; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        expert_parallel: ExpertParallel | None,
        accelerator: Accelerator,
    ) -> None:
        self.optimizer, self.expert_parallel = optimizer, expert_parallel
        self.parameters = dict(expert_parameters(model))
        self._from_model_file: dict[str, torch.Tensor] = {}
        for module_name, module in model.named_modules():
            owned = {short: f"{module_name}.{short}" for short, _ in module.named_parameters(recurse=False)}
            owned = {short: name for short, name in owned.items() if name in self.parameters}
            if owned:
                module._register_load_state_dict_pre_hook(self._set_aside_hook(owned))
        if self.sharded:  # `save` writes the experts, so Accelerate's model file leaves them out
            accelerator.register_save_state_pre_hook(self._drop_experts_from_model_file)

    @property
    def sharded(self) -> bool:
        return self.expert_parallel is not None and self.expert_parallel.size > 1

    def _drop_experts_from_model_file(self, models, weights, output_dir) -> None:
        for state in weights:
            for key in [k for k in state if is_expert_parameter(k)]:
                del state[key]

    def _set_aside_hook(self, owned: dict[str, str]):
        def set_aside(state_dict, prefix, *args) -> None:
            """An expert tensor in the model file (of any EP's shape, or absent) is kept aside for `load`, and the
            module's own tensor stands in for it so that Accelerate's strict load passes."""
            for short, name in owned.items():
                key = f"{prefix}{short}"
                if key in state_dict:
                    self._from_model_file[name] = state_dict[key]
                state_dict[key] = self.parameters[name].detach()

        return set_aside

    def save(self, directory: Path) -> None:
        """Not collective: under EP, ranks 0…EP-1 (the first rank of every expert-data-parallel group) write."""
        if not self.sharded or dist.get_rank() >= self.expert_parallel.size:
            return
        from safetensors.torch import save_file

        block = self._block()
        tensors = {}
        for name, parameter in self.parameters.items():
            tensors[name] = parameter.detach().contiguous()
            state = self.optimizer.state.get(parameter, {})
            tensors.update({f"{name}.{m}": state[m].contiguous() for m in MOMENTS if m in state})
        target = Path(directory) / EXPERTS_DIRNAME
        target.mkdir(exist_ok=True)
        save_file(tensors, str(target / f"experts_{block.start:05d}_{block.stop:05d}.safetensors"))

    @torch.no_grad()
    def load(self, checkpoint: Path) -> None:
        """After Accelerate's load_state: this rank's expert rows and their moments, from either layout."""
        block = self._block()
        shards = expert_shard_files(Path(checkpoint) / EXPERTS_DIRNAME)
        for name, parameter in self.parameters.items():
            if shards:
                rows = read_expert_rows(shards, name, block)
            elif name in self._from_model_file:
                rows = self._from_model_file[name][block.start : block.stop]
            else:
                raise CheckpointError(f"{checkpoint} holds no weights for {name}: is it a checkpoint of this model?")
            _check_shape(checkpoint, name, rows, parameter)
            parameter.copy_(rows)
            state = self.optimizer.state.get(parameter, {})
            for moment in [m for m in MOMENTS if m in state]:
                if shards:
                    rows = read_expert_rows(shards, f"{name}.{moment}", block)
                else:  # the optimizer file held the whole tensors, just loaded into `state`
                    rows = state[moment][block.start : block.stop]
                _check_shape(checkpoint, f"{name}.{moment}", rows, parameter)
                state[moment] = rows.to(device=parameter.device, dtype=state[moment].dtype).clone()
        self._from_model_file.clear()

    def _block(self) -> range:
        """This rank's global expert ids (all of them without EP)."""
        num_local = next(iter(self.parameters.values())).shape[0]
        if self.expert_parallel is None:
            return range(num_local)
        return self.expert_parallel.local_experts(num_local * self.expert_parallel.size)


def _check_shape(checkpoint: Path, name: str, rows: torch.Tensor, parameter: torch.Tensor) -> None:
    if rows.shape != parameter.shape:
        raise CheckpointError(
            f"{checkpoint}: {name} has shape {tuple(rows.shape)} for this rank's experts but the model needs "
            f"{tuple(parameter.shape)}: the checkpoint is of another model (check model.* against its config.yaml)"
        )


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


def consolidated_experts(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every expert tensor [E, …] of an expert-parallel checkpoint, its blocks joined in global-id order."""
    from safetensors import safe_open

    shards = expert_shard_files(Path(checkpoint) / EXPERTS_DIRNAME)
    if not shards:
        return {}
    with safe_open(str(next(iter(shards.values()))), framework="pt") as f:
        names = [key for key in f.keys() if not key.endswith(tuple(f".{moment}" for moment in MOMENTS))]
    num_experts = max(ids.stop for ids in shards)
    return {name: read_expert_rows(shards, name, range(0, num_experts)) for name in names}
