"""Checkpoints of FSDP runs through torch.distributed.checkpoint (DCP): every rank writes its own shards, and the
checkpoint loads at any other layout (world size, EP size, FSDP or HSDP, DDP or one process).

    step_…/dcp/.metadata          DCP's index of every tensor's chunks (a pickle: manifest.py scans its opcodes
                                  before DCP unpickles it)
    step_…/dcp/__{rank}_0.distcp  that rank's chunks: `model.<name>` for every entry of the module's state dict
                                  (parameters, and buffers such as the routers' balancing bias) and
                                  `optim.<name>.{exp_avg,exp_avg_sq,step}` for AdamW's state of every parameter
                                  (`optim.<name>.momentum_buffer` for a parameter Muon steps)

Every tensor is saved under its global shape, so the files do not depend on the layout that wrote them. Under EP a
rank's expert tensor is its block [E/EP, …] sharded again over its edp group; on the 2-D (ep, edp) expert mesh with
placements (Shard(0), Shard(0)) the same local shards are the whole [E, …] tensor, experts by global id as DDP's
checkpoints keep them (experts.py). The moments are viewed the same way.

Loads, by the kinds of run and checkpoint (the checkpointer hands a part the formats it names in `reads`):
  * FSDP run, DCP checkpoint: in place into this rank's shards; DCP reads each rank's byte ranges only.
  * FSDP run, Accelerate's files (a DDP or single-process run): the whole tensors (model.safetensors, experts by
    global id, optimizer.bin) are read one at a time and each rank keeps its shard.
  * DDP or single-process run, DCP checkpoint (`ShardedStateReader`): whole tensors, with no collective (one
    process needs no process group), the experts then cut to the rank's block.
AdamW creates its state at its first step, and DCP loads only into tensors that exist: a resume first takes one step
with zero gradients at lr 0, which moves no weight, and the load overwrites the state it made. Only tensors are
loaded: DCP unpickles a non-tensor entry with weights_only=False, so a checkpoint whose index claims one is refused
(the chunks of tensors load with weights_only=True).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from moe.expert_parallel import ExpertParallel, is_expert_parameter
from moe_platform import faults
from moe_platform.checkpoint.catalog import is_step_dir, step_of
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.checkpoint.experts import EXPERTS_DIRNAME, MOMENTS, expert_shard_files, read_expert_rows
from moe_platform.checkpoint.layout import ACCELERATE, DCP, CheckpointLayout

DCP_DIRNAME = "dcp"
MODEL, OPTIM = "model.", "optim."
OPTIMIZER_STATE = (*MOMENTS, "step")  # AdamW's m, v and step count; Muon's momentum


class ShardedState:
    """An FSDP run's model and AdamW state, through DCP (see the module docstring). `expert_mesh` is the experts'
    2-D (ep, edp) mesh under EP, None without it."""

    reads = (DCP, ACCELERATE)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        expert_mesh: DeviceMesh | None,
        whole_model_order: list[list[str]] | None = None,
    ) -> None:
        """`whole_model_order`: a pipeline stage's model holds part of the parameters; the names of the whole
        model's optimizer groups, in order, number the entries of a one-process run's optimizer.bin."""
        self.model, self.optimizer, self.expert_mesh = model, optimizer, expert_mesh
        self.whole_model_order = whole_model_order

    def save(self, directory: Path) -> None:
        """Collective: every rank writes its shards into `directory/dcp`."""
        writer = _ShardWriter(Path(directory) / DCP_DIRNAME, step=_step_being_saved(Path(directory)))
        try:
            dcp.save(self._global_state(), storage_writer=writer)
        except CheckpointException as err:  # a BaseException, which the checkpointer's phases would not catch
            raise _first_failure(err) from None

    @torch.no_grad()
    def load(self, checkpoint: Path) -> None:
        """Collective: this rank's shards, from a DCP checkpoint or from a DDP or single-process one."""
        materialize_adamw_state(self.optimizer)
        state = self._global_state()
        if CheckpointLayout.read(checkpoint).format == DCP:
            saved = _tensor_keys(checkpoint)
            _drop_state_not_saved(self.model, self.optimizer, saved)
            state = {key: tensor for key, tensor in state.items() if key in saved}
            try:
                dcp.load(state, checkpoint_id=Path(checkpoint) / DCP_DIRNAME, planner=_TensorsOnly())
            except CheckpointException as err:
                raise CheckpointError(f"{checkpoint}: DCP could not load it ({_first_failure(err)})") from None
            return
        whole = WholeTensors(checkpoint, self.model, self.optimizer, self.whole_model_order)
        _drop_state_not_saved(self.model, self.optimizer, whole.keys())
        for key, target in state.items():
            if key not in whole.keys():
                continue
            source = whole.read(key)
            _check_shape(checkpoint, key, tuple(source.shape), tuple(target.shape))
            copy_into_shard(target, source)

    def _global_state(self) -> dict[str, torch.Tensor]:
        """Every saved tensor by key, each under its global shape; the tensors share this rank's storage, so a
        DCP load into them fills the model and optimizer."""
        return {
            key: self._global(name, tensor) if tensor.ndim else tensor
            for key, (name, tensor) in state_tensors(self.model, self.optimizer).items()
        }

    def _global(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An expert block sharded over its edp group, seen as the whole [E, …] tensor on the expert mesh."""
        if self.expert_mesh is None or not is_expert_parameter(name):
            return tensor
        ep_size = self.expert_mesh.size(0)
        shape = torch.Size((tensor.shape[0] * ep_size, *tensor.shape[1:]))
        if isinstance(tensor, DTensor):  # FSDP: the block sharded over edp
            local, placements = tensor.to_local(), (Shard(0), Shard(0))
        else:  # DDP inside a pipeline stage: the block whole on each of its edp ranks
            local, placements = tensor, (Shard(0), Replicate())
        return DTensor.from_local(local, self.expert_mesh, placements, shape=shape, stride=_contiguous(shape))


class ShardedStateReader:
    """A DDP or single-process run's side of an FSDP run's DCP checkpoint: whole tensors into the module and AdamW
    (each rank reads them itself, with no collective), under EP the experts cut to this rank's block. It writes
    nothing: Accelerate's files and the expert shards hold this run's own checkpoints."""

    reads = (DCP,)

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, expert_parallel: ExpertParallel | None
    ) -> None:
        self.model, self.optimizer, self.expert_parallel = model, optimizer, expert_parallel

    def save(self, directory: Path) -> None:
        """Nothing: this run's own checkpoints are Accelerate's files and the expert shards (experts.py)."""

    @torch.no_grad()
    def load(self, checkpoint: Path) -> None:
        materialize_adamw_state(self.optimizer)
        saved = _tensor_keys(checkpoint)
        _drop_state_not_saved(self.model, self.optimizer, saved)
        targets = {key: t for key, (_, t) in state_tensors(self.model, self.optimizer).items() if key in saved}
        # whole tensors (experts [E, …]: the rank's rows are cut below), in the run's dtypes
        whole = read_dcp_tensors(checkpoint, targets, {key: tensor.dtype for key, tensor in targets.items()})
        for key, target in targets.items():
            source = whole[key]
            if self._is_expert_block(key, target):
                block = self.expert_parallel.local_experts(source.shape[0])
                source = source[block.start : block.stop]
            _check_shape(checkpoint, key, tuple(source.shape), tuple(target.shape))
            target.copy_(source)

    def _is_expert_block(self, key: str, tensor: torch.Tensor) -> bool:
        sharded = self.expert_parallel is not None and self.expert_parallel.size > 1
        return sharded and tensor.ndim > 0 and is_expert_parameter(key.removeprefix(MODEL).removeprefix(OPTIM))


class WholeTensors:
    """The whole tensors of a DDP or single-process checkpoint under the keys of `ShardedState`, read one at a time:
    the module's from model.safetensors (or pytorch_model.bin), the experts and their moments from the expert
    shards by global id when the run was expert-parallel, AdamW's from optimizer.bin, whose integer ids number the
    parameters in the order of the optimizer's param groups, the same in every run of the model."""

    def __init__(
        self,
        checkpoint: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        whole_model_order: list[list[str]] | None = None,
    ) -> None:
        from safetensors import safe_open

        self.checkpoint = Path(checkpoint)
        self.expert_shards = expert_shard_files(self.checkpoint / EXPERTS_DIRNAME)
        self.num_experts = max((ids.stop for ids in self.expert_shards), default=0)
        self._model_file = self.checkpoint / "model.safetensors"
        if self._model_file.is_file():
            self._safetensors = safe_open(str(self._model_file), framework="pt")
            in_file = set(self._safetensors.keys())
            self._module = None
        elif (self.checkpoint / "pytorch_model.bin").is_file():
            self._safetensors = None
            self._module = torch.load(self.checkpoint / "pytorch_model.bin", map_location="cpu", weights_only=True)
            in_file = set(self._module)
        else:
            raise CheckpointError(f"{checkpoint} holds neither DCP shards nor a model file: is it a checkpoint dir?")
        # Tied weights (tie_embeddings): one tensor under two names, of which the model file keeps one.
        self._sources: dict[str, str] = {}
        seen: dict[int, str] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            first = seen.setdefault(id(tensor), name)
            if self.expert_shards and is_expert_parameter(name):
                self._sources[f"{MODEL}{name}"] = f"experts:{name}"
            elif name in in_file:
                self._sources[f"{MODEL}{name}"] = f"model:{name}"
            elif first in in_file:
                self._sources[f"{MODEL}{name}"] = f"model:{first}"
        self._optimizer_state = self._read_optimizer(model, optimizer, whole_model_order)

    def keys(self) -> set[str]:
        return set(self._sources) | set(self._optimizer_state)

    def read(self, key: str) -> torch.Tensor:
        if key in self._optimizer_state:
            return self._optimizer_state[key]
        where, name = self._sources[key].split(":", 1)
        if where == "experts":
            return read_expert_rows(self.expert_shards, name, range(self.num_experts))
        if self._safetensors is not None:
            return self._safetensors.get_tensor(name)
        return self._module[name]

    def _read_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, whole_model_order: list[list[str]] | None
    ) -> dict[str, torch.Tensor]:
        path = self.checkpoint / "optimizer.bin"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint holds no optimizer state to resume")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        names = {id(p): name for name, p in model.named_parameters()}
        ours = whole_model_order or [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        held = set(names.values())
        theirs = [group["params"] for group in saved["param_groups"]]
        if [len(group) for group in ours] != [len(group) for group in theirs]:
            raise CheckpointError(
                f"{path} has parameter groups of {[len(g) for g in theirs]} parameters, this model's optimizer "
                f"{[len(g) for g in ours]}: the checkpoint is of another model (check model.* against its config.yaml)"
            )
        state = {}
        for name, index in zip(
            (n for group in ours for n in group), (i for group in theirs for i in group), strict=True
        ):
            if name not in held:  # another pipeline stage's
                continue
            for key, value in saved["state"].get(index, {}).items():
                if key not in OPTIMIZER_STATE:
                    continue
                if key in MOMENTS and self.expert_shards and is_expert_parameter(name):
                    # optimizer.bin holds rank 0's block of an expert-parallel run; the shards hold them all
                    value = read_expert_rows(self.expert_shards, f"{name}.{key}", range(self.num_experts))
                state[f"{OPTIM}{name}.{key}"] = value
        return state


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple[str, torch.Tensor]]:
    """{checkpoint key: (parameter or buffer name, tensor)}: the module's state dict under `model.`, and AdamW's
    state of every parameter that has one under `optim.<name>.{exp_avg,exp_avg_sq,step}`."""
    tensors = {f"{MODEL}{name}": (name, tensor) for name, tensor in model.state_dict().items()}
    for name, parameter in model.named_parameters():
        for key, value in optimizer.state.get(parameter, {}).items():
            if key in OPTIMIZER_STATE:
                tensors[f"{OPTIM}{name}.{key}"] = (name, value)
    return tensors


