"""Expert parallelism in the runtime: process groups, the model's expert shards, their gradients and their norm.

With W ranks and EP = `distributed.expert_parallel_size`:
  * EP groups are blocks of consecutive ranks {g·EP, …, g·EP + EP-1}: rank r holds expert block r mod EP, and
    the all-to-all runs inside its EP group (consecutive ranks share a node when EP ≤ GPUs per node).
  * expert-data-parallel (EDP) groups are the W/EP ranks holding the same block: {j, j+EP, j+2·EP, …}.
  * non-expert weights stay data-parallel over all W ranks (DDP or ZeRO as configured).

Gradients under DDP. Every rank's loss L_r is a mean over its own tokens and DDP averages the replicated weights'
gradients: g = (1/W) Σ_r ∂L_r/∂θ. An expert's local gradient already sums the losses of the EP group's ranks (the
backward all-to-all brings them home), so summing it over the EDP group covers all W ranks once:
    g_expert = (1/W) Σ_{q in EDP} local_grad_q
which `reduce_expert_gradients` computes; DDP is told to leave the expert weights alone.
The global gradient norm adds each distinct expert block once: ‖g‖² = ‖g_replicated‖² + Σ_{p in EP} ‖g_block p‖².
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moe import MoELayer
from moe.expert_parallel import ExpertParallel, is_expert_parameter
from moe_platform.checkpoint import (
    DEEPSPEED_TAG,
    EXPERTS_DIRNAME,
    UNIVERSAL_DIRNAME,
    CheckpointError,
    expert_shard_files,
    read_expert_rows,
)


@dataclass(frozen=True)
class ExpertParallelGroups:
    """This rank's EP group (where tokens travel) and EDP group (where its expert block's gradients are reduced)."""

    expert_parallel: ExpertParallel
    data_group: dist.ProcessGroup | None
    data_size: int
    world_size: int


def build_groups(ep_size: int) -> ExpertParallelGroups:
    """Collective: every rank creates every group, in the same order (torch requires it), and keeps its own."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % ep_size != 0:
        raise ValueError(f"expert_parallel_size={ep_size} does not divide the {world_size} ranks")
    ep_group = data_group = None
    for first in range(0, world_size, ep_size):
        group = dist.new_group(list(range(first, first + ep_size)))
        if first <= rank < first + ep_size:
            ep_group = group
    for block in range(ep_size):
        group = dist.new_group(list(range(block, world_size, ep_size)))
        if rank % ep_size == block:
            data_group = group
    return ExpertParallelGroups(
        expert_parallel=ExpertParallel(size=ep_size, rank=rank % ep_size, group=ep_group),
        data_group=data_group,
        data_size=world_size // ep_size,
        world_size=world_size,
    )


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if is_expert_parameter(name)]


def shard_experts(model: nn.Module, expert_parallel: ExpertParallel) -> None:
    """Keep only this rank's block of every MoE layer's experts and route their work through `expert_parallel`.

    The model was built whole, so its weights are the EP=1 weights whatever the EP size (the same run at any EP
    starts from the same point); the other blocks are freed here. The router and shared experts stay replicated.
    """
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        num_experts = module.config.num_experts
        if num_experts % expert_parallel.size != 0:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {expert_parallel.size} EP ranks")
        block = expert_parallel.local_experts(num_experts)
        for name, weight in list(module.experts.named_parameters(recurse=False)):
            local = weight.detach()[block.start : block.stop].clone()
            setattr(module.experts, name, nn.Parameter(local, requires_grad=weight.requires_grad))
        module.expert_parallel = expert_parallel


def shard_model(model: nn.Module, groups: ExpertParallelGroups) -> None:
    """Keep this rank's expert block, and keep DDP's all-reduce (over all W ranks) off the expert weights."""
    shard_experts(model, groups.expert_parallel)
    # DDP reads this attribute of the module it wraps when it is built.
    model._ddp_params_and_buffers_to_ignore = [name for name, _ in expert_parameters(model)]


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, groups: ExpertParallelGroups) -> None:
    """g_expert = (1/W) Σ_{EDP} local_grad: call after the step's last backward, before clipping."""
    grads = [p.grad for _, p in expert_parameters(model) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if groups.data_size > 1:
        dist.all_reduce(flat, group=groups.data_group)
    flat.div_(groups.world_size)
    pieces = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(pieces, grads, strict=True)])


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, groups: ExpertParallelGroups) -> float:
    """Scale all gradients so the global norm is at most `max_norm` (torch's clipping rule, as without EP);
    returns the norm before clipping."""
    replicated, experts = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (experts if is_expert_parameter(name) else replicated).append(p)
    device = next(model.parameters()).device
    replicated_sq = _sum_of_squares(replicated, device)
    expert_sq = _sum_of_squares(experts, device)
    if groups.expert_parallel.size > 1:
        dist.all_reduce(expert_sq, group=groups.expert_parallel.group)
    total = (replicated_sq + expert_sq).sqrt()
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(replicated + experts, max_norm, total)
    return float(total)


