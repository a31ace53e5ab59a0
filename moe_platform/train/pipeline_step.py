"""The trainer's side of pipeline parallelism (distributed.pipeline_parallel_size > 1): the stage split at build
time, one optimizer step through the schedule, the global grad norm, evaluation, and the per-stage pieces the log
reduces. The mechanics (meshes, stage modules, schedules) are parallel/pipeline.py's; the layout moe/stages.py's.

One step, on every rank of a pipeline: the step's `grad_accum` loader batches (the same rows on every stage of
the pipeline, read at its data-parallel index) are one batch that the schedule cuts into m micro-batches; the first
stage embeds the ids, the last computes the LM loss per micro-batch (and the MTP loss, from the labels every stage
is handed); then the gradients are synced inside each stage (DDP) or were reduce-scattered by FSDP2, the two
copies of the embedding summed under MTP, and clipped with the norm over all stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from moe import Transformer
from moe.ledger import pipeline_layout
from moe.stages import EMBED
from moe.stats import MoEStats
from moe_platform.config import TrainConfig
from moe_platform.parallel import fsdp, pipeline
from moe_platform.parallel.fsdp import sharding_policy


def token_mean_loss(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """The token-mean cross-entropy of one micro-batch, as one process computes it."""
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten())


class PipelineTraining:
    """This rank's stages, their schedule, and the step's pieces (module docstring)."""

    def __init__(self, config: TrainConfig, accelerator: Accelerator) -> None:
        self.config, self.accelerator = config, accelerator
        self.run = config.run_shape(accelerator.num_processes)
        self.layout = pipeline_layout(config.model, self.run)  # the ledger's: what it counts is what is built
        self.fsdp = config.distributed.strategy == "fsdp"

    # ---- build: called by build_model on the meta device ----------------------------------------------------------

    def split(self, model: Transformer) -> None:
        """Collective: the meshes, this rank's stages kept and (under EP) their expert blocks, FSDP2 inside them."""
        dist_config = self.config.distributed
        self.meshes = pipeline.build_meshes(
            self.accelerator.device.type, dist_config.pipeline_parallel_size, dist_config.fsdp.replicate_size,
            dist_config.expert_parallel_size,
        )  # fmt: skip
        self.stage_ids = self.layout.stages_of_rank(self.meshes.pipeline_rank)
        pipeline.keep_stages(model, self.layout, self.stage_ids)
        pipeline.split_experts(model, self.meshes)
        self.stages = pipeline.stage_modules(model, self.layout, self.stage_ids)
        if self.fsdp:
            pipeline.shard_stages(model, self.stages, self.meshes, sharding_policy(self.config))
        self.shared_embedding = pipeline.share_embedding(model, self.layout, self.meshes)
        self.model = model

    def start(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """After the weights are filled: torch's schedule over this rank's stages."""
        self.schedule = pipeline.build_schedule(
            self.stages, self.stage_ids, self.layout, self.meshes, self.accelerator.device, self.run.schedule,
            self.run.microbatches, self._micro_batch_shape(), loss_fn,
        )  # fmt: skip

    def _micro_batch_shape(self) -> pipeline.MicroBatchShape:
        """Hidden states stay fp32 under autocast (the residual stream adds bf16 outputs to fp32 inputs) and are bf16
        under FSDP2's bf16 compute; the logits are bf16 in both (the head is an autocast matmul)."""
        bf16 = self.config.trainer.precision == "bf16"
        model, run = self.config.model, self.run
        rows = self.config.trainer.micro_batch_size * run.grad_accum // run.microbatches
        return pipeline.MicroBatchShape(
            rows=rows, seq_len=run.seq_len, d_model=model.d_model, vocab_size=model.vocab_size,
            hidden_dtype=torch.bfloat16 if bf16 and self.fsdp else torch.float32,
            logits_dtype=torch.bfloat16 if bf16 else torch.float32,
        )  # fmt: skip

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.layout.num_stages - 1 in self.stage_ids

    @property
    def dp_size(self) -> int:
        return self.meshes.dp_size

    # ---- one step --------------------------------------------------------------------------------------------------

    def forward_backward(self, batches: list[dict]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, dict]:
        """The schedule over the step's batches; returns the LM loss of each micro-batch (last stage, else none),
        the means over micro-batches of this rank's stages' aux losses and of L_MTP (0 off the last stage and
        without MTP), and its MoE layers' counts summed."""
        ids, labels, documents = self._batch(batches)
        kwargs = {"document_ids_BT": documents} if documents is not None else {}
        if self.config.model.mtp.depth:  # the last stage's MTP modules read the labels
            kwargs["labels_BT"] = labels
        losses: list[torch.Tensor] = []
        args = (ids,) if self.has_first else ()
        with self._autocast():
            self.schedule.step(
                *args, target=labels if self.has_last else None, losses=losses if self.has_last else None,
                return_outputs=False, **kwargs,
            )  # fmt: skip
        records = [record for stage in self.stages for record in stage.take_records()]
        m = self.run.microbatches
        aux = sum((record.aux_loss for record in records), torch.zeros(())) / m
        mtp = sum((record.mtp_loss for record in records if record.mtp_loss is not None), torch.zeros(())) / m
        stats: dict[int, MoEStats] = {}
        for record in records:
            for layer, layer_stats in record.stats.items():
                stats[layer] = stats[layer] + layer_stats if layer in stats else layer_stats
        return [loss.detach() for loss in losses], aux, mtp, stats

    def clip_gradients(self, max_norm: float) -> float:
        """Sync inside each stage (DDP), the embedding's two copies summed (MTP), then the global norm over every
        stage, the embedding once, and clipping; the norm before."""
        shared = self.shared_embedding
        uncounted = shared.uncounted if shared is not None else frozenset()
        if self.fsdp:  # every gradient is a DTensor shard: the all-reduce over all ranks counts each stage once
            pipeline.sum_embedding_gradients(self.model, shared)
            return fsdp.clip_grad_norm(self.model, max_norm, uncounted)
        pipeline.sync_gradients(self.model, self.meshes)
        pipeline.sum_embedding_gradients(self.model, shared)
        return pipeline.clip_grad_norm(self.model, max_norm, self.meshes, uncounted)

    def logits(self, batch: dict) -> torch.Tensor | None:
        """One batch's logits through every stage (evaluation), on the last stage's rank; None elsewhere."""
        ids = batch["input_ids"].to(self.accelerator.device)
        documents = batch.get("document_ids")
        documents = documents.to(self.accelerator.device) if documents is not None else None
        with self._autocast():
            return pipeline.forward_only(self.stages, self.stage_ids, self.layout, self.meshes, ids, documents,
                                         self.config.model.d_model)  # fmt: skip

    def stage_of_module(self, name: str) -> int:
        """The stage running module `name` (for naming where a NaN began, in stage order): the MTP modules are the
        last stage's, the embedding the first stage's."""
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) > 1:
            layer = int(parts[1])
            return next(s for s in range(self.layout.num_stages) if layer in self.layout.stages[s])
        return 0 if parts[0] in (EMBED, "pos_embed", "embed_dropout") else self.layout.num_stages - 1

    def pad_stats(self, stats: dict[int, MoEStats]) -> dict[int, MoEStats]:
        """Every MoE layer of the model, zeros for other stages' layers: all ranks then sum vectors of one shape,
        and each layer's counts come from its own stage only (a stage without MoE layers adds zeros only)."""
        config = self.config.model
        if config.moe is None:
            return stats
        padded = dict(stats)
        for layer in range(config.num_blocks):  # the MTP modules' blocks too
            if config.is_moe_layer(layer) and layer not in padded:
                padded[layer] = MoEStats.zeros(config.moe.num_experts)
        return padded

    def whole_model_order(self, whole: Transformer, param_groups: Callable) -> list[list[str]]:
        """The names of the unsplit model's optimizer groups, in order (how a one-process optimizer.bin counts)."""
        names = {id(p): name for name, p in whole.named_parameters()}
        return [[names[id(p)] for p in group["params"]] for group in param_groups(whole)]

    def _batch(self, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        device = self.accelerator.device
        ids = torch.cat([b["input_ids"] for b in batches]).to(device)
        labels = torch.cat([b["labels"] for b in batches]).to(device)
        documents = None
        if batches[0].get("document_ids") is not None:
            documents = torch.cat([b["document_ids"] for b in batches]).to(device)
        return ids, labels, documents

    def _autocast(self):
        """bf16 under DDP: autocast, as Accelerate wraps a model it prepares (FSDP2 casts through its policy)."""
        if self.config.trainer.precision == "bf16" and not self.fsdp:
            return self.accelerator.autocast()
        return contextlib.nullcontext()
