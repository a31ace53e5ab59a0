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

Losses. The last stage computes the LM loss per micro-batch (the schedule's `loss_fn`, a token mean), and the
schedule divides every gradient by the m micro-batches, as accumulation divides one process's: the same gradient.
A stage's MoE aux and z losses stay in that stage: `StageModule` hands its output through `_WithAuxLoss`, the
identity in forward, whose backward also gives the stage's aux loss the gradient 1 (∂(L_lm + L_aux)/∂L_aux), so
the stage's own backward carries it and nothing extra crosses the pipeline. A stage without MoE layers has none.

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

from moe import MoELayer, Transformer
from moe.expert_parallel import expert_parameters, is_expert_parameter
from moe.model import Block, total_aux_loss
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
    if EMBED not in pieces:
        model.embed = None
        model.pos_embed = None
    if HEAD not in pieces:  # the layout puts norm and head together on the last stage
        model.final_norm = None
        model.lm_head = None


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
    """What one micro-batch's forward of a stage leaves for the log: its MoE layers' aux loss and counts."""

    aux_loss: torch.Tensor
    stats: dict[int, MoEStats] = field(default_factory=dict)


class StageModule(nn.Module):
    """Stage s: ids → embedding (first stage) or the previous stage's hidden states x_BTD → its blocks → the next
    stage's input, or logits_BTV (last stage). `document_ids_BT` reaches every stage (the ranks of a pipeline read
    the same batch), which builds the attention context from it again."""

    def __init__(self, model: Transformer, pieces: tuple) -> None:
        super().__init__()
        self.is_first, self.is_last = EMBED in pieces, HEAD in pieces
        self.layer_ids = [piece for piece in pieces if isinstance(piece, int)]
        # Registered here as well as in the model (the same modules): FSDP shards a stage as one unit.
        self.blocks = nn.ModuleList(model.blocks[i] for i in self.layer_ids)
        self.embed = model.embed if self.is_first else None
        self.pos_embed = model.pos_embed if self.is_first else None
        self.final_norm = model.final_norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        object.__setattr__(self, "model", model)  # not a child: the model's pieces keep the unsplit names
        self.records: list[StageRecord] = []
        self.expected_output: tuple | None = None  # (shape, dtype) the schedule sends on (build_schedule)

    def forward(self, x: torch.Tensor, document_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
        T = x.shape[1]
        positions_T = torch.arange(T, device=x.device)
        x_BTD = self.model.embed_tokens(x, positions_T) if self.is_first else x
        rope_cos_sin, mask = self.model.attention_context(positions_T, x_BTD.dtype, 0, None, document_ids_BT)
        moe_outputs = []
        for block in self.blocks:
            x_BTD, moe_output = block(x_BTD, rope_cos_sin, mask, None, None)
            moe_outputs.append(moe_output)
        held = [out for out in moe_outputs if out is not None]
        if held:
            aux = total_aux_loss(held, x_BTD)
            stats = {i: out.stats for i, out in zip(self.layer_ids, moe_outputs, strict=True) if out is not None}
            self.records.append(StageRecord(aux.detach().float(), stats))
            x_BTD = _WithAuxLoss.apply(x_BTD, aux)
        out = self.lm_head(self.final_norm(x_BTD)) if self.is_last else x_BTD
        if self.expected_output is not None and out.dtype != self.expected_output[1]:
            raise RuntimeError(
                f"pipeline stage of layers {self.layer_ids} computed {out.dtype}, but the schedule was built to send "
                f"{self.expected_output[1]} (MicroBatchShape)"
            )
        return out

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
    """FSDP2 inside a stage: experts on the stage's (ep, edp) mesh with divide factor D, each block, then each
    stage as a root (its embedding, or final norm and head), as fsdp.shard_model does for the whole model."""
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
    """torch's schedule over this rank's stages; every gradient is divided by the micro-batches (scale_grads).
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
    if layout.style == "single":
        return cls(pipeline_stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(pipeline_stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


# ---- gradients -----------------------------------------------------------------------------------------------------


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


def clip_grad_norm(model: Transformer, max_norm: float, meshes: PipelineMeshes) -> float:
    """DDP under PP: expert_parallel.clip_grad_norm, the stages' squares summed over the pipeline group."""
    return expert_parallel.clip_grad_norm(model, max_norm, meshes.expert_groups, meshes.pipeline_group)


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