@torch.no_grad()
def copy_into_shard(target: torch.Tensor, whole: torch.Tensor) -> None:
    """This rank's part of `whole` into `target`: a DTensor keeps its own shard (every rank holds `whole`, so
    nothing is sent), a plain tensor takes all of it."""
    if isinstance(target, DTensor):
        whole = distribute_tensor(
            whole.to(target.to_local().device, target.dtype), target.device_mesh, target.placements,
            src_data_rank=None,
        ).to_local()  # fmt: skip
        target = target.to_local()
    if tuple(whole.shape) != tuple(target.shape):
        raise ValueError(f"a tensor of shape {tuple(whole.shape)} cannot fill a shard of {tuple(target.shape)}")
    target.copy_(whole)


@torch.no_grad()
def materialize_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's (and Muon's) lazily made state so that a checkpoint can be loaded into it: one step with zero
    gradients at lr 0 (p ← p·(1 − 0·wd) − 0·m̂/(√v̂ + ε), or − 0·NS(0), leaves every weight as it was)."""
    fresh = [p for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]
    if not fresh:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in fresh:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in fresh:
        p.grad = None
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def read_dcp_tensors(
    checkpoint: Path, keys: Collection[str], dtypes: Mapping[str, torch.dtype] | None = None
) -> dict[str, torch.Tensor]:
    """Whole tensors `keys` of a DCP checkpoint in this process, with no collective (no process group needed), in
    `dtypes` where given, else as saved. Call after the manifest check: DCP unpickles the index."""
    reader = FileSystemReader(Path(checkpoint) / DCP_DIRNAME)
    index = reader.read_metadata().state_dict_metadata
    state = {}
    for key in keys:
        entry = index.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{checkpoint}: {key} is not a tensor of its DCP index: it was written elsewhere")
        state[key] = torch.empty(entry.size, dtype=(dtypes or {}).get(key, entry.properties.dtype))
    try:
        with warnings.catch_warnings():  # that one process without a process group is meant: it is, by no_dist
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=_TensorsOnly(), no_dist=True)
    except CheckpointException as err:
        raise CheckpointError(f"{checkpoint}: DCP could not load it ({_first_failure(err)})") from None
    return state


def model_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The module's state dict of a DCP checkpoint, whole tensors (experts [E, …]), in one process."""
    state = read_dcp_tensors(checkpoint, [key for key in _tensor_keys(checkpoint) if key.startswith(MODEL)])
    return {key.removeprefix(MODEL): tensor for key, tensor in state.items()}


