"""Pipeline parallelism (torch.distributed.pipelining) composed with expert and data parallelism (DDP or FSDP2).

Ranks. W = PP · D: pipeline rank p (its stage ranks) holds the D consecutive ranks p·D … p·D + D-1, which split
their stages' experts by EP and replicate (DDP) or shard (FSDP, HSDP) the rest, exactly as a D-rank run without a
pipeline does (parallel/fsdp.py, expert_parallel.py). The pipeline groups are the ranks {d, D + d, 2·D + d, …} of
one data-parallel index d. Consecutive ranks share a node, so the all-to-all of EP and the gradient reductions of
data parallelism stay on the fastest links and only activations between stages (one B·T·D tensor per micro-batch
and direction) cross nodes: Megatron's advice, PP across nodes, EP and DP inside.

Stages (moe/stages.py says which layers each runs). Every rank builds the model on the meta device, keeps its
stages' pieces (the embedding on the first stage, final norm and head on the last, its blocks; the blocks of other
stages become `AbsentBlock`s), splits and shards what it kept, and only then allocates it: the model object keeps
the names of the unsplit model, so its state dict is a subset of one process's and checkpoints (DCP) load at any
other pipeline, EP or data-parallel size. Each stage is a `StageModule` over those pieces, the unit that
`PipelineStage` runs (a rank of the interleaved and V schedules runs several).

Losses. The last stage computes the LM loss per micro-batch (the schedule's `loss_fn`, a token mean), and every
gradient is divided by the m micro-batches after the schedule, as accumulation divides one process's: the same
gradient.
A stage's MoE aux and z losses stay in that stage: `StageModule` hands its output through `_WithAuxLoss`, the
identity in forward, whose backward also gives the stage's aux loss the gradient 1 (∂(L_lm + L_aux)/∂L_aux), so
the stage's own backward carries it and nothing extra crosses the pipeline. A stage without MoE layers has none.

Multi-token prediction (model.mtp.depth > 0) runs on the last stage, after the head, as one process runs it: the
MTP modules read the final norm's output, the labels (every stage is handed them, as the document ids) and the
embedding of the tokens ahead, and their loss L_MTP (with their blocks' aux losses) rides `_WithAuxLoss` like the
blocks' aux losses. The embedding is then held twice, on the first stage and on the last (torchtitan #933,
Megatron's embedding group), unless one rank runs both (the V schedules), which share the one module. Both copies
start equal (materialize fills every copy with the plain build's values) and stay equal: after the backward the
pair of ranks {first stage, last stage} of each data-parallel index sums the two gradients, g_E = g_first + g_last,
one process's gradient (`SharedEmbedding`), so both take the same optimizer step; the grad norm counts the first
stage's copy only.

Gradients. Under DDP the schedule leaves each rank its gradient summed over its micro-batches; after the step
`sync_gradients` averages the non-expert ones over the stage's D ranks and the experts' over their EDP group
(divided by D: expert_parallel.py's rule at world size D), in one all-reduce each; unlike torch's DDP nothing
overlaps the backward. FSDP2 reduce-scatters as the schedule's last backward of each unit ends. The global grad
norm sums every stage once: under DDP the pipeline group adds the stages' squares, under FSDP the all-reduce over
all W ranks of the local shards (fsdp.clip_grad_norm) does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from moe import MoELayer, Transformer
from moe.expert_parallel import expert_parameters, is_expert_parameter
from moe.model import Block, total_aux_loss
from moe.mtp import mtp_loss, mtp_targets
from moe.stages import EMBED, HEAD, StageLayout
from moe.stats import MoEStats
from moe_platform.parallel import expert_parallel
from moe_platform.parallel.expert_parallel import reduce_expert_gradients, shard_experts, sum_and_divide
from moe_platform.parallel.fsdp import ShardingMeshes, ShardingPolicy
from moe_platform.parallel.groups import ExpertParallelGroups

SCHEDULE_CLASSES = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


# ---- ranks ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineMeshes:
    """This rank's place: its pipeline rank and group, and its stage's data-parallel meshes (dense, experts)."""

    pipeline_rank: int
    pipeline_size: int
    pipeline_group: dist.ProcessGroup
    stage: ShardingMeshes  # world_size = D, the ranks of one stage

    @property
    def dp_size(self) -> int:
        return self.stage.world_size

    @property
    def expert_groups(self) -> ExpertParallelGroups | None:
        return self.stage.expert_groups

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.stage.dense.get_group() if self.stage.dense.ndim == 1 else self.stage.dense._flatten().get_group()

    def global_rank(self, pipeline_rank: int) -> int:
        """The rank of this data-parallel index on pipeline rank `pipeline_rank`."""
        return dist.get_global_rank(self.pipeline_group, pipeline_rank)


def build_meshes(device_type: str, pipeline_size: int, replicate_size: int, ep_size: int) -> PipelineMeshes:
    """Collective: the world mesh (pp, [replicate,] shard), and under EP the experts' (pp, ep, edp) mesh with
    [p, j, i] = p·D + i·EP + j, so that a stage's expert groups are groups.py's, shifted by p·D."""
    world_size = dist.get_world_size()
    D = world_size // pipeline_size
    ranks = torch.arange(world_size)
    if replicate_size > 1:
        world = DeviceMesh(
            device_type, ranks.view(pipeline_size, replicate_size, D // replicate_size),
            mesh_dim_names=("pp", "replicate", "shard"),
        )  # fmt: skip
        dense = world["replicate", "shard"]
    else:
        world = DeviceMesh(device_type, ranks.view(pipeline_size, D), mesh_dim_names=("pp", "shard"))
        dense = world["shard"]
    experts = None
    if ep_size > 1:
        ranks_pp_ep_edp = ranks.view(pipeline_size, D // ep_size, ep_size).transpose(1, 2)
        experts = DeviceMesh(device_type, ranks_pp_ep_edp, mesh_dim_names=("pp", "ep", "edp"))["ep", "edp"]
    return PipelineMeshes(
        pipeline_rank=world.get_local_rank("pp"),
        pipeline_size=pipeline_size,
        pipeline_group=world.get_group("pp"),
        stage=ShardingMeshes(dense=dense, experts=experts, world_size=D),
    )


# ---- the stages' modules -------------------------------------------------------------------------------------------


class AbsentBlock(nn.Module):
    """The place of a block another pipeline stage runs: no weights, so the model keeps its layer numbering."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this block runs on another pipeline stage")