def _sum_of_squares(parameters: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    if not parameters:  # a rank whose expert block got no gradient this step still joins the all-reduce
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([p.grad.double().pow(2).sum() for p in parameters]).sum()


# ---- checkpoints: experts by global id ---------------------------------------------------------------------------

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state; its scalar `step` is the same for every parameter


class ExpertCheckpoint:
    """Expert weights and their AdamW moments, stored by global expert id so a run resumes at any EP size.

    Under EP the ranks 0…EP-1 (one per expert block) each write `experts/experts_{first}_{stop}.safetensors`
    (global ids [first, stop)) and Accelerate's model file carries no expert tensor. A resume reads the rows its
    own block needs from whichever files hold them. A checkpoint written without EP has the whole expert tensors
    in Accelerate's model and optimizer files instead; they are sliced the same way. (Accelerate's optimizer file
    still holds rank 0's expert moments under EP: they are overwritten on load, at the cost of some disk.)
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, groups: ExpertParallelGroups | None):
        self.optimizer, self.groups = optimizer, groups
        self.parameters = dict(expert_parameters(model))
        self._from_model_file: dict[str, torch.Tensor] = {}
        for module_name, module in model.named_modules():
            owned = {short: f"{module_name}.{short}" for short, _ in module.named_parameters(recurse=False)}
            owned = {short: name for short, name in owned.items() if name in self.parameters}
            if owned:
                module._register_load_state_dict_pre_hook(self._set_aside_hook(owned))

    @property
    def sharded(self) -> bool:
        return self.groups is not None and self.groups.expert_parallel.size > 1

    def drop_experts_from_model_file(self, models, weights, output_dir) -> None:
        """Accelerate's save-state hook: under EP `save` writes the experts, so the model file leaves them out."""
        if self.sharded:
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
        if not self.sharded or dist.get_rank() >= self.groups.expert_parallel.size:
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
        if self.groups is None:
            return range(num_local)
        ep = self.groups.expert_parallel
        return ep.local_experts(num_local * ep.size)


def _check_shape(checkpoint: Path, name: str, rows: torch.Tensor, parameter: torch.Tensor) -> None:
    if rows.shape != parameter.shape:
        raise CheckpointError(
            f"{checkpoint}: {name} has shape {tuple(rows.shape)} for this rank's experts but the model needs "
            f"{tuple(parameter.shape)}: the checkpoint is of another model (check model.* against its config.yaml)"
        )


def attach(model: nn.Module, ep_size: int, deepspeed: bool) -> ExpertParallelGroups | None:
    """Collective, before the model is wrapped: build the groups and keep this rank's experts (None without EP)."""
    if ep_size == 1:
        return None
    if deepspeed:
        groups = _deepspeed_groups(ep_size)
        shard_experts(model, groups.expert_parallel)
        _mark_experts_for_deepspeed(model, ep_size)
        return groups
    groups = build_groups(ep_size)
    shard_model(model, groups)
    return groups


# ---- DeepSpeed ZeRO-1/2 ------------------------------------------------------------------------------------------
# DeepSpeed reduces a parameter flagged `allreduce=False` over the expert-data-parallel group named by its
# `group_name`, with the same 1/W scale as the rest (so no correction is needed: see the module docstring), shards
# its optimizer state over that group, and adds every block once into the clipping norm: but only when the engine
# finds a `deepspeed.moe.layer.MoE` module in the model. A parameter-free marker of that class says so; our layer
# does the computing. (Measured on deepspeed 0.19.8, ZeRO-1/2, fp32 and bf16: the same steps as one process.)


def _deepspeed_group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"  # the name deepspeed.utils.groups gives the groups of this EP size


def _deepspeed_groups(ep_size: int) -> ExpertParallelGroups:
    from deepspeed.utils import groups

    groups._create_expert_and_data_parallel(ep_size)  # contiguous EP groups, strided EDP groups, as ours
    name = _deepspeed_group_name(ep_size)
    world_size = dist.get_world_size()
    return ExpertParallelGroups(
        expert_parallel=ExpertParallel(
            size=ep_size, rank=groups._get_expert_parallel_rank(name), group=groups._get_expert_parallel_group(name)
        ),
        data_group=groups._get_expert_data_parallel_group(name),
        data_size=world_size // ep_size,
        world_size=world_size,
    )


def _mark_experts_for_deepspeed(model: nn.Module, ep_size: int) -> None:
    from deepspeed.moe.layer import MoE

    class DeepSpeedMoEMarker(MoE):
        """Tells the engine the model has expert-parallel parameters; it has none itself and never runs."""

        def __init__(self, num_experts: int) -> None:
            nn.Module.__init__(self)  # not MoE.__init__: that would build DeepSpeed's own gate and experts
            self.num_experts, self.ep_size = num_experts, ep_size
            self.expert_group_name = _deepspeed_group_name(ep_size)
            self.num_local_experts = 0  # no per-expert checkpoint files: the ZeRO shards hold the experts

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups exist already (_deepspeed_groups)

        def forward(self, *args, **kwargs):
            raise RuntimeError("the DeepSpeed MoE marker holds no layer")

    for _, parameter in expert_parameters(model):
        parameter.allreduce = False
        parameter.group_name = _deepspeed_group_name(ep_size)
    num_experts = next(m.config.num_experts for m in model.modules() if isinstance(m, MoELayer))
    model.deepspeed_moe_marker = DeepSpeedMoEMarker(num_experts)


def optimizer_param_groups(param_groups: list[dict], groups: ExpertParallelGroups | None, deepspeed: bool):
    """DeepSpeed wants the expert parameters in their own optimizer groups (named after their EDP group)."""
    if groups is None or not deepspeed:
        return param_groups
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(param_groups)


class DeepSpeedExpertRestore:
    """ZeRO-1/2 with EP. The ZeRO shards hold every rank's expert block, but DeepSpeed loads the module's weights
    from rank 0's model file (EP rank 0's experts) and does not copy its fp32 master back: `load` does. The shards
    only load at the world and EP sizes that wrote them, so `save` also writes a universal copy (`write_universal`)
    that loads at any size."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def drop_experts_from_model_file(self, models, weights, output_dir) -> None:
        pass

    def save(self, directory: Path) -> None:
        """Collective: every rank calls it, after Accelerate's save_state into `directory`."""
        write_universal(self.engine, Path(directory))

    def load(self, checkpoint: Path) -> None:
        self.engine.optimizer.update_lp_params()


def write_universal(engine, checkpoint: Path) -> None:
    """Collective: `checkpoint/universal/<tag>/`, DeepSpeed's universal checkpoint of the live ZeRO-1/2 engine.

    ds_to_universal cannot write it for our layer: it joins every rank's expert partitions as if they were one
    tensor's. DeepSpeed's universal loader, though, slices a stacked [E, …] tensor by (ep_rank, ep_size) when its
    file says `is_expert_param` and `ep_num_experts`, so we write each parameter whole: fp32 master and AdamW
    moments gathered over the parameter's ZeRO group (safe_get_full_*), expert blocks then over the EP group.
    Rank 0 writes; `Checkpointer.save` links the non-DeepSpeed files beside it, as `_universal_copy` does.
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
        states.update({key: safe_get_full_optimizer_state(parameter, key) for key in MOMENTS})
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
        shutil.copy2(Path(checkpoint) / DEEPSPEED_TAG / "mp_rank_00_model_states.pt", target)
        (target.parent / "latest_universal").write_text(DEEPSPEED_TAG)
    dist.barrier()


def _gather_blocks(block: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    blocks = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
    dist.all_gather(blocks, block.contiguous(), group=group)
    return torch.cat(blocks)


def reduce_and_clip(model: nn.Module, max_norm: float, groups: ExpertParallelGroups) -> float:
    """The step's gradient sync for the experts (DDP did the rest), then global-norm clipping; the norm before."""
    reduce_expert_gradients(model, groups)
    return clip_grad_norm(model, max_norm, groups)
