"""What each rank really holds of parameters, master weights, gradients and optimizer state, measured, beside the
ledger's figure for the same rank (`moe.ledger.training_state_bytes_per_rank`): the check that the ledger says what
the strategies allocate, not what they should.

Where each strategy keeps its share (torch 2.13, DeepSpeed 0.19.8):
  * parameters: the module's, whole (DDP; under EP the rank's expert block), this rank's shard (FSDP2: the local
    tensor of each DTensor; ZeRO-3: `p.ds_tensor`), or views of DeepSpeed's flat buffer (ZeRO-1/2, the same bytes);
  * master weights: DeepSpeed's fp32 partitions, which are the base optimizer's parameters (ZeRO-1/2
    `single_partition_of_fp32_groups`, ZeRO-3 `fp32_partitioned_groups_flat`); elsewhere the parameters are the
    master and nothing is counted;
  * gradients: what the base optimizer steps on. DDP and FSDP2: the parameters' `.grad` (local shards), read after
    clipping. DeepSpeed steps inside `backward` and hands its torch optimizer one fp32 gradient partition per group,
    freed after that group's step, so they are read by a step pre-hook on the base optimizer during the first step;
  * optimizer state: AdamW's m and v (tensors with a dimension; the step counter is not state bytes).
Counted as numel × element size of what each rank's tensors cover: FSDP2 also pads each parameter's shard storage to
⌈rows / shards⌉ rows, and DeepSpeed its flat buffers to an alignment, neither of which is counted here or in the
ledger (a few rows per tensor).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor

from moe.config import ModelConfig
from moe.ledger import RunShape, stored_params_per_rank, training_state_bytes_per_rank

# The order of the measured figures in the one gather `record` makes.
FIGURES = ("params", "param_bytes", "master_bytes", "grad_bytes", "optimizer_state_bytes")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard, a ZeRO-3 parameter's partition, else the tensor."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return getattr(tensor, "ds_tensor", tensor)


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


class Footprint:
    """Measures, once per run, what this rank stores, and reports it for every rank beside the ledger.

    `module`: the unwrapped model (FSDP2's, ZeRO-3's or a plain one); `optimizer`: the torch AdamW under the wrappers;
    `engine`: the DeepSpeed engine under strategy=deepspeed, else None. Call `measure_gradients()` after clipping in
    every step (it measures the first time only) and `record()` once after a step (collective)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        accelerator: Accelerator,
        model: ModelConfig,
        run: RunShape,
        engine: Any = None,
    ) -> None:
        self.module, self.optimizer, self.accelerator, self.engine = module, optimizer, accelerator, engine
        self.pipelined = run.pipeline_size > 1
        # Under PP each pipeline rank holds its own stages: the ledger's figure for every rank (rank r runs pipeline
        # rank r // (W/PP), parallel/pipeline.py), else one figure for all.
        pipeline_ranks = [r // run.dp_size for r in range(accelerator.num_processes)] if self.pipelined else [None]
        self.ledger = [training_state_bytes_per_rank(model, run, p) for p in pipeline_ranks]
        self.ledger_params = [stored_params_per_rank(model, run, p) for p in pipeline_ranks]
        self.grad_bytes: int | None = None
        self._partition_grads: dict[int, int] = {}
        # DeepSpeed steps inside backward (before `measure_gradients` is called) and frees each partition's gradient
        # after its group's step: seen at the step itself.
        self._hook = optimizer.register_step_pre_hook(self._see_partition_grads) if engine is not None else None

    def _see_partition_grads(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """DeepSpeed steps one parameter group at a time (only that group is in `param_groups` then), on its fp32
        partition whose `.grad` is the group's gradient partition."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._partition_grads[id(p)] = _bytes([p.grad])

    def measure_gradients(self) -> None:
        """Right after clipping, before the optimizer step frees them; only the first call measures."""
        if self.grad_bytes is not None:
            return
        if self._hook is not None:  # the engine has stepped already, inside backward
            self._hook.remove()
            self.grad_bytes = sum(self._partition_grads.values())
        else:
            self.grad_bytes = _bytes(p.grad for p in self.module.parameters() if p.grad is not None)

    def measured(self) -> dict[str, int]:
        """This rank's own figures (before any gather)."""
        params = list(self.module.parameters())
        own = {id(p) for p in params}
        optimizer_params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {
            "params": sum(_local(p).numel() for p in params),
            "param_bytes": _bytes(params),
            "master_bytes": _bytes(self._master_partitions(own, optimizer_params)),
            "grad_bytes": self.grad_bytes if self.grad_bytes is not None else 0,
            "optimizer_state_bytes": _bytes(
                t
                for state in self.optimizer.state.values()
                for t in state.values()
                if torch.is_tensor(t) and t.ndim > 0
            ),
        }

    def _master_partitions(self, own: set[int], optimizer_params: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.engine is None:
            return [p for p in optimizer_params if id(p) not in own]  # none: DDP and FSDP2 step the parameters
        zero = self.engine.optimizer
        # ZeRO-3 swaps its partitions in and out of the torch optimizer's groups, so ask the ZeRO optimizer.
        partitions = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(
            zero, "fp32_partitioned_groups_flat", None
        )
        return list(partitions) if partitions is not None else [p for p in optimizer_params if id(p) not in own]

    def record(self) -> dict[str, Any]:
        """Collective: each rank's measured figures (a list over ranks) beside the ledger's for one rank (under PP a
        list over ranks too: each holds its own stages)."""
        mine = self.measured()
        local = torch.tensor([mine[name] for name in FIGURES], dtype=torch.int64, device=self.accelerator.device)
        per_rank = self.accelerator.gather(local).view(-1, len(FIGURES)).t().tolist()
        measured = dict(zip(FIGURES, per_rank, strict=True))
        ledger = {
            "params": self.ledger_params,
            "param_bytes": [state.weights for state in self.ledger],
            "master_bytes": [state.master for state in self.ledger],
            "grad_bytes": [state.gradients for state in self.ledger],
            "optimizer_state_bytes": [state.optimizer for state in self.ledger],
        }
        if not self.pipelined:  # one figure serves every rank
            ledger = {name: figures[0] for name, figures in ledger.items()}
        record = {}
        for name in FIGURES:
            record[f"memory/{name}_per_rank"] = measured[name]
            record[f"ledger/{name}_per_rank"] = ledger[name]
        return record