def keep_stages(model: Transformer, layout: StageLayout, stage_ids: list[int]) -> None:
    """Drop from `model` (on the meta device) every piece the stages `stage_ids` do not run."""
    pieces = {piece for s in stage_ids for piece in layout.stages[s]}
    for i in range(len(model.blocks)):
        if i not in pieces:
            model.blocks[i] = AbsentBlock()
    runs_mtp = HEAD in pieces and model.mtp is not None  # the MTP modules run after the head, on the last stage
    if EMBED not in pieces and not runs_mtp:  # the MTP modules embed the tokens ahead: the last stage keeps a copy
        model.embed = None
        model.pos_embed = None
    if HEAD not in pieces:  # the layout puts norm and head together on the last stage
        model.final_norm = None
        model.lm_head = None
        model.mtp = None


def held_blocks(model: Transformer) -> list[Block]:
    return [block for block in model.blocks if isinstance(block, Block)]


class _WithAuxLoss(torch.autograd.Function):
    """y = x in forward; in backward x gets y's gradient and `aux` the gradient 1, as if the loss were L + aux."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        # A copy, not a view: the zero-bubble schedules' split backward detaches intermediate tensors in place, which
        # a view refuses; nothing keeps x for backward, so the copy replaces it rather than doubling it.
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


@dataclass
class StageRecord:
    """What one micro-batch's forward of a stage leaves for the log: its MoE layers' aux loss and counts (the MTP
    modules' blocks' among them, numbered L … L + K - 1), and on the last stage of a model with MTP its L_MTP."""

    aux_loss: torch.Tensor
    stats: dict[int, MoEStats] = field(default_factory=dict)
    mtp_loss: torch.Tensor | None = None


class StageModule(nn.Module):
    """Stage s: ids → embedding (first stage) or the previous stage's hidden states x_BTD → its blocks → the next
    stage's input, or logits_BTV (last stage, after which the MTP modules run given `labels_BT`). `document_ids_BT`
    and `labels_BT` reach every stage (the ranks of a pipeline read the same batch); each stage builds the attention
    context from the document ids again."""

    def __init__(self, model: Transformer, pieces: tuple) -> None:
        super().__init__()
        self.is_first, self.is_last = EMBED in pieces, HEAD in pieces
        self.layer_ids = [piece for piece in pieces if isinstance(piece, int)]
        self.runs_mtp = self.is_last and model.mtp is not None
        # Registered here as well as in the model (the same modules): FSDP shards a stage as one unit, and the
        # zero-bubble schedules compute the weight gradients of the stage's own parameters.
        self.blocks = nn.ModuleList(model.blocks[i] for i in self.layer_ids)
        self.embed = model.embed if self.is_first or self.runs_mtp else None
        self.pos_embed = model.pos_embed if self.is_first or self.runs_mtp else None
        self.final_norm = model.final_norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.mtp = model.mtp if self.runs_mtp else None
        object.__setattr__(self, "model", model)  # not a child: the model's pieces keep the unsplit names
        self.records: list[StageRecord] = []
        self.expected_output: tuple | None = None  # (shape, dtype) the schedule sends on (build_schedule)

    def forward(
        self, x: torch.Tensor, document_ids_BT: torch.Tensor | None = None, labels_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        T = x.shape[1]
        positions_T = torch.arange(T, device=x.device)
        x_BTD = self.model.embed_tokens(x, positions_T) if self.is_first else x
        rope_cos_sin, mask = self.model.attention_context(positions_T, x_BTD.dtype, 0, None, document_ids_BT)
        moe_outputs = []
        for block in self.blocks:
            x_BTD, moe_output = block(x_BTD, rope_cos_sin, mask, None, None)
            moe_outputs.append(moe_output)
        if not self.is_last:
            out = self._carry_losses(x_BTD, moe_outputs, None)
        else:
            h_BTD, mtp = self.final_norm(x_BTD), None
            if self.runs_mtp and labels_BT is not None:  # training; evaluation and the NaN replay pass no labels
                mtp = self._predict_further(h_BTD, labels_BT, positions_T, document_ids_BT, moe_outputs)
            out = self.lm_head(self._carry_losses(h_BTD, moe_outputs, mtp))
        if self.expected_output is not None and out.dtype != self.expected_output[1]:
            raise RuntimeError(
                f"pipeline stage of layers {self.layer_ids} computed {out.dtype}, but the schedule was built to send "
                f"{self.expected_output[1]} (MicroBatchShape)"
            )
        return out

    def _predict_further(self, h_BTD, labels_BT, positions_T, document_ids_BT, moe_outputs) -> torch.Tensor:
        """L_MTP of the micro-batch, as Transformer.forward computes it; the MTP blocks' outputs join `moe_outputs`."""
        model = self.model
        logits = model._predict_further(h_BTD, labels_BT, positions_T, None, document_ids_BT, moe_outputs)
        targets = mtp_targets(labels_BT, document_ids_BT, len(model.mtp))
        return mtp_loss(logits, targets, loss_weight=model.config.mtp.loss_weight)

    def _carry_losses(self, x: torch.Tensor, moe_outputs: list, mtp: torch.Tensor | None) -> torch.Tensor:
        """x, through `_WithAuxLoss` carrying the stage's aux losses (and L_MTP) where it has any; recorded."""
        held = [out for out in moe_outputs if out is not None]
        if not held and mtp is None:
            return x
        aux = total_aux_loss(held, x)
        L, ran = self.model.config.n_layers, len(moe_outputs) - len(self.layer_ids)  # ran: the MTP modules' blocks
        layer_ids = [*self.layer_ids, *range(L, L + ran)]
        stats = {i: out.stats for i, out in zip(layer_ids, moe_outputs, strict=True) if out is not None}
        self.records.append(StageRecord(aux.detach().float(), stats, mtp.detach() if mtp is not None else None))
        return _WithAuxLoss.apply(x, aux if mtp is None else aux + mtp)

    def take_records(self) -> list[StageRecord]:
        records, self.records = self.records, []
        return records


