"""`init.from_path`: the weights a fresh run starts from, read from a checkpoint, an export or a Hugging Face model.

The source's model config must be the run's `model.*` (a contradiction is refused, naming the key), so the weights
load exactly; with `init.upcycle=true` the source is dense and `upcycle.py` turns its FFNs into the run's experts.
Loading happens in `train/model_build.py`, after the model is built and before anything wraps or shards it: expert
parallelism (`expert_parallel.attach`) slices the full experts afterwards, and under ZeRO-3 each parameter is
gathered, filled and partitioned again. Under FSDP the model is built sharded, and each tensor is read and handed to
a filler that keeps this rank's shard.

A Hugging Face directory is read in two steps (interop/hf/): `adopt_source_model` reads config.json alone, so the
memory check that follows it runs before anything large is read; `initial_state_dict` then gives a lazy state
dict, and `load_initial_weights` reads and converts one of our tensors at a time from the memory-mapped
safetensors shards straight into the parameter it fills, and under expert parallelism only this rank's block of
expert rows. Our checkpoints and .pt exports are read whole, as they always were, and so is the dense source of
upcycling (its FFNs become every expert).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from moe import ModelConfig
from moe.expert_parallel import is_expert_parameter
from moe_platform.checkpoint.catalog import latest_checkpoint
from moe_platform.checkpoint.consolidate import export_fp32_state_dict
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.config import ConfigError, TrainConfig, load_run_config
from moe_platform.interop.hf import LazyStateDict, hf_model_config, read_hf_dir
from moe_platform.interop.upcycle import upcycle_state_dict

# Fields that shape no weight and change no loaded number, only how the run trains (or, max_seq_len, how far it
# reads; learned positions are a weight, whose shape the strict load checks; absorb_decode, how a cached MLA decode
# runs, with the same logits up to rounding): a run may set them its own way. A Hugging Face config has no say on
# them at all.
_FREE_FIELDS = (
    "model.dropout",
    "model.mla.absorb_decode",
    "model.init_std",
    "model.max_seq_len",
    "model.moe.capacity_factor",
    "model.moe.eval_capacity_factor",
    "model.moe.min_capacity",
    "model.moe.drop_policy",
    "model.moe.experts_impl",
    "model.moe.aux_loss_coef",
    "model.moe.z_loss_coef",
    "model.moe.aux_loss_scope",
    "model.moe.router.jitter_eps",
)


def adopt_source_model(cfg: DictConfig, overrides: list[str]) -> bool:
    """Read `model.*` from init.from_path's own config: unless the command line picks `model=...`, the run's model
    node becomes the source's (upcycling keeps the composed `model.moe`), and the command line's own `model.x=...`
    overrides go back on top, for `check_same_model` (or upcycling's check) to judge. A .pt file has no config; a
    Hugging Face directory's is its config.json, read alone (no weight). Returns whether `cfg.model` changed."""
    from_path = OmegaConf.select(cfg, "init.from_path")
    keys = [override.lstrip("+~").split("=", 1)[0] for override in overrides]
    if from_path is None or "model" in keys:
        return False
    path = _resolve(Path(from_path))
    if path.is_dir() and (path / "config.json").is_file():
        source = OmegaConf.structured(hf_model_config(path))
    elif path.is_dir() and (path / "config.yaml").is_file():
        source = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path / "config.yaml").model)
    else:
        return False
    if OmegaConf.select(cfg, "init.upcycle"):
        source.moe = cfg.model.moe
    for key in keys:
        if key.startswith("model."):
            OmegaConf.update(source, key.removeprefix("model."), OmegaConf.select(cfg, key), force_add=True)
    cfg.model = source
    return True


def _resolve(path: Path) -> Path:
    """A run dir stands for its newest complete checkpoint."""
    if path.is_dir() and (newest := latest_checkpoint(path)) is not None:
        return newest
    return path


def initial_state_dict(config: TrainConfig) -> Mapping[str, torch.Tensor] | None:
    """The fp32 state dict `Transformer(config.model)` starts from, or None for a random init; for a Hugging Face
    directory a LazyStateDict that reads each tensor only when `load_initial_weights` asks for it."""
    if config.init.from_path is None:
        return None
    source_config, state = read_source(Path(config.init.from_path), config)
    if config.init.upcycle:
        return upcycle_state_dict(source_config, state, config.model, seed=config.trainer.seed)
    check_same_model(source_config, config.model)
    return state