def _tensor_keys(checkpoint: Path) -> set[str]:
    """The keys of a DCP checkpoint's tensors, read from its index (after the manifest check scanned it)."""
    metadata = FileSystemReader(Path(checkpoint) / DCP_DIRNAME).read_metadata()
    return set(metadata.state_dict_metadata)


def _drop_state_not_saved(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Collection[str]) -> None:
    """A parameter that had no optimizer state when the checkpoint was written (it never had a gradient) gets none
    back: `materialize_adamw_state` made it one, whose step count would shift AdamW's first bias correction."""
    for name, parameter in model.named_parameters():
        if parameter in optimizer.state and not any(f"{OPTIM}{name}.{key}" in saved for key in OPTIMIZER_STATE):
            del optimizer.state[parameter]


class _TensorsOnly(DefaultLoadPlanner):
    """DCP's planner, except that an entry stored as pickled bytes is refused before it is unpickled."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(
            f"{read_item.dest_index.fqn} is stored as a pickled object, not a tensor: refused (a DCP checkpoint of "
            "this platform holds tensors only)"
        )


class _ShardWriter(FileSystemWriter):
    """DCP's file writer, with the fault point `checkpoint_shards` after this rank's files are written and before
    rank 0 writes the index (faults.py: where the reliability tests kill a save)."""

    def __init__(self, path: Path, step: int) -> None:
        super().__init__(path)
        self.step = step

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        faults.point("checkpoint_shards", self.step)
        return written

    def storage_meta(self) -> StorageMeta | None:
        """Without the path written to (the `.tmp_` directory, renamed since): a Path pickles as a class whose
        module differs between Python versions (pathlib, pathlib._local), which manifest.SAFE_GLOBALS would have
        to list."""
        meta = super().storage_meta()
        if meta is not None:
            meta.checkpoint_id = None
        return meta


def _step_being_saved(directory: Path) -> int:
    """The step of the checkpoint written into `directory` (`.tmp_step_…`, checkpointer.py), for the fault point."""
    name = directory.name.removeprefix(".tmp_")
    return step_of(name) if is_step_dir(name) else 0


def _first_failure(err: CheckpointException) -> BaseException:
    """This rank's own error inside a DCP collective if it had one, else the lowest rank's."""
    failures = err.failures
    rank = dist.get_rank() if dist.is_initialized() else 0
    exception, _ = failures.get(rank, failures[min(failures)]) if failures else (err, None)
    return exception if isinstance(exception, Exception) else RuntimeError(str(exception))


def _check_shape(checkpoint: Path, key: str, saved: tuple[int, ...], ours: tuple[int, ...]) -> None:
    if saved != ours:
        raise CheckpointError(
            f"{checkpoint}: {key} has shape {saved} but this run's is {ours}: the checkpoint is of another model "
            "(check model.* against its config.yaml)"
        )


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (a meta tensor: nothing is allocated)."""
    return torch.empty(shape, device="meta").stride()
