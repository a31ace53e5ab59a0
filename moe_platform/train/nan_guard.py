"""Numerical faults: a NaN/Inf loss or gradient stops the optimizer step on every rank, before any weight changes.

Then `trainer.on_nan=skip` skips the step (no weight, AdamW-moment or routing-bias update; the step counter, the LR
schedule and the data order go on, as Megatron counts skipped iterations) and halts at the `nan_max_consecutive`-th
such step in a row; `on_nan=halt` stops at the first. Either way the message names the step, the first module whose
output was non-finite, its rank and micro-batch, and the last good checkpoint; the CLI exits with code 4. Before any
checkpoint every rank checks its weights, so a checkpoint with a non-finite weight is never written.

How a fault is seen, on every strategy, from one number that every rank already shares:
  * `poison_nonfinite` turns a non-finite loss into NaN gradients (its backward multiplies every gradient by NaN):
    an Inf loss can have finite gradients (an -inf logit on the label), and would otherwise update the weights.
  * The gradient reduction spreads a NaN or Inf to every rank (a sum with a NaN is NaN), so the global grad norm,
    taken from reduced gradients, is non-finite on all ranks or on none: DDP's all-reduced grads under torch's
    clip_grad_norm_, and under expert parallelism `expert_parallel.reduce_and_clip` (the expert-data-parallel
    all-reduce of the expert grads, then the EP all-reduce of their norm). No extra flag needs all-reducing.
  * DeepSpeed steps inside `accelerator.backward`. Measured on deepspeed 0.19.8 (2 ranks, NaN injected in step 3):
    ZeRO-1, -2 and -3, in fp32 and in bf16, check the global norm (reduced over ranks) before their step and skip
    it when it is not finite: the weights after step 3 equal those after step 2, and the engine reports
    `was_step_applied() == False`, which is what the guard reads. Stage 0 in bf16 checks too (BF16_Optimizer), but
    stage 0 in fp32 steps the plain torch optimizer unchecked (NaN weights after step 3): TrainConfig refuses it.
On a fault every rank re-runs the step's forwards (no grad, RNG untouched; ranks run together, since a forward may
hold collectives) with hooks that note the first module whose output is non-finite; the ranks agree on the earliest
(micro-batch, module in execution order, rank).
"""

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor

from moe_platform.checkpoint.catalog import latest_checkpoint
from moe_platform.config import TrainerConfig
from moe_platform.parallel.accelerator import unwrapped_module

log = logging.getLogger(__name__)