def stage_modules(model: Transformer, layout: StageLayout, stage_ids: list[int]) -> list[StageModule]:
    return [StageModule(model, layout.stages[s]) for s in stage_ids]


def split_experts(model: Transformer, meshes: PipelineMeshes) -> None:
    """Under EP keep this rank's block of its stages' experts (on the meta device: nothing is copied)."""
    groups = meshes.expert_groups
    if groups is not None:
        shard_experts(model, groups.expert_parallel)


def shard_stages(model: Transformer, stages: list[StageModule], meshes: PipelineMeshes, policy: ShardingPolicy) -> None:
    """FSDP2 inside a stage: experts on the stage's (ep, edp) mesh with divide factor D, each block and MTP module,
    then each stage as a root (its embedding, or final norm and head), as fsdp.shard_model does for the whole
    model. (A V schedule with MTP would need one embedding in two roots, which FSDP2 refuses: config.py does.)"""
    from torch.distributed.fsdp import fully_shard

    kwargs = policy.kwargs()
    expert_mesh = meshes.stage.experts
    if expert_mesh is not None:
        for module in model.modules():
            if isinstance(module, MoELayer):
                fully_shard(module.experts, mesh=expert_mesh["edp"], **kwargs)
                module.experts.set_gradient_divide_factor(float(meshes.dp_size))
                if dist.get_backend() == "gloo" and expert_mesh["edp"].size() > 1:  # see fsdp.shard_model
                    module.experts.set_force_sum_reduction_for_comms(True)
    for block in held_blocks(model):
        fully_shard(block, mesh=meshes.stage.dense, **kwargs)
    for module in model.mtp or ():
        fully_shard(module, mesh=meshes.stage.dense, **kwargs)
    for stage in stages:
        fully_shard(stage, mesh=meshes.stage.dense, **{**kwargs, "reshard_after_forward": False})


