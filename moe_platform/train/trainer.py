"""The training loop. `fit()` is short on purpose: read it to know the order of every step.

Per optimizer step, on every rank:
  1. set the learning rate for this step (a pure function of the step, so resume needs only the step)
  2. for each of the `grad_accum` micro-batches: forward → loss = LM loss + Σ per-layer MoE aux losses (+ the
     multi-token-prediction loss, moe/mtp.py) →
     backward (Accelerate divides by grad_accum, or DeepSpeed does; a non-finite loss makes every gradient NaN) →
     collect the MoE layers' raw counts
  3. on the last micro-batch Accelerate/DeepSpeed all-reduce the gradients (under expert parallelism the experts'
     over their expert-data-parallel group: parallel/expert_parallel.py; FSDP2 reduce-scatters them after every
     micro-batch's backward: parallel/fsdp.py), clip, and step the optimizer, unless the
     global grad norm is not finite (DeepSpeed checks it itself): then no rank steps, and `trainer.on_nan` skips the
     step or halts, naming the first module whose output was non-finite (nan_guard.py)
  4. one aux-loss-free balancing-bias update per MoE layer (counts summed over ranks; none in a skipped step)
  5. at the step boundary each rank records the step in the c10d store (liveness.py names a dead or hung rank by it),
     and the ranks agree whether a preemption signal arrived (an all-reduce of a flag that no rank waits for: its
     sum is read at the next boundary, preemption.py)
  6. every `log_every` steps: reduce losses and expert statistics over ranks, write one record, and one record per
     routing alert (a layer's MaxVio or drops too high, or an expert dead, for M logs in a row: monitor/alerts.py)
  7. every `eval_every` steps: evaluate; every `save_every` steps: checkpoint (every rank first checks its weights
     are finite; if not, nothing is written and the run halts: nan_guard.py)
  8. when preempted: log the window, every rank saves, requeue (preemption.py), stop
One step per run (the second) is measured for peak memory and printed at the end beside the ledger's prediction
(monitor/peak_memory.py); on CPU that step is left out of tokens/s, since the profiler slows it.
"""