def read_source(path: Path, config: TrainConfig) -> tuple[ModelConfig, Mapping[str, torch.Tensor]]:
    """(model config, fp32 state dict) of an init source; a bare .pt carries no config, so the run's is taken
    (its dense twin when upcycling) and the strict load checks it. A Hugging Face directory's state is lazy
    (`hf.read_hf_dir`: refused now if ours cannot compute it exactly or a tensor is missing, read later)."""
    if path.is_dir() and (path / "config.json").is_file():
        return read_hf_dir(path)
    path = _resolve(path)
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise CheckpointError(
                f"init.from_path={path} has no config.yaml: give a checkpoints/step_XXXXXXXX dir, a run dir, "
                "a moe-export .pt file or a Hugging Face model dir"
            )
        return load_run_config(path / "config.yaml").model, export_fp32_state_dict(path)
    if path.is_file():
        state = torch.load(path, map_location="cpu", weights_only=True)
        source_is_moe = any(".experts." in name for name in state)
        source_config = config.model
        if config.init.upcycle:
            if source_is_moe:
                raise ConfigError(f"init.from_path={path} holds MoE experts: upcycling starts from a dense model")
            source_config = dataclasses.replace(config.model, moe=None)
        return source_config, {name: t.float() if t.is_floating_point() else t for name, t in state.items()}
    raise ConfigError(f"init.from_path={path} does not exist: give a checkpoint dir, a .pt file or a HF model dir")


def check_same_model(source: ModelConfig, model: ModelConfig) -> None:
    """Refuse, naming the key, a run whose `model.*` contradicts the config its initial weights were trained with."""
    if model.moe is not None and source.moe is None:
        raise ConfigError(
            "model.moe is set but init.from_path holds a dense model: add init.upcycle=true to turn its FFNs into "
            "experts, or set model.moe=null"
        )
    if model.moe is None and source.moe is not None:
        raise ConfigError(
            "model.moe is null but init.from_path holds an MoE model: pick the MoE config it was trained with"
        )
    for key, ours, theirs in _differences(model, source, "model."):
        if key not in _FREE_FIELDS:
            raise ConfigError(
                f"{key}={ours!r} contradicts {theirs!r} in init.from_path's config: drop the override or set "
                f"{key}={theirs!r}"
            )


def _differences(ours, theirs, prefix: str):
    """(key, our value, their value) for each field where two configs differ, descending into nested configs."""
    for field in dataclasses.fields(ours):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            yield from _differences(a, b, f"{prefix}{field.name}.")
        elif a != b:
            yield f"{prefix}{field.name}", a, b


@torch.no_grad()
def load_initial_weights(
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    partitioned: bool,
    local_experts: range | None = None,
    fill: Callable[[str, torch.Tensor], None] | None = None,
    whole_model: torch.nn.Module | None = None,
) -> None:
    """Copy `state` into `model` exactly (strict: no key missing or extra, every shape equal), one tensor at a time.
    Partitioned (ZeRO-3) parameters are gathered one at a time and partitioned again with the values every rank
    copied. A LazyStateDict is read here, tensor by tensor, its experts one expert at a time; with `local_experts`
    (this rank's block under expert parallelism) only those rows of each expert tensor are read and filled, since
    `shard_experts` keeps only them. A model already sharded (FSDP, train/materialize.py) is filled through
    `fill(name, whole tensor or this rank's expert rows)`, which keeps this rank's shard of it. A pipeline stage's
    model holds some of the pieces: the source is checked against `whole_model` (the unsplit structure, on the meta
    device) and only the stage's tensors are read."""
    expected = set((whole_model if whole_model is not None else model).state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        which = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which the model does not"
        raise ConfigError(
            f"init.from_path's weights do not fit model.*: the source {which} ({len(missing)} missing, "
            f"{len(unexpected)} unexpected)"
        )
    for name, p in model.named_parameters():
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if fill is not None and local_experts is not None and is_expert_parameter(name):
            shape = (model.config.moe.num_experts, *shape[1:])  # sharded: p holds this rank's block of experts
        expert_rows = state.expert_rows(name) if isinstance(state, LazyStateDict) else None
        if expert_rows is not None:  # [E, …]: the count now, each expert's shape as it is read
            _check_shape(name, (expert_rows.num_experts, *shape[1:]), shape)
            experts = local_experts if local_experts is not None else range(expert_rows.num_experts)
            if fill is not None:
                fill(name, torch.cat([expert_rows.read(e, e + 1) for e in experts]))
                continue
            with _gathered(p, partitioned):
                for e in experts:
                    rows = expert_rows.read(e, e + 1)  # one expert: [1, D, F] or [1, F, D]
                    _check_shape(name, (expert_rows.num_experts, *rows.shape[1:]), shape)
                    p.data[e : e + 1].copy_(rows)
            continue
        tensor = state[name]
        _check_shape(name, tuple(tensor.shape), shape)
        if fill is not None:
            fill(name, tensor)
        else:
            with _gathered(p, partitioned):
                p.data.copy_(tensor)
        del tensor  # a lazy source's read: freed before the next one is read
    for name, buffer in model.named_buffers():
        if name in state:  # non-persistent buffers (RoPE tables) are not in a state dict
            if fill is not None:
                fill(name, state[name])
            else:
                buffer.copy_(state[name])


def _check_shape(name: str, source: tuple[int, ...], model: tuple[int, ...]) -> None:
    if source != model:
        raise ConfigError(f"init.from_path's {name} has shape {source} but the model's is {model}")


def _gathered(p: torch.nn.Parameter, partitioned: bool):
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([p], modifier_rank=0)