# ---- the schedule --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatchShape:
    """What crosses between stages, per micro-batch: rows B, tokens T, width D, vocabulary V and the dtypes of the
    hidden states and the logits (bf16 where FSDP2 computes in bf16 or autocast makes the head's matmul bf16)."""

    rows: int
    seq_len: int
    d_model: int
    vocab_size: int
    hidden_dtype: torch.dtype
    logits_dtype: torch.dtype

    def example(self, stage: StageModule) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's input and output, on the meta device; hidden states carry gradients back, the ids none."""
        B, T = self.rows, self.seq_len
        with torch.device("meta"):
            hidden = torch.empty(B, T, self.d_model, dtype=self.hidden_dtype, requires_grad=True)
            inputs = torch.empty(B, T, dtype=torch.int64) if stage.is_first else hidden
            outputs = torch.empty(B, T, self.vocab_size, dtype=self.logits_dtype) if stage.is_last else hidden
        return inputs, outputs


def build_schedule(
    stages: list[StageModule],
    stage_ids: list[int],
    layout: StageLayout,
    meshes: PipelineMeshes,
    device: torch.device,
    schedule: str,
    microbatches: int,
    shape: MicroBatchShape,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """torch's schedule over this rank's stages, every gradient divided by the micro-batches (`MeanOverMicroBatches`).
    The stages are given their shapes: without them `PipelineStage` infers them with a forward and backward of the
    first micro-batch, whose routing counts and random draws one process does not make."""
    pipeline_stages = []
    for stage, s in zip(stages, stage_ids, strict=True):
        inputs, outputs = shape.example(stage)
        stage.expected_output = (tuple(outputs.shape), outputs.dtype)
        pipeline_stages.append(
            PipelineStage(stage, s, layout.num_stages, device, inputs, outputs, group=meshes.pipeline_group)
        )
    cls = SCHEDULE_CLASSES[schedule]
    chosen = pipeline_stages[0] if layout.style == "single" else pipeline_stages
    torch_schedule = cls(chosen, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return MeanOverMicroBatches(torch_schedule, stages[0].model, microbatches)


class MeanOverMicroBatches:
    """torch's schedule whose step then divides every gradient of the rank's model by the m micro-batches, once.
    torch's own scaling (scale_grads) divides each stage's parameters, so a parameter two stages of one rank share
    (the embedding of a V schedule with MTP) would be divided twice. Everything else is the schedule's."""

    def __init__(self, schedule, model: Transformer, microbatches: int) -> None:
        self.schedule, self.model, self.microbatches = schedule, model, microbatches

    def step(self, *args, **kwargs):
        out = self.schedule.step(*args, **kwargs)
        with torch.no_grad():  # after FSDP2's reduce-scatter, as torch's scaling (a DTensor shard divides alike)
            for parameter in self.model.parameters():  # each parameter once, shared or not
                if parameter.grad is not None:
                    parameter.grad.div_(self.microbatches)
        return out

    def __getattr__(self, name: str):
        return getattr(self.schedule, name)


# ---- gradients -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedEmbedding:
    """The embedding's two copies under MTP (module docstring): `group` pairs this rank with the rank of the same
    data-parallel index on the other end of the pipeline; `names` are the shared parameters; `counted` says whether
    this rank's copy counts in the grad norm (the first stage's does, the last stage's equal copy does not)."""

    group: dist.ProcessGroup
    names: tuple[str, ...]
    counted: bool

    @property
    def uncounted(self) -> frozenset[str]:
        return frozenset() if self.counted else frozenset(self.names)


def share_embedding(model: Transformer, layout: StageLayout, meshes: PipelineMeshes) -> SharedEmbedding | None:
    """Collective, once, on every rank: the pairs {first stage's rank, last stage's rank} of each data-parallel
    index d (global ranks p·D + d, build_meshes' order); this rank's pair, or None where it holds no copy (no MTP,
    a V schedule whose one rank runs both stages, or a rank between the two)."""
    first, last = layout.rank_of_stage(0), layout.rank_of_stage(layout.num_stages - 1)
    if model.config.mtp.depth == 0 or first == last:
        return None
    D = meshes.dp_size
    group, _ = dist.new_subgroups_by_enumeration([[first * D + d, last * D + d] for d in range(D)])
    if meshes.pipeline_rank not in (first, last):
        return None
    names = tuple(name for name, _ in model.named_parameters() if name.split(".")[0] in (EMBED, "pos_embed"))
    return SharedEmbedding(group, names, counted=meshes.pipeline_rank == first)


@torch.no_grad()
def sum_embedding_gradients(model: Transformer, shared: SharedEmbedding | None) -> None:
    """g_E = g_first + g_last on both copies (module docstring): one all-reduce per shared parameter over the pair.
    Under FSDP both copies are sharded alike over their stage's D ranks, so the local shards line up."""
    if shared is None:
        return
    for name in shared.names:
        parameter = model.get_parameter(name)
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        grad = parameter.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=shared.group)


@torch.no_grad()
def sync_gradients(model: Transformer, meshes: PipelineMeshes) -> None:
    """DDP's average inside a stage: g = (1/D) Σ_stage ranks g_r for replicated weights, experts over their EDP
    group (expert_parallel.reduce_expert_gradients at world size D). A weight without a gradient this step counts
    as zero on every rank, so the flat buffers line up."""
    groups = meshes.expert_groups  # without EP the experts are replicated like the rest
    replicated = [
        p for name, p in model.named_parameters() if p.requires_grad and not (groups and is_expert_parameter(name))
    ]
    for p in replicated:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sum_and_divide([p.grad for p in replicated], meshes.dp_group if meshes.dp_size > 1 else None, meshes.dp_size)
    if groups is not None:
        for _, p in expert_parameters(model):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        reduce_expert_gradients(model, groups)


def clip_grad_norm(
    model: Transformer, max_norm: float, meshes: PipelineMeshes, uncounted: frozenset[str] = frozenset()
) -> float:
    """DDP under PP: expert_parallel.clip_grad_norm, the stages' squares summed over the pipeline group; the
    parameters `uncounted` (the last stage's copy of the embedding) are clipped but counted by another stage."""
    return expert_parallel.clip_grad_norm(model, max_norm, meshes.expert_groups, meshes.pipeline_group, uncounted)


# ---- forward only (evaluation) -------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def forward_only(
    stages: list[StageModule],
    stage_ids: list[int],
    layout: StageLayout,
    meshes: PipelineMeshes,
    input_ids_BT: torch.Tensor,
    document_ids_BT: torch.Tensor | None,
    d_model: int,
) -> torch.Tensor | None:
    """One batch through every stage in stage order, hidden states sent point to point (no schedule: evaluation
    is rare, and its batches need not fit the training schedule's shapes); the logits on the last stage's rank,
    None elsewhere. Each rank runs its stages in increasing order, so every send meets its receive."""
    mine = dict(zip(stage_ids, stages, strict=True))
    device = input_ids_BT.device
    shape = (*input_ids_BT.shape, d_model)
    x, out = input_ids_BT, None
    for s in range(layout.num_stages):
        if s not in mine:
            continue
        previous = layout.rank_of_stage(s - 1) if s > 0 else meshes.pipeline_rank
        if previous != meshes.pipeline_rank:
            code = torch.zeros(1, dtype=torch.int64, device=device)
            dist.recv(code, src=meshes.global_rank(previous), group=meshes.pipeline_group)
            x = torch.empty(shape, dtype=_DTYPES[int(code)], device=device)
            dist.recv(x, src=meshes.global_rank(previous), group=meshes.pipeline_group)
        out = mine[s](x, document_ids_BT)
        mine[s].take_records()  # evaluation's routing counts stay out of the training log
        following = layout.rank_of_stage(s + 1) if s + 1 < layout.num_stages else meshes.pipeline_rank
        if following != meshes.pipeline_rank:
            code = torch.tensor([_DTYPES.index(out.dtype)], dtype=torch.int64, device=device)
            dist.send(code, dst=meshes.global_rank(following), group=meshes.pipeline_group)
            dist.send(out.contiguous(), dst=meshes.global_rank(following), group=meshes.pipeline_group)
        x = out
    last = layout.num_stages - 1
    return out if last in mine else None