import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from data_pipeline import build_loaders
from moe import format_ledger, matmul_flops_per_token
from moe.moe_layer import balancing_routers, step_balancing_biases
from moe.stats import MoEStats
from moe_platform import faults
from moe_platform.checkpoint.checkpointer import Checkpointer, CheckpointPart
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.checkpoint.experts import ExpertCheckpoint
from moe_platform.checkpoint.layout import CheckpointLayout
from moe_platform.checkpoint.sharded import ShardedState, ShardedStateReader
from moe_platform.checkpoint.universal import UniversalExpertCopy
from moe_platform.config import TrainConfig
from moe_platform.monitor.alerts import RoutingAlerts
from moe_platform.monitor.data_mix import MixtureWindow, TimedBatches
from moe_platform.monitor.footprint import Footprint
from moe_platform.monitor.metrics import MetricSinks, reduce_moe_stats
from moe_platform.monitor.peak_memory import PeakMemoryProbe, predict_peak, predicted_peak_per_rank
from moe_platform.monitor.progress import Progress
from moe_platform.monitor.throughput import Throughput
from moe_platform.parallel import deepspeed_experts, expert_parallel, fsdp
from moe_platform.parallel.accelerator import unwrapped_module
from moe_platform.train.liveness import Liveness
from moe_platform.train.materialize import build_meta
from moe_platform.train.model_build import build_model
from moe_platform.train.nan_guard import NanGuard, NumericalFault, poison_nonfinite
from moe_platform.train.optimizers import build_optimizer, param_groups
from moe_platform.train.preemption import PreemptionWatch
from moe_platform.train.qk_clip import AttentionLogits

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Counters a resume needs besides model, optimizer, RNG and data position; saved as JSON
    (checkpoint/checkpointer.py)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    skipped_steps: int = 0  # of those steps, the ones skipped for a NaN/Inf loss or gradient (nan_guard.py)
    skipped_in_a_row: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every saved counter must be an integer; a counter added since the checkpoint was written keeps its
        default, but `step` and `tokens_seen` are required."""
        for name, value in asdict(self).items():
            saved = state.get(name, value if name not in ("step", "tokens_seen") else None)
            if not isinstance(saved, int) or isinstance(saved, bool):
                raise CheckpointError(f"the checkpoint's trainer state has {name}={saved!r}, not an integer")
            setattr(self, name, saved)


class LogWindow:
    """What happened since the last log line: steps, losses, the last grad norm, MoE counts, training time."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.steps, self.losses, self.grad_norm, self.stats = 0, [], float("nan"), {}
        self.untimed_steps, self.untimed_s = 0, 0.0

    def add(
        self,
        lm_loss: float,
        aux_loss: float,
        mtp_loss: float,
        grad_norm: float,
        stats: dict[int, MoEStats],
        applied: bool = True,
    ) -> None:
        self.steps += 1
        self.grad_norm = grad_norm
        if applied:  # a skipped step's losses and routing counts stay out of the means, as in Megatron's
            self.losses.append((lm_loss, aux_loss, mtp_loss))
            self.stats = _add_stats(self.stats, stats)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def tokens_per_s(self, tokens_per_step: int) -> float:
        """Over the timed steps; a window of untimed steps only falls back to their own time."""
        if self.steps > self.untimed_steps:
            return (self.steps - self.untimed_steps) * tokens_per_step / self.elapsed()
        return self.steps * tokens_per_step / (self.elapsed() + self.untimed_s)

    @contextlib.contextmanager
    def untimed(self):
        """A step inside (one measured under the memory profiler) counts for neither time nor tokens."""
        begin = time.perf_counter()
        with self.paused():
            yield
        self.untimed_steps += 1
        self.untimed_s += time.perf_counter() - begin

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (eval, checkpoints) does not count as training time."""
        begin = time.perf_counter()
        yield
        self.start += time.perf_counter() - begin


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        run_dir: Path,
        accelerator: Accelerator,
        grad_accum: int,
        config_yaml: str,
        layout: CheckpointLayout,
        resume_from: list[Path] | None = None,
    ) -> None:
        self.config, self.run_dir, self.accelerator = config, Path(run_dir), accelerator
        self.grad_accum, self.config_yaml, self.resume_from = grad_accum, config_yaml, resume_from

        # Data-parallel rank d of D reads the d-th share; under PP the stages of a pipeline (ranks p·D + d) read alike
        dp_size = accelerator.num_processes // config.distributed.pipeline_parallel_size
        with accelerator.main_process_first():  # tokenize once; the other ranks read the datasets cache
            self.data = build_loaders(
                config.data,
                rank=accelerator.process_index % dp_size,
                world_size=dp_size,
                micro_batch_size=config.trainer.micro_batch_size,
                model_vocab_size=config.model.vocab_size,
                total_samples=config.samples_to_train,
            )
        self._deepspeed = config.distributed.strategy == "deepspeed"
        self._fsdp = config.distributed.strategy == "fsdp"
        # Under PP this rank's stages (train/pipeline_step.py), built on the meta device like FSDP's shards
        self.pipeline = None
        if config.distributed.pipeline_parallel_size > 1:  # imported here: torch.distributed.pipelining is ~1 s
            from moe_platform.train.pipeline_step import PipelineTraining

            self.pipeline = PipelineTraining(config, accelerator)
        # FSDP builds the model sharded (train/materialize.py); seeds first: loading the data may have drawn on a rank
        model = build_model(config, accelerator, shard=self._sharding())
        faults.poison_outputs(model, lambda: self.state.step + 1)  # reliability tests only (MOE_FAULTS)
        self.model, self.optimizer = self._parallelize(model)
        # Each group's peak lr, which the schedule scales every step (a resume restores the groups' last lr instead)
        self.peak_lrs = [group["lr"] for group in self.optimizer.param_groups]
        # The module inside the engine, looked up once: Accelerate's unwrap_model reads package metadata on every
        # call (is_deepspeed_available), ~1% of a ZeRO-2 step when done per step.
        self.module = unwrapped_module(self.model, accelerator, self._deepspeed)
        self.bias_routers = balancing_routers(self.module)  # found once: the walk costs 0.15 ms a step (bench)

        self.attention_logits = AttentionLogits(model, config)  # S_max per head, and QK-clip (train/qk_clip.py)
        self.state = TrainState()
        self.nan_guard = NanGuard(config.trainer, accelerator, self.model, self.state, self.run_dir)
        if self.pipeline is not None:  # a step's forwards replayed through the stages, NaNs named in stage order
            self.nan_guard.replay, self.nan_guard.stage_of = self.pipeline.logits, self.pipeline.stage_of_module
        state = {"trainer": self.state, "data": self.data.train}  # JSON in every checkpoint
        self.checkpointer = Checkpointer(
            self.run_dir, accelerator, config.trainer.keep_last, layout, state, self._checkpoint_parts(model),
            config.trainer.save_retries,
        )  # fmt: skip
        self._resume(resume_from or [])  # before the sinks open: a resume rewinds metrics.jsonl to its step
        self.sinks = MetricSinks(
            self.run_dir, asdict(config), config.logging, accelerator.is_main_process, self.state.step
        )
        self.alerts = RoutingAlerts(config.logging, accelerator.is_main_process)
        self.data_mix = MixtureWindow(self.data.train, config.data.seq_len)  # per-source tokens of a mixture
        self.preemption = PreemptionWatch(config.preemption, self.run_dir, accelerator)
        self.liveness = Liveness(accelerator, self.run_dir, config.distributed.timeout_s)
        self.throughput = Throughput(
            flops_per_token=matmul_flops_per_token(config.model, config.data.seq_len).training,
            num_devices=accelerator.num_processes,
            configured_tflops=config.logging.peak_tflops,
            precision=config.trainer.precision,
        )
        self.tokens_per_step = config.data.global_batch_size * config.data.seq_len
        self.run_shape = config.run_shape(accelerator.num_processes)  # the ledger's view: start, footprint, end
        engine = self.model if self._deepspeed else None  # what each rank holds: measured at the first log
        self.footprint = Footprint(
            self.module, self._base_optimizer(), accelerator, config.model, self.run_shape, engine
        )
        # One step's peak, printed beside the ledger's at the end (logging.peak_memory=false: none measured).
        self.peak_memory = PeakMemoryProbe(accelerator.device, enabled=config.logging.peak_memory)
        on_gpu = accelerator.device.type == "cuda"
        self.predicted_peaks = predicted_peak_per_rank(config, accelerator.num_processes, on_gpu=on_gpu)

    def _sharding(self):
        """What build_model applies to the structure on the meta device: the pipeline split, FSDP2, or nothing."""
        if self.pipeline is not None:
            return self.pipeline.split
        return self._shard_fsdp if self._fsdp else None

    def _shard_fsdp(self, model: torch.nn.Module) -> None:
        """Collective: FSDP2's meshes, this rank's expert block, `fully_shard` (on the meta device: build_model)."""
        dist = self.config.distributed
        self.meshes = fsdp.build_meshes(self.accelerator.device.type, dist.fsdp.replicate_size,
                                        dist.expert_parallel_size)  # fmt: skip
        fsdp.shard_model(model, self.meshes, fsdp.sharding_policy(self.config))

    def _parallelize(self, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Collective: split the experts over EP ranks (if asked), then replicate or ZeRO-shard the model as the
        strategy says and build the optimizer on what this rank holds. Under FSDP2 the model came sharded from
        build_model, and Accelerate prepares neither model nor optimizer (parallel/fsdp.py says why)."""
        if self.pipeline is not None:  # the stages' data parallelism is pipeline_step's, not Accelerate's
            from moe_platform.train.pipeline_step import token_mean_loss

            self.meshes = self.pipeline.meshes.stage
            self.expert_groups = self.pipeline.meshes.expert_groups
            self.pipeline.start(lambda logits, labels: poison_nonfinite(token_mean_loss(logits, labels)))
            return model, self._build_optimizer(model)
        if self._fsdp:
            self.expert_groups = self.meshes.expert_groups
            return model, self._build_optimizer(model)
        self.meshes = None
        ep_size = self.config.distributed.expert_parallel_size
        self.expert_groups = expert_parallel.attach(model, ep_size, self._deepspeed)
        return self.accelerator.prepare(model, self._build_optimizer(model))

    # ---- the loop ------------------------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        self._print_start()
        trainer = self.config.trainer
        end_step = trainer.stop_at or trainer.max_steps
        train_batches = self.train_batches = TimedBatches(iter(self.data.train))  # the wait is logged (data_mix.py)
        last, preempted = {}, False
        with Progress(trainer.max_steps, self.state.step, enabled=self._show_progress()) as progress:
            window = LogWindow()
            while self.state.step < end_step:
                with self.peak_memory.around_step(window):  # measures one step: peak bytes vs the ledger
                    window.add(*self.train_step(train_batches))
                self.state.step += 1
                self.state.tokens_seen += self.tokens_per_step
                self.liveness.step_done(self.state.step)  # names this rank's last step if another one waits on it
                preempted = self.preemption.requested()  # collective: every rank stops after the same step
                if self.state.step % trainer.log_every == 0 or self.state.step == end_step or preempted:
                    last = self._log(window)
                    progress.update(self.state.step, last)
                    window = LogWindow()
                if preempted:
                    break
                with window.paused():  # tokens/s and FLOP/s count training time only
                    if trainer.eval_every and self.state.step % trainer.eval_every == 0 and self.data.evaluates:
                        last.update(self._log_eval())
                    if trainer.save_every and self.state.step % trainer.save_every == 0:
                        self.save()
        if preempted:
            return self._stop_for_preemption(last)
        if self.data.evaluates and not (trainer.eval_every and end_step % trainer.eval_every == 0):
            last.update(self._log_eval())
        if (trainer.save_final or end_step < trainer.max_steps) and not (
            trainer.save_every and end_step % trainer.save_every == 0
        ):
            self.save()
        self._print_end(last)
        self._close()
        return last

    def _stop_for_preemption(self, last: dict[str, Any]) -> dict[str, Any]:
        """Every rank saves this step, then rank 0 requeues the job (or says how to continue)."""
        checkpoint = self.save()
        self._close()
        message = self.preemption.after_checkpoint(self.state.step, checkpoint)
        if self.accelerator.is_main_process:
            print(message, flush=True)
        return {**last, "preempted": True}

    def _halt(self, message: str) -> NoReturn:
        """Stop for a NaN/Inf (nan_guard.py) on every rank together: the CLI prints the message and exits with 4."""
        self._close()
        raise NumericalFault(message)

    def _close(self) -> None:
        """However the loop ends: the metric sinks flushed and closed, the preemption flag's last sum taken in and
        the signal handlers put back (collective with several ranks)."""
        self.sinks.close()
        self.preemption.close()

    def train_step(self, batches) -> tuple[float, float, float, float, dict[int, MoEStats], bool]:
        """One optimizer step over `grad_accum` micro-batches; returns this rank's mean losses (LM, aux, MTP), the grad
        norm, the MoE layers' raw counts summed over the micro-batches, and whether the update was applied
        (nan_guard.py)."""
        for group, peak in zip(self.optimizer.param_groups, self.peak_lrs, strict=True):
            group["lr"] = self.config.optim.lr_at(self.state.step, self.config.trainer.max_steps, peak)
        if self.pipeline is not None:
            return self._pipeline_step(batches)
        lm_losses, aux_losses, mtp_losses, stats, grad_norm, inputs, applied = [], [], [], {}, float("nan"), [], True
        step = self.state.step + 1  # the step being run, as faults.py counts
        for _ in range(self.grad_accum):
            batch = next(batches)
            inputs.append(batch)  # kept to find where a NaN began, should one appear
            with self.accelerator.accumulate(self.model):
                faults.point("forward", step)
                labels = batch["labels"].to(self.accelerator.device)
                output = self.model(
                    batch["input_ids"].to(self.accelerator.device),
                    document_ids_BT=batch.get("document_ids"),
                    labels_BT=labels if self.config.model.mtp.depth else None,
                )
                lm_loss = F.cross_entropy(output.logits.float().flatten(0, 1), labels.flatten())
                faults.point("backward", step)
                self.accelerator.backward(poison_nonfinite(lm_loss + output.aux_loss + output.mtp_loss))
                if self.accelerator.sync_gradients:  # the last micro-batch: only here is there a step to take
                    grad_norm, applied = self._update()
            lm_losses.append(lm_loss.detach())
            aux_losses.append(output.aux_loss.detach().float())
            mtp_losses.append(output.mtp_loss.detach().float())
            stats = _add_stats(stats, _moe_stats(output))
        totals = [lm + aux + mtp for lm, aux, mtp in zip(lm_losses, aux_losses, mtp_losses, strict=True)]
        self._after_update(step, applied, inputs, totals)
        lm_loss, aux_loss, mtp_loss = (float(torch.stack(each).mean()) for each in (lm_losses, aux_losses, mtp_losses))
        return lm_loss, aux_loss, mtp_loss, grad_norm, stats, applied

    def _update(self) -> tuple[float, bool]:
        """After the step's last backward: clip, and step unless the global grad norm is not finite (the same
        verdict on every rank); returns the norm and whether the update went in."""
        grad_norm = self._clip_gradients()
        self.footprint.measure_gradients()  # the first step's, before the step frees them
        applied = self.nan_guard.step_is_finite(grad_norm)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, applied

    def _after_update(self, step: int, applied: bool, inputs: list[dict], losses: list[torch.Tensor]) -> None:
        """The aux-free bias moves after an applied step (counts summed over the ranks sharing the layers: a
        stage's under PP); a withheld one goes to the NaN guard, which skips it or halts."""
        if applied:
            step_balancing_biases(self.bias_routers, group=self.pipeline.meshes.dp_group if self.pipeline else None)
            self.attention_logits.after_step()  # QK-clip rescales after the update, as K2 does
            self.nan_guard.step_applied()
        else:
            self.attention_logits.discard()  # a withheld step's logits clip nothing
            if halt := self.nan_guard.after_nonfinite_step(step, inputs, losses):
                self._halt(halt)
        faults.point("step_end", step)

    def _pipeline_step(self, batches) -> tuple[float, float, float, float, dict[int, MoEStats], bool]:
        """One optimizer step through the pipeline schedule (train/pipeline_step.py); returns what train_step does,
        with LM and MTP losses of 0 on ranks without the last stage (the log's reduction counts the last stage's)."""
        step = self.state.step + 1
        inputs = [next(batches) for _ in range(self.grad_accum)]
        faults.point("forward", step)
        faults.point("backward", step)  # inside the schedule both run micro-batch by micro-batch
        lm_losses, aux_loss, mtp_loss, stats = self.pipeline.forward_backward(inputs)
        grad_norm, applied = self._update()
        self._after_update(step, applied, inputs, lm_losses or [aux_loss])
        lm_loss = float(torch.stack(lm_losses).mean()) if lm_losses else 0.0
        return lm_loss, float(aux_loss), float(mtp_loss), grad_norm, stats, applied

    def _checkpoint_parts(self, model: torch.nn.Module) -> list[CheckpointPart]:
        """What checkpoints hold beside Accelerate's files: under FSDP every rank's shards through DCP; experts by
        global id (DDP, single), and there the reader of an FSDP run's DCP shards; or under DeepSpeed with EP the
        universal copy and the experts restored into the module on load."""
        if self.pipeline is not None:  # a stage's part of the model, under the unsplit names
            whole_groups = partial(param_groups, optim=self.config.optim)
            order = self.pipeline.whole_model_order(build_meta(self.config), whole_groups)
            return [ShardedState(model, self.optimizer, self.meshes.experts, order)]
        if self._fsdp:
            return [ShardedState(model, self.optimizer, self.meshes.experts)]
        if self._deepspeed:
            return [UniversalExpertCopy(self.model)] if self.expert_groups is not None else []
        ep = self.expert_groups.expert_parallel if self.expert_groups is not None else None
        parts: list[CheckpointPart] = [ShardedStateReader(model, self._base_optimizer(), ep)]
        if self.config.model.moe is not None:
            parts.insert(0, ExpertCheckpoint(model, self._base_optimizer(), ep, self.accelerator))
        return parts

    def _build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW, or Muon with AdamW (optim.name, train/optimizers.py); under DeepSpeed with EP the experts get their
        own parameter groups (parallel/deepspeed_experts.py)."""
        groups = param_groups(model, self.config.optim)
        if self._deepspeed and self.expert_groups is not None:
            groups = deepspeed_experts.optimizer_param_groups(groups)
        return build_optimizer(groups, self.config.optim)

    def _clip_gradients(self) -> float:
        """The pre-clip global grad norm. DeepSpeed clips inside its step (gradient_clipping in its config)."""
        max_norm = self.config.optim.grad_clip or math.inf
        if self.pipeline is not None:  # every stage's gradients in one norm
            return self.pipeline.clip_gradients(max_norm)
        if self._fsdp:  # shards on two meshes: each counted once (parallel/fsdp.py)
            return fsdp.clip_grad_norm(self.module, max_norm)
        if self.expert_groups is not None and not self._deepspeed:
            return expert_parallel.reduce_and_clip(self.module, max_norm, self.expert_groups)
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(norm) if norm is not None else float("nan")

    def evaluate(self) -> dict[str, float]:
        """Mean token loss over the validation pass; for a mixture each source's own (`eval/loss/<name>`), and
        `eval/loss` their mean at the mixture's weights (Σ w_i·loss_i: the loss of the mixture the run trains on)."""
        metrics = {}
        if self.data.val_by_source:
            weights = self.data.train.source_weights()
            for name, loader in self.data.val_by_source.items():
                metrics[f"eval/loss/{name}"] = self._eval_loss(loader)
            loss = math.fsum(weights[name] * metrics[f"eval/loss/{name}"] for name in self.data.val_by_source)
            loss /= math.fsum(weights[name] for name in self.data.val_by_source)
        else:
            loss = self._eval_loss(self.data.val)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)), **metrics}

    @torch.no_grad()
    def _eval_loss(self, loader) -> float:
        """Mean token loss over one validation pass: its first `data.val.max_batches` global batches, the same
        samples on any world size."""
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        for batch in loader:
            logits = self._eval_logits(batch)
            if logits is None:  # a pipeline rank without the last stage: its part is done
                continue
            labels = batch["labels"].to(self.accelerator.device)
            loss_sum += F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum").double()
            tokens += labels.numel()
        self.model.train()
        totals = self.accelerator.reduce(torch.stack([loss_sum, tokens]), reduction="sum")
        return float(totals[0] / totals[1])

    def _eval_logits(self, batch: dict) -> torch.Tensor | None:
        if self.pipeline is not None:
            return self.pipeline.logits(batch)
        ids = batch["input_ids"].to(self.accelerator.device)
        return self.model(ids, document_ids_BT=batch.get("document_ids")).logits

    def save(self) -> Path:
        if fault := self.nan_guard.nonfinite_weights(self.state.step):  # collective: never checkpoint a NaN
            self._halt(fault)
        path = self.checkpointer.save(self.state.step, self.config_yaml)
        if self.accelerator.is_main_process:
            log.info("saved checkpoint %s", path)
        return path

    # ---- helpers ---------------------------------------------------------------------------------------------------

    def _resume(self, candidates: list[Path]) -> None:
        """Load the first intact candidate (none: a fresh start), then set aside checkpoints of later steps."""
        if candidates:
            path = self.checkpointer.load(candidates)
            # Accelerate restores its micro-step counter too; checkpoints sit on optimizer-step boundaries, and
            # with a different world size the accumulation count differs, so it must restart at a boundary.
            self.accelerator.step = 0
            if self.accelerator.is_main_process:
                log.info("resumed from %s at step %d", path, self.state.step)
        self.checkpointer.set_aside_later_than(self.state.step)

    def _log(self, window: LogWindow) -> dict[str, Any]:
        # When this log began, in UTC: stamps of two logs bound whole steps and one whole log (bench/trainer_overhead).
        now = datetime.now(timezone.utc).isoformat()
        window_losses = window.losses or [
            (math.nan, math.nan, math.nan)
        ]  # every step of the window skipped (nan_guard.py)
        losses = torch.tensor(window_losses, dtype=torch.float64, device=self.accelerator.device).mean(dim=0)
        # Σ over ranks / D: the mean over data-parallel ranks (all ranks without PP); under PP the LM and MTP losses
        # are the last stage's (0 elsewhere) and the aux loss the sum of every stage's
        losses = self.accelerator.reduce(losses, reduction="sum") / self._dp_size()
        tokens_per_s = window.tokens_per_s(self.tokens_per_step)
        record: dict[str, Any] = {
            "step": self.state.step,
            "time": now,
            "loss": float(losses[0]),
            "aux_loss": float(losses[1]),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": window.grad_norm,
            "tokens_per_s": tokens_per_s,
            **self.throughput.record(tokens_per_s),
            "tokens_seen": self.state.tokens_seen,
            **self.nan_guard.record(),
        }
        if self.config.model.mtp.depth:  # L_MTP, already weighted; "loss" stays the LM loss alone
            record["mtp_loss"] = float(losses[2])
        stats = self.pipeline.pad_stats(window.stats) if self.pipeline is not None else window.stats
        record.update(reduce_moe_stats(self.accelerator, stats))
        record.update(self.attention_logits.record())
        if self.state.step <= self.config.trainer.log_every:  # once: the optimizer state exists after a step
            record.update(self.footprint.record())  # what each rank holds, beside the ledger
        record.update(self.peak_memory.record(self.accelerator, self.predicted_peaks))  # once: the measured step's
        record.update(self.data_mix.record())
        record.update(self.train_batches.record(window.elapsed()))
        self.sinks.write(record)
        for alert in self.alerts.check(record):  # router collapse, drops, dead experts held for M logs
            self.sinks.write(alert)
        return record

    def _ranks_of_the_batch(self) -> str:
        if self.pipeline is None:
            return f"ranks {self.accelerator.num_processes}"
        run, stages = self.pipeline.run, self.pipeline.layout.num_stages
        return (
            f"data-parallel ranks {run.dp_size}; a pipeline of {run.pipeline_size} ranks, {stages} stages, "
            f"{run.schedule} over {run.microbatches} micro-batches"
        )

    def _dp_size(self) -> int:
        return self.pipeline.dp_size if self.pipeline is not None else self.accelerator.num_processes

    def _base_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer under Accelerate's and DeepSpeed's wrappers (its state holds this rank's shard)."""
        optimizer = self.optimizer
        while hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        return optimizer

    def _log_eval(self) -> dict[str, float]:
        metrics = self.evaluate()
        self.sinks.write({"step": self.state.step, **metrics})
        if self.accelerator.is_main_process:
            log.info("step %d  eval/loss %.4f", self.state.step, metrics["eval/loss"])
        return metrics

    def _show_progress(self) -> bool:
        return self.config.logging.progress_bar and self.accelerator.is_main_process

    def _print_start(self) -> None:
        if not self.accelerator.is_main_process:
            return
        config = self.config
        lines = [
            f"run dir: {self.run_dir}",
            f"{self.accelerator.num_processes} rank(s), {self.accelerator.distributed_type.value}, "
            f"model wrapped as {type(self.model).__name__}, "
            f"device {self.accelerator.device}, {config.trainer.precision}; global batch "
            f"{config.data.global_batch_size} = micro {config.trainer.micro_batch_size} × accumulation "
            f"{self.grad_accum} × {self._ranks_of_the_batch()}",
            self.throughput.describe(),
        ]
        if self.data.entropy_floor is not None:
            lines.append(f"synthetic data entropy floor: {self.data.entropy_floor:.4f} nats/token")
        print("\n".join(lines) + "\n\n" + format_ledger(config.model, self.run_shape) + "\n", flush=True)

    def _print_end(self, last: dict[str, Any]) -> None:
        if not self.accelerator.is_main_process:
            return
        line = f"finished step {self.state.step}: train loss {last.get('loss', float('nan')):.4f}"
        if "eval/loss" in last:
            line += f", eval loss {last['eval/loss']:.4f}"
        floor = self.data.entropy_floor
        if floor is not None and "eval/loss" in last:
            line += f"; entropy floor {floor:.4f} (eval loss is {100 * (last['eval/loss'] / floor - 1):+.1f}% above)"
        if not self.config.logging.peak_memory:
            print(line, flush=True)
            return
        pipeline_rank = self.pipeline.meshes.pipeline_rank if self.pipeline is not None else None  # its own stages
        predicted = predict_peak(self.config.model, self.run_shape, pipeline_rank)
        print(line + "\n" + self.peak_memory.describe(predicted), flush=True)


def _moe_stats(output) -> dict[int, MoEStats]:
    return {i: out.stats for i, out in enumerate(output.moe_outputs) if out is not None}


def _add_stats(total: dict[int, MoEStats], new: dict[int, MoEStats]) -> dict[int, MoEStats]:
    """Per-layer raw counts, summed layer by layer."""
    merged = dict(total)
    for layer, stats in new.items():
        merged[layer] = merged[layer] + stats if layer in merged else stats
    return merged