class NumericalFault(RuntimeError):
    """The run stopped on a non-finite loss, gradient or weight; the message says where and names the last good
    checkpoint (the CLI prints it and exits with code 4)."""


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, whose backward makes every gradient NaN when it is not finite (no host sync)."""
    # A scale computed from the detached loss: torch.where(finite, loss, loss * nan) would send 0 · NaN = NaN back
    # through its unused branch and poison every step.
    return loss * torch.where(torch.isfinite(loss.detach()), 1.0, math.nan)


class NanGuard:
    """Decides, per optimizer step, whether the update may be applied; skips or halts when not (see the module doc).

    The counters a resume needs live in the trainer's state: `skipped_steps` (all so far) and `skipped_in_a_row`."""

    def __init__(self, config: TrainerConfig, accelerator: Accelerator, model: nn.Module, state, run_dir: Path):
        self.on_nan, self.max_in_a_row = config.on_nan, config.nan_max_consecutive
        self.accelerator, self.model, self.state, self.run_dir = accelerator, model, state, Path(run_dir)
        self.engine = model if hasattr(model, "was_step_applied") else None  # a DeepSpeed engine
        self.module = unwrapped_module(model, accelerator, deepspeed=self.engine is not None)  # inside the wrapper
        self.skipped_in_window = 0
        # How `_locate` re-runs a micro-batch's forward, and the stage of each module (pipeline_step.py sets both)
        self.replay: Callable[[dict], Any] = self._forward
        self.stage_of: Callable[[str], int] = lambda name: 0

    def step_is_finite(self, grad_norm: float) -> bool:
        """After the step's last backward and clipping: may the update be applied? The same answer on every rank.
        Under DeepSpeed the engine has already checked, and skipped its step if not."""
        if self.engine is not None:
            return self.engine.was_step_applied()
        return math.isfinite(grad_norm)

    def after_nonfinite_step(self, step: int, batches: list[dict], losses: list[torch.Tensor]) -> str | None:
        """Collective, on every rank once the update of `step` was withheld: drop the step's routing counts, find
        where the fault began, count it; returns the message to halt with, or None to go on (the step skipped).
        `batches` and `losses` are this rank's micro-batches of the step and their total losses."""
        origin = self._locate(batches, losses)
        _drop_balancing_counts(self.module)  # the step's forwards' and _locate's
        self.state.skipped_steps += 1
        self.state.skipped_in_a_row += 1
        self.skipped_in_window += 1
        what = f"non-finite {origin['kind']} at step {step}"
        if self.on_nan == "halt":
            return f"{what}: {origin['where']}; {self._last_good()}; set trainer.on_nan=skip to skip such steps"
        if self.state.skipped_in_a_row >= self.max_in_a_row:
            return (
                f"{what}, the last of {self.state.skipped_in_a_row} in a row (trainer.nan_max_consecutive="
                f"{self.max_in_a_row}): {origin['where']}; {self._last_good()}; find the cause (data, learning rate, "
                "a faulty device) before resuming from it"
            )
        if self.accelerator.is_main_process:
            in_a_row, limit = self.state.skipped_in_a_row, self.max_in_a_row
            log.warning(f"{what}, skipped: {origin['where']} ({in_a_row} in a row; {limit} in a row stop the run)")
        return None

    def step_applied(self) -> None:
        """The step's update went in: a streak of skipped steps ends."""
        self.state.skipped_in_a_row = 0

    def record(self) -> dict[str, int]:
        """The log record's counters: skipped steps in this log window, and since the run began (resumes included)."""
        record = {"nan/skipped_steps": self.skipped_in_window, "nan/skipped_steps_total": self.state.skipped_steps}
        self.skipped_in_window = 0
        return record

    def nonfinite_weights(self, step: int) -> str | None:
        """Collective, before every checkpoint: the message to halt with if any rank holds a non-finite weight (its
        own ZeRO-3 partition, or expert block under EP), else None."""
        names, tensors = [], []
        for name, tensor in _local_weights(self.module):
            names.append(name)
            tensors.append(torch.isfinite(tensor).all())
        finite = torch.stack(tensors).tolist() if tensors else []
        own = next((name for name, ok in zip(names, finite, strict=True) if not ok), None)
        flag = torch.tensor([own is not None], dtype=torch.int32, device=self.accelerator.device)
        if _world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return None
        rank, name = next((rank, name) for rank, name in enumerate(_gather(own)) if name is not None)
        return (
            f"the weights after step {step} are not finite ({name} on rank {rank}): its checkpoint was not written; "
            f"{self._last_good()}"
        )

    # ---- where the fault began ---------------------------------------------------------------------------------

    @torch.no_grad()
    def _locate(self, batches: list[dict], losses: list[torch.Tensor]) -> dict[str, str]:
        """Re-run this step's forwards with hooks; agree over ranks on the earliest non-finite module output."""
        device = self.accelerator.device
        first_output = None  # (micro-batch, module index in execution order, module name) on this rank
        position = {"micro_batch": 0, "order": 0}

        def note(name: str):
            def hook(module, inputs, output) -> None:
                nonlocal first_output
                position["order"] += 1
                if first_output is None and not all(torch.isfinite(t).all() for t in _float_tensors(output)):
                    first_output = (position["micro_batch"], self.stage_of(name), position["order"], name)

            return hook

        named = [(name, module) for name, module in self.module.named_modules() if name]
        handles = [module.register_forward_hook(note(name)) for name, module in named]
        devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):  # the diagnosis draws no number the training would
                for micro_batch, batch in enumerate(batches):
                    position.update(micro_batch=micro_batch, order=0)
                    self.replay(batch)
        finally:
            for handle in handles:
                handle.remove()
        first_loss = next((i for i, loss in enumerate(losses) if not torch.isfinite(loss).all()), None)
        reports = _gather((first_output, first_loss))
        kind = "loss" if any(loss is not None for _, loss in reports) else "gradient"
        outputs = [(*out[:3], rank, out[3]) for rank, (out, _) in enumerate(reports) if out is not None]
        if outputs:
            micro_batch, _, _, rank, name = min(outputs)  # the first micro-batch, then stage, then module
            where = f"it first appears in the output of {name} (rank {rank}, micro-batch {micro_batch})"
        elif kind == "loss":
            rank, micro_batch = next((rank, loss) for rank, (_, loss) in enumerate(reports) if loss is not None)
            where = f"every module's output is finite but the loss is not (rank {rank}, micro-batch {micro_batch})"
        else:
            where = "the loss and every module's output are finite: it arises in the backward pass"
        return {"kind": kind, "where": where}

    def _forward(self, batch: dict) -> Any:
        device = self.accelerator.device
        return self.model(batch["input_ids"].to(device), document_ids_BT=batch.get("document_ids"))

    def _last_good(self) -> str:
        checkpoint = latest_checkpoint(self.run_dir)
        return f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint has been written yet"


def _float_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors in a module's output (a tensor, or tuples, lists, dicts, dataclasses of them)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _float_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _float_tensors(item)
    elif is_dataclass(value) and not isinstance(value, type):
        for field in fields(value):
            yield from _float_tensors(getattr(value, field.name))


def _local_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter as this rank stores it (ZeRO-3: its partition `ds_tensor`; FSDP2: its DTensor's local shard),
    and the floating buffers."""
    for name, parameter in model.named_parameters():
        stored = getattr(parameter, "ds_tensor", parameter).detach()
        yield name, stored.to_local() if isinstance(stored, DTensor) else stored
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            yield name, buffer


def _drop_balancing_counts(model: nn.Module) -> None:
    """A skipped step updates no routing bias: forget the loads its forwards counted (moe/router.py)."""
    for module in model.modules():
        counts = getattr(module, "load_since_update", None)
        if isinstance(counts, torch.Tensor):
            counts.zero_()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (collective)."""
    if _world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * _world_size()
    dist.all_gather_object(gathered, value)
    return gathered
