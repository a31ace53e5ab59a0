"""The resource ledger: five separate tables, each a pure function of the config and the run shape.

Seed 000 ("把参数、激活、缓存和运算分开记账") and seed 001 §1.5 insist that parameters, training-state bytes,
activation bytes, KV-cache bytes and matmul FLOPs are different quantities with different units and assumptions;
adding them into one "model size" distorts every estimate. Each row here therefore carries the assumption it was
computed under.

Under expert parallelism (EP > 1) a sixth table gives the per-rank figures that EP changes. Legend there:
W all ranks, EP ranks sharing one MoE layer's experts, E routed experts, K experts per token, D model width,
L_moe MoE layers, N tokens per micro-batch, s bytes per activation element. Under FSDP2 (HSDP: R replicas of
shards over W/R ranks) the training-state table also shows what FSDP gathers while a unit computes, in the param
dtype p. The byte counts are what the strategies allocate, measured per rank by moe_platform/monitor/footprint.py.
Under pipeline parallelism (PP > 1) a table gives a row per pipeline rank (its stages' pieces, what it holds, the
micro-batches its schedule keeps in flight, the bubble), and the per-rank tables show the rank with the most state.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from moe.checkpointing import MODES as CHECKPOINTING

# Parameter counts live with the config (`ModelConfig.num_params()`); the ledger only reads them, so the import
# arrow points one way: ledger → config.
from moe.config import (
    ModelConfig,
    attention_num_params,
    count_parameters,
    memoized_by_config,
    mtp_projection_num_params,
    norm_num_params,
)
from moe.dispatch import expert_capacity
from moe.ffn import ffn_num_params
from moe.flops import matmul_flops_per_token  # the FLOP table lives there: moe/stages.py costs layers with it
from moe.stages import (
    BUBBLE_FORMULAS,
    EMBED,
    HEAD,
    IN_FLIGHT_FORMULAS,
    NORM,
    SCHEDULES,
    Piece,
    StageLayout,
    balanced_layout,
    bubble_fraction,
    in_flight,
    parse_layout,
    style_of,
)

# ---------------------------------------------------------------------------------------------------------------
# Training state
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunShape:
    """What the ledger needs to know about a run besides the model."""

    micro_batch_size: int = 8
    seq_len: int = 128
    precision: str = "fp32"
    zero_stage: int = 0
    dp_size: int = 1  # all ranks W: replicated weights are data-parallel over every rank, with or without EP
    kv_bytes_per_element: int = 2
    ep_size: int = 1  # expert-parallel ranks splitting each MoE layer's experts (divides dp_size and E)
    fsdp: bool = False  # PyTorch FSDP2 (distributed.strategy=fsdp): everything sharded, zero_stage is 0
    replicate_size: int = 1  # FSDP only: HSDP's R replicas, each sharding the non-expert state over dp_size / R
    grad_accum: int = 1  # micro-batches per optimizer step (only the all-to-all row per step uses it)
    checkpointing: str = "none"  # activation checkpointing: "none", "moe" or "full"
    attention_mask: bool = False  # a padding or packed-document mask reaches attention (SDPA keeps it per layer)
    # Pipeline parallelism (moe/stages.py): PP stage ranks, each stage's ranks data-parallel over dp_size = W / PP
    pipeline_size: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per pipeline rank (interleaved: loop; zbv, dualpipev: V = 2)
    microbatches: int = 1  # per step and pipeline (under PP: grad_accum)
    layout: tuple | None = None  # explicit stages (moe.stages.parse_layout's input); None: balanced_layout
    # "adamw": m and v for every parameter; "muon": one momentum buffer for the hidden matrices (`muon_params`)
    optimizer: str = "adamw"


# Bytes per element of a weight in each precision's compute dtype (the module's weights under DeepSpeed, the gathered
# copies under FSDP).
PARAM_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
FP32_BYTES = 4
ADAMW_BYTES = 8  # m and v, fp32 in every precision here
MUON_BYTES = 4  # Muon's one momentum buffer, fp32 (moe_platform/train/optimizers.py)
OPTIMIZERS = ("adamw", "muon")
PRECISION_ASSUMPTIONS = {
    "fp32": "fp32 weights 4 B + fp32 grads 4 B + AdamW m, v fp32 8 B (+ DeepSpeed's fp32 master copy 4 B)",
    "bf16": "bf16 weights 2 B + grads 2 B (fp32 4 B at stage ≥ 2) + fp32 master 4 B + AdamW m, v 8 B; DDP: as fp32",
}
FSDP_ASSUMPTION = "fp32 shards of weights (the master) 4 B + grads 4 B + AdamW m, v 8 B, in either precision"
# Bytes per element of the hidden vectors that move between ranks (expert-parallel all-to-all).
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class TrainingStateBytes:
    weights: float  # the module's parameters (under ZeRO-3 and FSDP this rank's shard of them)
    gradients: float
    master: float  # DeepSpeed's fp32 master partition, a copy beside the weights (0 where the weights are the master)
    optimizer: float  # AdamW's m and v (Muon's momentum for the matrices it steps)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master + self.optimizer

    def __add__(self, other: "TrainingStateBytes") -> "TrainingStateBytes":
        return TrainingStateBytes(
            weights=self.weights + other.weights,
            gradients=self.gradients + other.gradients,
            master=self.master + other.master,
            optimizer=self.optimizer + other.optimizer,
        )


def training_state_bytes(
    num_params: int, precision: str, zero_stage: int, dp_size: int, *, fsdp: bool = False, muon_params: float = 0
) -> TrainingStateBytes:
    """Per-rank bytes of weights, gradients, master copy and optimizer state of `num_params` parameters that
    `dp_size` ranks share, as each strategy allocates them (measured, torch 2.13 and DeepSpeed 0.19.8, by
    monitor/footprint.py; tests/moe_platform/test_footprint.py checks it):
      * stage 0 (DDP, one process): nothing sharded; fp32 weights and gradients even under bf16, which autocasts
        from them: 4 + 4 + 8 = 16 B/param;
      * DeepSpeed ZeRO stage 1/2/3 shards the optimizer state, also the gradients, also the weights. The weights
        are in the precision's dtype (4 or 2 B); the gradients too at stage 1 (backward's unsharded ones), but at
        stages 2 and 3 they are reduced into fp32 partitions (4 B) even under bf16; and the ZeRO optimizer keeps an
        fp32 master partition (4 B) even when the weights are fp32 (it clones them). bf16: 4 + 12/N, 2 + 16/N,
        18/N B/param (the ZeRO paper's Ψ·(2 + 2 + 12) has 2 B sharded gradients, which DeepSpeed does not keep);
      * FSDP2 (`fsdp`) shards everything, in fp32 in either precision (its bf16 weights exist only gathered, while a
        unit computes: `sharding_transient_bytes`): 16/N B/param.
    Of them, `muon_params` are stepped by Muon (optim.name=muon): 4 B of momentum each instead of AdamW's 8 B.
    Activations, buffers, allocator slack and communication buckets are not counted.
    """
    if precision not in PARAM_DTYPE_BYTES:
        raise ValueError(f"precision={precision!r} is unknown: use one of {tuple(PARAM_DTYPE_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is invalid: use 0, 1, 2 or 3")
    if fsdp and zero_stage:
        raise ValueError(f"zero_stage={zero_stage} is DeepSpeed's, but fsdp shards everything already: use 0")
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    if not 0 <= muon_params <= num_params:
        raise ValueError(f"muon_params={muon_params} must lie in [0, num_params={num_params}]")
    n, shard = num_params, 1.0 / dp_size
    optimizer = (n - muon_params) * ADAMW_BYTES + muon_params * MUON_BYTES
    if fsdp:
        return TrainingStateBytes(
            weights=n * FP32_BYTES * shard,
            gradients=n * FP32_BYTES * shard,
            master=0.0,
            optimizer=optimizer * shard,
        )
    if zero_stage == 0:
        return TrainingStateBytes(weights=n * FP32_BYTES, gradients=n * FP32_BYTES, master=0.0, optimizer=optimizer)
    weight_b = PARAM_DTYPE_BYTES[precision]
    return TrainingStateBytes(
        weights=n * weight_b * (shard if zero_stage >= 3 else 1.0),
        gradients=n * FP32_BYTES * shard if zero_stage >= 2 else n * weight_b,
        master=n * FP32_BYTES * shard,
        optimizer=optimizer * shard,
    )


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism and FSDP
# ---------------------------------------------------------------------------------------------------------------
#
# EP ranks split every MoE layer's E routed experts into contiguous blocks of E/EP. Everything else (embeddings,
# attention, norms, dense FFNs, routers, shared experts) is replicated on all W ranks, and each expert block is
# replicated on the W/EP ranks that hold it (its expert-data-parallel group). So ZeRO shards the replicated state
# over W ranks and the expert state over W/EP ranks; DeepSpeed does partition the experts' state over that group
# (measured, ZeRO-1/2 with EP=2 of W=4: 2 partitions of each expert group; DeepSpeed issue #7156 says otherwise).
# FSDP2 shards the non-expert state over its shard group (W ranks; W/R under HSDP, R replicas) and each expert block
# over its W/EP expert-data-parallel ranks, so a rank holds routed / EP / (W/EP) = routed / W of the experts.


def _check_expert_parallel(config: ModelConfig, ep_size: int, world_size: int | None = None) -> None:
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1: use 1 for no expert parallelism")
    if ep_size == 1:
        return
    if config.moe is None:
        raise ValueError(f"ep_size={ep_size} needs MoE layers but the model is dense: use ep_size=1")
    if config.moe.num_experts % ep_size:
        raise ValueError(
            f"ep_size={ep_size} does not divide moe.num_experts={config.moe.num_experts}: "
            "choose an EP size that divides the number of experts"
        )
    if world_size is not None and world_size % ep_size:
        raise ValueError(
            f"ep_size={ep_size} does not divide the world size W={world_size}: "
            "choose an EP size that divides the number of ranks"
        )


def _check_layout(config: ModelConfig, run: RunShape) -> None:
    _check_pipeline(run)
    _check_expert_parallel(config, run.ep_size, run.dp_size)
    R = run.replicate_size
    if R < 1 or (R > 1 and not run.fsdp) or run.dp_size % R:
        raise ValueError(
            f"replicate_size={R} needs fsdp and must divide the world size W={run.dp_size}: use 1 without HSDP"
        )


def expert_params_per_rank(config: ModelConfig, ep_size: int) -> int:
    """Routed-expert parameters one rank holds: Σ over MoE layers of (E/EP) experts = routed experts / EP."""
    _check_expert_parallel(config, ep_size)
    return count_parameters(config).routed_experts // ep_size


def params_per_rank(config: ModelConfig, ep_size: int) -> int:
    """All parameters one rank holds: replicated (everything but routed experts, routers included) + routed / EP."""
    params = count_parameters(config)
    return params.total - params.routed_experts + expert_params_per_rank(config, ep_size)


def _shard_counts(run: RunShape) -> tuple[int, int]:
    """How many ranks share the non-expert state and a rank's expert block: (W, or W/R under HSDP; W/EP). Without
    EP the experts are sharded like everything else (under HSDP over W/R too); with it each block over all its
    W/EP holders (parallel/fsdp.py shards it over its expert-data-parallel group, HSDP or not)."""
    dense = run.dp_size // run.replicate_size if run.fsdp else run.dp_size
    return dense, (run.dp_size // run.ep_size if run.ep_size > 1 else dense)


# ---------------------------------------------------------------------------------------------------------------
# Pipeline parallelism
# ---------------------------------------------------------------------------------------------------------------
#
# PP pipeline ranks each run their stages (moe/stages.py): the embedding on the first stage, the final norm and head
# on the last (with the MTP modules and, on a rank without the first stage, a copy of the embedding they read), and
# their layers. The dp_size = W/PP ranks of one stage split its experts over EP and shard it as a
# run without a pipeline shards the whole model, so every per-rank figure is today's applied to the pieces one
# pipeline rank holds. Per-rank functions take that rank, `pipeline_rank`; None is the worst of them.

Figure = TypeVar("Figure")


def pipeline_layout(config: ModelConfig, run: RunShape) -> StageLayout:
    """The stages the trainer builds: `run.layout` (checked by parse_layout), else the FLOP-balanced layout."""
    if run.layout is not None:
        return parse_layout([list(stage) for stage in run.layout], config.n_layers, run.pipeline_size, run.schedule)
    return balanced_layout(config, run.seq_len, run.pipeline_size, run.schedule, run.virtual_stages)


def _check_pipeline(run: RunShape) -> None:
    P = run.pipeline_size
    if P < 1:
        raise ValueError(f"pipeline_size={P} must be >= 1: use 1 for no pipeline parallelism")
    if P == 1:
        return
    if run.schedule not in SCHEDULES:
        raise ValueError(f"schedule={run.schedule!r} is unknown: use one of {SCHEDULES}")
    per_rank = {"single": 1, "v": 2}.get(style_of(run.schedule))  # None: the loop takes any V >= 1
    if run.virtual_stages < 1 or per_rank not in (None, run.virtual_stages):
        raise ValueError(
            f"virtual_stages={run.virtual_stages} does not fit schedule {run.schedule}, which runs "
            f"{per_rank or 'at least 1'} stage(s) per pipeline rank: use {per_rank or 'a positive number'}"
        )
    if run.zero_stage:
        raise ValueError(f"zero_stage={run.zero_stage} is DeepSpeed's, which pipeline_size={P} cannot run with: use 0")
    rows = run.micro_batch_size * run.grad_accum
    if run.microbatches < 1 or rows % run.microbatches:
        raise ValueError(
            f"microbatches={run.microbatches} does not divide the step's micro_batch_size × grad_accum = {rows} rows "
            "of each pipeline: use a divisor of them"
        )


def _pipeline_ranks(run: RunShape, pipeline_rank: int | None) -> range:
    """The pipeline ranks a per-rank figure looks at: the one asked for, else all (None: the worst is taken)."""
    if pipeline_rank is None:
        return range(run.pipeline_size)
    if not 0 <= pipeline_rank < run.pipeline_size:
        raise ValueError(
            f"pipeline_rank={pipeline_rank} is not one of the {run.pipeline_size} pipeline ranks: "
            f"use 0 … {run.pipeline_size - 1}, or None for the worst"
        )
    return range(pipeline_rank, pipeline_rank + 1)


def _worst(run: RunShape, pipeline_rank: int | None, figure: Callable[[int], Figure], size: Callable) -> Figure:
    """`figure(pipeline_rank)`, or with None the largest `size(figure(p))` over all pipeline ranks p."""
    return max((figure(p) for p in _pipeline_ranks(run, pipeline_rank)), key=size)


def stage_pieces(layout: StageLayout, pipeline_rank: int) -> list[list[Piece]]:
    """The pieces of each stage a pipeline rank runs, in its stages' order."""
    return [list(layout.stages[s]) for s in layout.stages_of_rank(pipeline_rank)]


def _piece_params(config: ModelConfig, piece: Piece) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of one piece: the embedding (+ learned positions), the final norm,
    the head, or block `piece` (all E routed experts; EP splits them later)."""
    if piece == EMBED:
        return count_parameters(config).embedding, 0
    if piece == NORM:
        return norm_num_params(config), 0
    if piece == HEAD:
        return count_parameters(config).lm_head, 0
    return _block_params(config, piece)


@memoized_by_config
def _block_params(config: ModelConfig, layer: int) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of one block: attention, its two norms, and the dense FFN, or the
    MoE layer (router, shared experts; and the E routed experts apart)."""
    norms = 2 * norm_num_params(config)
    if not config.is_moe_layer(layer):
        ffn = ffn_num_params(config.d_model, config.d_ff, config.activation, bias=config.ffn_bias)
        return attention_num_params(config) + norms + ffn, 0
    moe = config.moe
    routed = moe.num_experts * ffn_num_params(config.d_model, moe.expert_d_ff, config.activation)
    return attention_num_params(config) + norms + moe.num_params(config.d_model, config.activation) - routed, routed


def _mtp_params(config: ModelConfig) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of the MTP modules: each one's block (built like the last layer), its
    three norms and M_k; the embedding and head they share are counted where they are held."""
    dense, routed = _block_params(config, config.n_layers - 1)
    own = 3 * norm_num_params(config) + mtp_projection_num_params(config)
    return config.mtp.depth * (dense + own), config.mtp.depth * routed


def runs_mtp(config: ModelConfig, layout: StageLayout, pipeline_rank: int) -> bool:
    """Whether the pipeline rank runs the MTP modules: those of a model with any, on the rank of the last stage."""
    return bool(config.mtp.depth) and layout.num_stages - 1 in layout.stages_of_rank(pipeline_rank)


def holds_embedding_copy(config: ModelConfig, layout: StageLayout, pipeline_rank: int) -> bool:
    """Whether the pipeline rank holds a second copy of the embedding: it runs the MTP modules, which read the
    embedding of the tokens ahead, but not the first stage (the V schedules run both on one rank, which shares one)."""
    return runs_mtp(config, layout, pipeline_rank) and 0 not in layout.stages_of_rank(pipeline_rank)


@memoized_by_config
def held_params_by_rank(config: ModelConfig, run: RunShape) -> list[tuple[int, int]]:
    """(non-expert, routed-expert) parameters each pipeline rank's stages hold, the routed experts all E of their
    layers (a rank keeps E/EP); at PP = 1 the whole model's, once. The last stage's rank also holds the MTP modules
    and, unless it runs the first stage too, a copy of the embedding: summed over ranks, the model's total plus
    that copy."""
    if run.pipeline_size == 1:
        params = count_parameters(config)
        return [(params.total - params.routed_experts, params.routed_experts)]
    layout = pipeline_layout(config, run)
    held = []
    for p in range(run.pipeline_size):
        pieces = [_piece_params(config, piece) for stage in stage_pieces(layout, p) for piece in stage]
        if runs_mtp(config, layout, p):
            pieces.append(_mtp_params(config))
        if holds_embedding_copy(config, layout, p):
            pieces.append(_piece_params(config, EMBED))
        held.append((sum(dense for dense, _ in pieces), sum(routed for _, routed in pieces)))
    return held


def _adamw_block_params(config: ModelConfig, layer: int) -> int:
    """Parameters of block `layer` that AdamW steps under optim.name=muon: its two norms, the attention's biases
    (attention_bias) and MLA's latent norms, and the dense FFN's biases (ffn_bias) or the MoE layer's router E·D;
    Muon steps every other, a weight matrix (moe_platform/train/optimizers.py `hidden_matrices`)."""
    vectors = 2 * norm_num_params(config)
    if config.attention == "mla":
        mla = config.mla
        vectors += (mla.q_lora_rank or 0) + mla.kv_lora_rank  # the latents' RMSNorms
        if config.attention_bias:
            vectors += (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim + config.d_model
    elif config.attention_bias:
        vectors += (config.n_heads + 2 * config.n_kv_heads) * config.head_dim + config.d_model
    if config.is_moe_layer(layer):
        return vectors + config.moe.num_experts * config.d_model
    if config.ffn_bias:
        vectors += (2 if config.activation == "swiglu" else 1) * config.d_ff + config.d_model
    return vectors


@memoized_by_config
def muon_params_by_rank(config: ModelConfig, run: RunShape) -> list[tuple[int, int]]:
    """(non-expert, routed-expert) parameters Muon steps on each pipeline rank, as `held_params_by_rank` counts
    them: every block's weight matrices and all routed experts under run.optimizer=muon, the MTP modules' blocks and
    projections M_k (2·D² each) included (outside them none: embeddings and head are AdamW's), zeros under adamw."""
    if run.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={run.optimizer!r} is unknown: use one of {OPTIMIZERS}")
    held = held_params_by_rank(config, run)
    if run.optimizer == "adamw":
        return [(0, 0) for _ in held]
    mtp_blocks = list(range(config.n_layers, config.num_blocks))
    blocks, with_mtp = [[*range(config.n_layers), *mtp_blocks]], [True]
    if run.pipeline_size > 1:  # each rank's layers, and the MTP modules' blocks on the last stage's
        layout = pipeline_layout(config, run)
        with_mtp = [runs_mtp(config, layout, r) for r in range(run.pipeline_size)]
        blocks = [
            [p for stage in stage_pieces(layout, r) for p in stage if isinstance(p, int)] + (mtp_blocks if mtp else [])
            for r, mtp in enumerate(with_mtp)
        ]
    muon = []
    for layers, mtp, (_, routed) in zip(blocks, with_mtp, held, strict=True):
        dense = sum(_block_params(config, layer)[0] - _adamw_block_params(config, layer) for layer in layers)
        if mtp:
            dense += config.mtp.depth * mtp_projection_num_params(config)
        muon.append((dense, routed))
    return muon


def training_state_bytes_per_rank(
    config: ModelConfig, run: RunShape, pipeline_rank: int | None = None
) -> TrainingStateBytes:
    """Per-rank weights, gradients, master copy and optimizer state of `run`'s layout (ZeRO stage, FSDP/HSDP, EP,
    and under PP the pieces of `pipeline_rank`'s stages; None: the rank with the most).

    The non-expert parameters are sharded over W ranks (FSDP: its shard group, W/R under HSDP), the rank's routed
    experts (routed / EP) over the W/EP ranks that hold the same block; at EP=1 and R=1 this is
    `training_state_bytes(total, …, W)`. Under PP, W is a stage's dp_size = W_all / PP ranks.
    """
    _check_layout(config, run)
    held, muon = held_params_by_rank(config, run), muon_params_by_rank(config, run)
    dense_shards, expert_shards = _shard_counts(run)
    state = partial(training_state_bytes, precision=run.precision, zero_stage=run.zero_stage, fsdp=run.fsdp)

    def of_rank(p: int) -> TrainingStateBytes:
        (dense, routed), (muon_dense, muon_routed) = held[p], muon[p]
        return state(dense, dp_size=dense_shards, muon_params=muon_dense) + state(
            routed // run.ep_size, dp_size=expert_shards, muon_params=muon_routed // run.ep_size
        )

    return _worst(run, pipeline_rank, of_rank, lambda bytes_: bytes_.total)


def stored_params_per_rank(config: ModelConfig, run: RunShape, pipeline_rank: int | None = None) -> float:
    """Parameters a rank stores: `params_per_rank` (its expert block under EP; under PP of `pipeline_rank`'s
    stages, None: the rank with the most), sharded under ZeRO-3 and FSDP."""
    _check_layout(config, run)
    held = held_params_by_rank(config, run)
    dense_shards, expert_shards = _shard_counts(run)

    def of_rank(p: int) -> float:
        dense, routed = held[p]
        if run.zero_stage < 3 and not run.fsdp:
            return dense + routed // run.ep_size
        return dense / dense_shards + routed // run.ep_size / expert_shards

    return _worst(run, pipeline_rank, of_rank, float)


@dataclass(frozen=True)
class ShardingTransientBytes:
    """What a sharded strategy holds per rank beyond its shards at the worst moment of a step (in backward), in the
    param dtype p (2 B bf16, 4 B fp32); `sharding_transient_bytes` says which units each strategy gathers."""

    gathered: float  # whole parameters of the units gathered at once
    gradients: float  # their unsharded gradients, written by autograd in p until reduced into shards
    reduce_scatter: float  # FSDP's reduce-scatter input, in the reduce dtype fp32 (DeepSpeed's buckets: not counted)

    @property
    def total(self) -> float:
        return self.gathered + self.gradients + self.reduce_scatter


def fsdp_unit_params(config: ModelConfig, ep_size: int) -> list[int]:
    """The parameters of each unit FSDP gathers whole, root (embeddings, final norm, lm head) first, then every block
    with its routed experts cut to a rank's E/EP (under EP the experts are a unit of their own inside the block),
    then every MTP module (its block, with its norms and M_k)."""
    params = count_parameters(config)
    units = [params.embedding + params.lm_head + norm_num_params(config)]
    for layer in range(config.num_blocks):
        dense, routed = _block_params(config, layer)
        own = 3 * norm_num_params(config) + mtp_projection_num_params(config)  # an MTP module's, beside its block
        mtp_extra = own if layer >= config.n_layers else 0
        units.append(dense + mtp_extra + routed // ep_size)
    return units


def pipeline_fsdp_unit_params(config: ModelConfig, run: RunShape, pipeline_rank: int) -> list[int]:
    """FSDP's units on one pipeline rank (parallel/pipeline.py's shard_stages): each of its stages' roots (the
    embedding; the final norm and head, with the embedding's copy where the rank runs MTP but not the first stage)
    and each of its blocks, with the block's routed experts cut to E/EP; then each MTP module on the last stage's."""
    layout = pipeline_layout(config, run)
    units = []
    for stage, pieces in zip(layout.stages_of_rank(pipeline_rank), stage_pieces(layout, pipeline_rank), strict=True):
        root = sum(_piece_params(config, piece)[0] for piece in pieces if not isinstance(piece, int))
        if stage == layout.num_stages - 1 and holds_embedding_copy(config, layout, pipeline_rank):
            root += _piece_params(config, EMBED)[0]
        units += [root] if root else []
        for layer in (piece for piece in pieces if isinstance(piece, int)):
            dense, routed = _block_params(config, layer)
            units.append(dense + routed // run.ep_size)
    if runs_mtp(config, layout, pipeline_rank):
        dense, routed = _mtp_params(config)
        units += [(dense + routed // run.ep_size) // config.mtp.depth] * config.mtp.depth
    return units


def sharding_peak_bytes(config: ModelConfig, run: RunShape, pipeline_rank: int | None = None) -> float:
    """What `sharding_transient_bytes` adds to a rank's peak, which is where backward starts (every activation live).

    FSDP2 without PP: the gathered units are live there, but a unit's unsharded gradients and its reduce-scatter
    input are written by its backward, which frees its activations as it goes, so they count only beyond one block's:
        peak transient = gathered + max(0, gradients + reduce-scatter − a block's activations)
    (the mean block's, `activation_bytes` over the layers). Measured on gloo (tests/moe_platform/test_plan_memory.py,
    moe_tiny at 4 ranks): with the three summed FSDP2 + EP was predicted 10-15% above every rank's peak. Under PP
    (gradients accumulate gathered from a unit's first backward to the step's end) and ZeRO-3, the sum."""
    transient = sharding_transient_bytes(config, run, pipeline_rank)
    if not run.fsdp or run.pipeline_size > 1:
        return transient.total
    kept = activation_bytes(
        config, run.micro_batch_size, run.seq_len, run.precision, run.checkpointing, run.attention_mask
    )
    block = (kept.attention + kept.ffn + kept.moe + kept.dispatch) / config.n_layers
    return transient.gathered + max(0.0, transient.gradients + transient.reduce_scatter - block)


def sharding_transient_bytes(
    config: ModelConfig, run: RunShape, pipeline_rank: int | None = None
) -> ShardingTransientBytes:
    """FSDP2's and ZeRO-3's gathered parameters, unsharded gradients and reduce-scatter input per rank (0 otherwise).

    FSDP2 (units: the root = embeddings, final norm, lm head; each block, under EP with its E/EP experts): forward
    holds the root and one block at a time (a block is resharded after its forward); backward holds the root, the
    block it runs and the one it prefetches (FSDP2's default), and a unit's unsharded gradients until its
    reduce-scatter; so with B the largest block: gathered = (U_root + 2·B)·p, gradients = (U_root + B)·p,
    reduce-scatter = max(U_root, B)·4. ZeRO-3 gathers one module as it runs and frees it after, the MoE layer being
    one leaf with all E experts (no EP under ZeRO-3): gathered = gradients = U·p with U the largest of the
    embedding, the head, a block's attention and a block's FFN or MoE layer (its prefetch bucket, 5e7 elements by
    default, and its reduce buckets are not counted). Upper bounds of the moments they describe, independent of the
    shard count and of CPU offload (which moves the shards, not these).

    FSDP2 under PP (`pipeline_rank`'s units, `pipeline_fsdp_unit_params`; None: the rank with the most): torch's
    pipeline stage turns off resharding after backward and the gradient reduction for every micro-batch
    (`backward_maybe_with_nosync`) and reduce-scatters only in the step's last action (`perform_reduce_grad`), so
    from a unit's first backward to the step's end it stays gathered and its unsharded gradients accumulate, in the
    reduce dtype fp32 (measured: every parameter of a stage unsharded, with a gradient, before that reduce). With
    U_rank all its units and B its largest: gathered = U_rank·p, gradients = U_rank·4 (+ B·p under bf16: the fresh
    gradients of the unit in backward, before they are added to the fp32 sum), reduce-scatter = B·4.
    """
    _check_layout(config, run)
    p = PARAM_DTYPE_BYTES[run.precision]
    if run.zero_stage == 3:
        params = count_parameters(config)
        norms = 2 * norm_num_params(config)
        ffns = [block - attention_num_params(config) - norms for block in fsdp_unit_params(config, 1)[1:]]
        largest = max(params.embedding, params.lm_head, attention_num_params(config), *ffns)
        return ShardingTransientBytes(gathered=largest * p, gradients=largest * p, reduce_scatter=0.0)
    if not run.fsdp:
        return ShardingTransientBytes(0.0, 0.0, 0.0)
    if run.pipeline_size > 1:

        def of_rank(rank: int) -> ShardingTransientBytes:
            units = pipeline_fsdp_unit_params(config, run, rank)
            held, largest = sum(units), max(units)
            return ShardingTransientBytes(
                gathered=held * p,
                gradients=held * FP32_BYTES + (largest * p if p < FP32_BYTES else 0),
                reduce_scatter=largest * FP32_BYTES,
            )

        return _worst(run, pipeline_rank, of_rank, lambda transient: transient.total)
    root, *blocks = fsdp_unit_params(config, run.ep_size)
    blocks = sorted(blocks, reverse=True)
    return ShardingTransientBytes(
        gathered=(root + sum(blocks[:2])) * p,
        gradients=(root + blocks[0]) * p,
        reduce_scatter=max(root, blocks[0]) * FP32_BYTES,
    )


def all_to_all_bytes_per_step(
    config: ModelConfig,
    tokens_per_micro_batch: int,
    micro_batches_per_step: int,
    ep_size: int,
    bytes_per_element: int,
    *,
    layers: Sequence[int] | None = None,
) -> float:
    """Bytes one rank sends through expert-parallel all-to-alls per optimizer step, uniform routing, payload only.

    Per MoE layer and micro-batch the N·K (token, expert) assignments go out (dispatch) and come back (combine),
    and backward moves their gradients the same way: 4 · L_moe · N·K · (EP-1)/EP · D · s, where (EP-1)/EP is the
    share of assignments whose expert lives on another rank. Dropless: capacity drops would send fewer. L_moe
    counts the MoE layers among `layers` (default all; a pipeline rank runs its stages' only).
    """
    _check_expert_parallel(config, ep_size)
    if ep_size == 1:
        return 0.0
    all_blocks = range(config.num_blocks)  # the MTP modules' blocks too
    moe_layers = sum(config.is_moe_layer(layer) for layer in (all_blocks if layers is None else layers))
    assignments = tokens_per_micro_batch * config.moe.top_k
    per_micro_batch = 4 * moe_layers * assignments * (ep_size - 1) / ep_size * config.d_model * bytes_per_element
    return per_micro_batch * micro_batches_per_step


# ---------------------------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------------------------


def kv_cache_bytes(config: ModelConfig, batch_size: int, seq_len: int, bytes_per_element: int) -> int:
    """Payload of the cache `Transformer.new_kv_cache` allocates: every layer, every cached position.

    GQA (MHA, MQA): K and V of the H_kv KV heads, 2 · B · L · S · H_kv · d_h · s.
    MLA: the content latent and the shared RoPE key, B · L · S · (d_c + d_r) · s (seed 001), d_c = kv_lora_rank,
    d_r = qk_rope_head_dim; not the GQA formula with d_c plugged in (no factor 2, no heads).
    """
    B, L, S, s = batch_size, config.n_layers, seq_len, bytes_per_element
    if config.attention == "mla":
        return B * L * S * (config.mla.kv_lora_rank + config.mla.qk_rope_head_dim) * s
    return 2 * B * L * S * config.n_kv_heads * config.head_dim * s


def mha_kv_cache_bytes(config: ModelConfig, batch_size: int, seq_len: int, bytes_per_element: int) -> int:
    """What a plain MHA cache of the same attention shapes would hold: per-head keys and values of all H heads,
    B · L · S · H · (d_k + d_v) · s, with d_k = n + r and d_v = v under MLA (the keys and values MLA reconstructs
    from its latent), d_k = d_v = d_h under GQA. The baseline both MLA's latent and GQA's shared heads shrink."""
    if config.attention == "mla":
        key_width, value_width = config.mla.qk_head_dim, config.mla.v_head_dim
    else:
        key_width = value_width = config.head_dim
    return batch_size * config.n_layers * seq_len * config.n_heads * (key_width + value_width) * bytes_per_element


# ---------------------------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------------------------
#
# What autograd keeps from one micro-batch's forward until its backward, read off our modules (and checked by
# tests against saved-tensor hooks and the measured peak of a training step). Legend: N = B·S tokens, D model
# width, H / H_kv query / KV heads of d_h dims, F dense FFN width, E experts, K experts per token, A kept
# assignments (N·K dropless, at most E·C under a capacity C), F_e expert width, F_s shared experts' total width,
# V vocabulary, s bytes per activation element (4 fp32, 2 for a bf16 model), 4 for what is always fp32.


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes one micro-batch's forward leaves for its backward, by part, summed over layers."""

    attention: float  # attention sub-layers with their norms (under "full": every block's input only)
    ffn: float  # dense FFN sub-layers with their norms
    moe: float  # MoE sub-layers' norms, router, expert hidden units and shared experts (under "moe": inputs only)
    dispatch: float  # MoE dispatch buffers: the A gathered rows, combine's [N, K, D] and the index tensors
    logits: float  # final norm, the [N, V] logits, cross-entropy's fp32 log-probabilities and their gradients
    recompute: float  # under checkpointing, the largest piece rebuilt in backward, beyond the logits' fp32 bytes
    mtp: float = 0  # the MTP modules (moe/mtp.py): their norms, M_k's input, blocks, logits and their gradients

    @property
    def total(self) -> float:
        return self.attention + self.ffn + self.moe + self.dispatch + self.logits + self.recompute + self.mtp


def _norm_bytes(config: ModelConfig, num_tokens: int, s: int) -> int:
    """A norm keeps its input and output, N·D·s each, and per-token statistics: RMSNorm (composite in torch)
    also its normalised input x·rstd (N·D·s) and rstd (N·4); LayerNorm mean and rstd (2·N·4)."""
    if config.norm == "rmsnorm":
        return 3 * num_tokens * config.d_model * s + 4 * num_tokens
    return 2 * num_tokens * config.d_model * s + 8 * num_tokens


def _attention_bytes(config: ModelConfig, num_tokens: int, s: int) -> int:
    """Norm + Q (N·H·d_h·s) + K and V (2·N·H_kv·d_h·s, unexpanded under GQA) + SDPA's output (N·H·d_h·s, which
    W_O reads as a view) + its log-sum-exp (N·H·4): SDPA's fused (flash) path, which torch 2.13 takes on CPU with
    or without a mask (the mask's own bytes: `activation_bytes`)."""
    q_width, kv_width = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return (
        _norm_bytes(config, num_tokens, s)
        + num_tokens * (2 * q_width + 2 * kv_width) * s
        + num_tokens * config.n_heads * 4
    )


def _latent_norm_bytes(num_tokens: int, width: int, s: int) -> int:
    """MLA's latent RMSNorms (nn.RMSNorm whatever `config.norm` says): their normalised input x·rstd and output,
    2·N·W·s, and rstd, N·4; the input is counted by the projection that produced it."""
    return 2 * num_tokens * width * s + 4 * num_tokens


def mla_sdpa_is_fused(config: ModelConfig) -> bool:
    """Whether MLA's training forward takes SDPA's fused kernel. That kernel needs one head width for Q, K and V;
    moe/mla.py pads narrower values (DeepSeek's 128 beside 128 + 64) with zero columns to get it. Wider values than
    n + r would take the math path, which keeps the B·H·S² probabilities."""
    return config.mla.v_head_dim <= config.mla.qk_head_dim


def _mla_attention_bytes(config: ModelConfig, num_tokens: int, seq_len: int, s: int) -> int:
    """One MLA sub-layer (moe/mla.py, the expanded path every uncached forward takes):
    norm + the query latent W_DQ x and its RMSNorm when q_lora_rank is set (N·Q·s + 2·N·Q·s + N·4)
    + W_DKV and W_KR's output (N·(C+r)·s, kept whole: the latent norm keeps a view of it) and the latent's RMSNorm
    (2·N·C·s + N·4) + the [q^C ; RoPE(q^R)] and [W_UK c ; k_r] heads SDPA keeps (2·N·H·(n+r)·s) + W_O's input
    (N·H·v·s), and then, by SDPA path (`mla_sdpa_is_fused`):
    fused: the values SDPA keeps, N·H·(n+r)·s (padded to n + r; a view of W_UK and W_UV's output when v = n + r,
    whose key half is then kept too: N·H·(n+v)·s) + SDPA's output (N·H·(n+r)·s, a second copy beside W_O's input:
    the CPU kernel lays it out like the contiguous q, so merging heads cannot be a view) + its log-sum-exp (N·H·4);
    math: the values made contiguous (N·H·v·s) + the softmax probabilities over the S×S grid (N·H·S·s).
    The RoPE tables (2·S·r·4) are too small to count."""
    mla, H, N = config.mla, config.n_heads, num_tokens
    query = 0 if mla.q_lora_rank is None else N * mla.q_lora_rank * s + _latent_norm_bytes(N, mla.q_lora_rank, s)
    latent = N * (mla.kv_lora_rank + mla.qk_rope_head_dim) * s + _latent_norm_bytes(N, mla.kv_lora_rank, s)
    common = 2 * N * H * mla.qk_head_dim * s + N * H * mla.v_head_dim * s
    if mla.v_head_dim == mla.qk_head_dim:
        path = N * H * (mla.qk_nope_head_dim + mla.v_head_dim) * s + N * H * mla.v_head_dim * s + N * H * 4
    elif mla_sdpa_is_fused(config):
        path = 2 * N * H * mla.qk_head_dim * s + N * H * 4
    else:
        path = N * H * mla.v_head_dim * s + N * H * seq_len * s
    return _norm_bytes(config, N, s) + query + latent + common + path


def _alibi_bias_bytes(config: ModelConfig, micro_batch_size: int, seq_len: int, s: int, attention_mask: bool) -> int:
    """ALiBi's additive bias, H·S²·s, or B·H·S²·s when a padding or document mask is folded into it: built once
    per forward in the activations' dtype and handed to every layer's SDPA, which keeps that one tensor (a float
    mask keeps SDPA on a fused path: the flash kernel on CPU, the memory-efficient one on CUDA, where flash takes
    no mask); 0 for other position encodings."""
    if config.pos_encoding != "alibi":
        return 0
    return (micro_batch_size if attention_mask else 1) * config.n_heads * seq_len**2 * s


def _hidden_bytes(rows: int, width: int, activation: str, s: int) -> int:
    """An FFN's hidden units: GELU keeps x·W_up and its GELU (2 per unit), SwiGLU the gate, its SiLU, the up
    projection and their product (4 per unit); the input row is counted by whoever produced it. Routed experts
    keep the same on their grouped_mm path (GPUs, torch.compile); CPU's eager expert-by-expert path recomputes
    SiLU in backward and keeps one A·F_e·s less per SwiGLU layer."""
    return (4 if activation == "swiglu" else 2) * rows * width * s


def _assignments(config: ModelConfig, num_tokens: int) -> int:
    """A = N·K dropless; under a capacity at most E·C (every expert full), whichever is smaller."""
    moe = config.moe
    assignments = num_tokens * moe.top_k
    if moe.capacity_factor is None:
        return assignments
    capacity = expert_capacity(
        num_tokens,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        capacity_factor=moe.capacity_factor,
        min_capacity=moe.min_capacity,
    )
    return min(assignments, moe.num_experts * capacity)


def _moe_bytes(config: ModelConfig, num_tokens: int, s: int) -> tuple[int, int]:
    """(MoE sub-layer without dispatch, dispatch) bytes of one MoE layer.

    MoE: norm + the router's fp32 input copy when s < 4 (N·D·4) + router logits, softmax, balancing
    probabilities and loss terms (≈ 4·N·E·4) + top-k ids, gates and their sum (N·K·(8 + 4) + N·4) + expert
    hidden units over A rows + shared experts' hidden units over N rows.
    Dispatch: the gathered rows x_AD (A·D·s) + combine's gathered outputs y_NKD (N·K·D·s) + slot_NK (N·K·8) and
    the token and assignment ids (2·A·8).
    """
    moe, D, K, E = config.moe, config.d_model, config.moe.top_k, config.moe.num_experts
    A = _assignments(config, num_tokens)
    router = (num_tokens * D * 4 if s < 4 else 0) + 4 * num_tokens * E * 4 + num_tokens * K * 12 + num_tokens * 4
    shared_width = moe.num_shared_experts * moe.expert_d_ff
    hidden = _hidden_bytes(A, moe.expert_d_ff, config.activation, s)
    shared = _hidden_bytes(num_tokens, shared_width, config.activation, s)
    dispatch = A * D * s + num_tokens * K * D * s + num_tokens * K * 8 + 2 * A * 8
    return _norm_bytes(config, num_tokens, s) + router + hidden + shared, dispatch


@memoized_by_config
def activation_bytes(
    config: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    checkpointing: str = "none",
    attention_mask: bool = False,
    *,
    layers: Sequence[int] | None = None,
    head: bool = True,
) -> ActivationBytes:
    """Bytes of activations one micro-batch keeps for backward, by part (dropout 0); of the blocks `layers` only
    (default all) and, with `head`, the final norm and head (a pipeline stage's pieces: `pipeline_activation_bytes`).

    checkpointing="none": every sub-layer keeps what its backward reads (the helpers above give each formula).
    "moe": each MoE sub-layer keeps only its input (N·D·s) and is rebuilt in backward, one layer at a time, so the
    largest MoE sub-layer (+ its dispatch) is counted once as `recompute`. "full": each block keeps only its input
    (N·D·s), and the largest block is rebuilt once at a time (counted beyond the 3·N·V·4 bytes of cross-entropy
    it replaces at the peak: backward frees those before it rebuilds anything). Logits are never checkpointed:
    N·V·s for the logits the model returns + N·V·4 for the fp32 log-probabilities cross-entropy keeps + 2·N·V·4
    for their fp32 gradients at the start of backward (where a training step peaks) + the final norm.
    `attention_mask` (padding, or packed documents' block-diagonal mask): SDPA keeps the mask converted to the
    activations' dtype, B·S²·s per layer. ALiBi instead keeps its float bias once (`_alibi_bias_bytes`), with
    any mask folded in. MLA's attention sub-layers: `_mla_attention_bytes`.
    With `head`, the MTP modules too (`mtp`): module k is a block over B·(S - k) tokens, its input norms, M_k's
    input, its norm, logits and their gradients (`_logits_bytes`).
    Under bf16 autocast (fp32 weights) the norms stay fp32 and each linear keeps a bf16 copy of its input: this
    estimate, written for activations in the weights' dtype, undercounts that case.
    """
    if precision not in ACTIVATION_BYTES:
        raise ValueError(f"precision={precision!r} is unknown: use one of {tuple(ACTIVATION_BYTES)}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} is unknown: use one of {CHECKPOINTING}")
    s, N, D = ACTIVATION_BYTES[precision], micro_batch_size * seq_len, config.d_model
    block_input = N * D * s
    ffn = moe = dispatch = recompute = 0
    layer_ids = range(config.n_layers) if layers is None else layers
    # ALiBi's bias lives outside the blocks: one tensor for all layers (of a pipeline stage, which builds its own),
    # kept under every checkpointing mode.
    attention = _alibi_bias_bytes(config, micro_batch_size, seq_len, s, attention_mask) if len(layer_ids) else 0
    for layer in layer_ids:
        if config.attention == "mla":
            layer_attention = _mla_attention_bytes(config, N, seq_len, s)
        else:
            layer_attention = _attention_bytes(config, N, s)
        # ALiBi folds the mask into its float bias; SDPA's math path adds the mask and keeps nothing of it.
        fused = config.attention != "mla" or mla_sdpa_is_fused(config)
        if attention_mask and fused and config.pos_encoding != "alibi":
            layer_attention += micro_batch_size * seq_len**2 * s
        layer_ffn = layer_moe = layer_dispatch = 0
        if config.is_moe_layer(layer):
            layer_moe, layer_dispatch = _moe_bytes(config, N, s)
        else:
            layer_ffn = _norm_bytes(config, N, s) + _hidden_bytes(N, config.d_ff, config.activation, s)
        if checkpointing == "full":
            attention += block_input
            recompute = max(recompute, layer_attention + layer_ffn + layer_moe + layer_dispatch)
        elif checkpointing == "moe" and config.is_moe_layer(layer):
            attention, ffn, moe = attention + layer_attention, ffn + layer_ffn, moe + block_input
            recompute = max(recompute, layer_moe + layer_dispatch)
        else:
            attention, ffn = attention + layer_attention, ffn + layer_ffn
            moe, dispatch = moe + layer_moe, dispatch + layer_dispatch
    if not head:
        return ActivationBytes(attention, ffn, moe, dispatch, 0, recompute)
    logits = sum(_logits_bytes(config, N, s))
    mtp = 0
    for k in range(1, config.mtp.depth + 1):  # module k over the S - k positions with a token k ahead
        S_k = seq_len - k
        N_k = micro_batch_size * S_k
        block = activation_bytes(
            config, micro_batch_size, S_k, precision, checkpointing, attention_mask, layers=[config.n_layers + k - 1],
            head=False,
        )  # fmt: skip
        # The two input norms keep their inputs and statistics but not their outputs, which only the concatenation
        # reads (M_k keeps that, 2·N·D·s); the hidden norm's input is the final norm's output, counted by the head.
        inputs = 2 * _norm_bytes(config, N_k, s) - 3 * N_k * D * s + 2 * N_k * D * s
        mtp += inputs + block.attention + block.ffn + block.moe + block.dispatch + sum(_logits_bytes(config, N_k, s))
        recompute = max(recompute, block.recompute)
    # Backward rebuilds the last checkpointed piece after cross-entropy's backward has freed the log-probabilities
    # and their gradients, so the rebuilt piece only counts beyond those 3·N·V·4 bytes.
    recompute = max(0, recompute - 3 * N * config.vocab_size * 4)
    return ActivationBytes(attention, ffn, moe, dispatch, logits, recompute, mtp)


def _logits_bytes(config: ModelConfig, num_tokens: int, s: int) -> tuple[int, int]:
    """(what forward keeps, what backward adds as it starts) of the final norm and head: the norm, the N·V·s logits
    and cross-entropy's N·V·4 fp32 log-probabilities; then the fp32 gradients of the log-probabilities and of the
    logits, 2·N·V·4, which join everything forward kept before backward frees any of it (where a step peaks)."""
    logits = num_tokens * config.vocab_size
    return _norm_bytes(config, num_tokens, s) + logits * (s + 4), 2 * logits * 4


# ---------------------------------------------------------------------------------------------------------------
# Activations under pipeline parallelism
# ---------------------------------------------------------------------------------------------------------------
#
# A pipeline rank holds, at its peak, several micro-batches' activations of its own stages: those whose forward the
# schedule has run and whose backward it has not (moe.stages.in_flight, from torch's schedules). torch's
# PipelineStage (torch/distributed/pipelining/stage.py) adds per stage: the stage's output, kept for its backward
# (fwd_cache) per micro-batch in flight; m receive buffers for its inputs and m for its outputs' gradients,
# allocated once for every micro-batch of the step; and its inputs' gradients, which autograd leaves on those
# buffers until the next step clears them. N = b·S tokens of a pipeline micro-batch of b rows.


def pipeline_micro_batch_rows(run: RunShape) -> int:
    """b: the rows of one pipeline micro-batch, a pipeline's step of micro_batch_size × grad_accum rows cut into m
    (micro_batch_size itself when m = grad_accum); micro_batch_size without a pipeline."""
    if run.pipeline_size == 1:
        return run.micro_batch_size
    return run.micro_batch_size * run.grad_accum // run.microbatches


def activations_in_flight(run: RunShape, pipeline_rank: int) -> int:
    """Chunk-forwards whose activations pipeline rank p holds at once at its peak, summed over its stages (each a
    stage chunk of one micro-batch): gpipe m; 1f1b min(m, PP - p); interleaved_1f1b min((V-1)·M + 2·(PP-1-p) + 1,
    V·m) with M = m / max(1, m // PP); zbv min(2·PP-1-p, m) + min(p+1, m); dualpipev 2·PP + 1
    (`moe.stages.in_flight` says why, per stage). 1 without a pipeline."""
    _check_pipeline(run)
    counts = in_flight(run.schedule, run.pipeline_size, run.microbatches, run.virtual_stages, pipeline_rank)
    return sum(counts.values())


@dataclass(frozen=True)
class PipelineActivationBytes:
    """One pipeline rank's activation bytes at its peak, by part (`pipeline_activation_bytes` gives the formulas)."""

    in_flight: dict[int, int]  # each of its stages → micro-batches it holds at the peak
    kept: float  # Σ_stages n · what one micro-batch's forward keeps of the stage (its output added, its input not)
    logits_gradients: float  # last stage: the fp32 gradients of the log-probabilities and logits, once
    buffers: float  # torch's receive buffers and the input gradients left on them, m per stage
    recompute: float  # the largest checkpointed piece of its stages, rebuilt one at a time

    @property
    def total(self) -> float:
        return self.kept + self.logits_gradients + self.buffers + self.recompute


def pipeline_activation_bytes(config: ModelConfig, run: RunShape, pipeline_rank: int) -> PipelineActivationBytes:
    """Activation bytes pipeline rank p holds at its peak, as the first backward of its steady state starts.

    Per stage s of the rank, with n_s micro-batches in flight (`moe.stages.in_flight`), N·D·s bytes a stage's
    input or output: kept = n_s · (A_s + [s not last] N·D·s − [s not first] N·D·s), A_s the activations one
    micro-batch keeps of its layers (`activation_bytes` with layers=its layers: ALiBi's bias once per stage, which
    builds its own) and on the last stage of its final norm, logits and log-probabilities; the output is what torch
    keeps for the backward, the input is a receive buffer, counted there (the layer that keeps it reads that
    buffer). Last stage: + the logits' gradients 2·N·V·4 once. Buffers: m · N·D·s for the inputs received from
    another rank, m · N·D·s for the inputs' gradients (all of them by the step's end), and m · N·D·s for the
    output gradients received from another rank (the V schedules' turn on one rank hands tensors over instead).
    Recompute: the largest of its stages' `activation_bytes(...).recompute`. The embedding keeps only the ids, as
    without a pipeline. Without a pipeline this is `activation_bytes` of the whole model, at n = 1 and no buffers.
    """
    _check_layout(config, run)
    _pipeline_ranks(run, pipeline_rank)
    P, m = run.pipeline_size, run.microbatches
    layout = pipeline_layout(config, run) if P > 1 else None
    rows, S, s = pipeline_micro_batch_rows(run), run.seq_len, ACTIVATION_BYTES[run.precision]
    N = rows * S
    boundary = N * config.d_model * s  # one stage input or output, [b, S, D]
    counts = in_flight(run.schedule, P, m, layout.num_stages // P if layout else 1, pipeline_rank)
    stages = layout.stages_of_rank(pipeline_rank) if layout else [0]
    last = layout.num_stages - 1 if layout else 0
    kept = logits_gradients = buffers = recompute = 0.0
    for stage in stages:
        layers = layout.layers(stage) if layout else None
        head = stage == last
        acts = activation_bytes(
            config, rows, S, run.precision, run.checkpointing, run.attention_mask, layers=layers, head=head
        )
        stage_kept = acts.attention + acts.ffn + acts.moe + acts.dispatch
        if head:  # and the MTP modules, which run on the last stage
            logits_kept, logits_gradients = _logits_bytes(config, N, s)
            stage_kept += logits_kept + acts.mtp
        stage_kept += (0 if head else boundary) - (boundary if stage > 0 else 0)
        kept += counts[stage] * stage_kept
        recompute = max(recompute, acts.recompute)
        if layout is not None:
            remote_input = stage > 0 and layout.rank_of_stage(stage - 1) != pipeline_rank
            remote_output = not head and layout.rank_of_stage(stage + 1) != pipeline_rank
            buffers += m * boundary * (remote_input + (stage > 0) + remote_output)
    return PipelineActivationBytes(counts, kept, logits_gradients, buffers, recompute)


def activation_bytes_per_rank(config: ModelConfig, run: RunShape, pipeline_rank: int | None = None) -> float:
    """The activation bytes a rank holds at its peak: one micro-batch's `activation_bytes` without a pipeline; under
    PP `pipeline_activation_bytes` of `pipeline_rank` (None: the rank with the most)."""
    if run.pipeline_size == 1:
        return activation_bytes(
            config, run.micro_batch_size, run.seq_len, run.precision, run.checkpointing, run.attention_mask
        ).total
    return _worst(run, pipeline_rank, lambda p: pipeline_activation_bytes(config, run, p).total, float)


def expert_received_bytes(config: ModelConfig, run: RunShape, pipeline_rank: int | None = None) -> float:
    """The part of `activation_bytes_per_rank` that grows with the assignments an expert rank receives: per MoE layer
    kept for backward, the A gathered rows x_AD (A·D·s) and the expert hidden units over them; under PP times the
    micro-batches in flight of its stages; under checkpointing ("moe", "full") only the one MoE layer rebuilt at a
    time. Uniform routing (A = N·K); a rank receiving f times the mean holds (f - 1) times this much more."""
    if config.moe is None:
        return 0.0
    _check_layout(config, run)
    s, N = ACTIVATION_BYTES[run.precision], pipeline_micro_batch_rows(run) * run.seq_len
    A = _assignments(config, N)
    per_layer = A * config.d_model * s + _hidden_bytes(A, config.moe.expert_d_ff, config.activation, s)

    def of_rank(p: int) -> float:
        if run.pipeline_size == 1:
            layers_in_flight = [(list(range(config.num_blocks)), 1)]  # with the MTP modules' blocks
        else:
            layout = pipeline_layout(config, run)
            counts = in_flight(
                run.schedule, run.pipeline_size, run.microbatches, layout.num_stages // run.pipeline_size, p
            )
            layers_in_flight = [(layout.layers(stage), counts[stage]) for stage in layout.stages_of_rank(p)]
        moe_layers = [(sum(map(config.is_moe_layer, layers)), n) for layers, n in layers_in_flight]
        if run.checkpointing != "none":
            return per_layer if any(count for count, _ in moe_layers) else 0.0
        return per_layer * sum(count * n for count, n in moe_layers)

    return _worst(run, pipeline_rank, of_rank, float)


# ---------------------------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------------------------


def _human(n: float, unit: str) -> str:
    if unit == "B":
        for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if n >= scale:
                return f"{n / scale:.2f} {suffix}"
        return f"{n:.0f} B"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}"


def _table(title: str, rows: list[tuple[str, str, str]]) -> str:
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    lines = [title]
    lines += [f"  {name:<{width}}  {value:>{value_width}}  {assumption}" for name, value, assumption in rows]
    return "\n".join(lines)


def format_ledger(config: ModelConfig, run: RunShape) -> str:
    """The five tables (six under expert parallelism, and one more under pipeline parallelism, a row per pipeline
    rank; the per-rank tables then show the rank with the most training state), each row with its assumption."""
    params = count_parameters(config)
    rank = None  # under PP: the pipeline rank the per-rank tables show
    if run.pipeline_size > 1:
        _check_layout(config, run)
        rank = max(range(run.pipeline_size), key=lambda p: training_state_bytes_per_rank(config, run, p).total)
    state = training_state_bytes_per_rank(config, run, rank)
    flops = matmul_flops_per_token(config, run.seq_len)
    if config.attention == "mla":
        attention_note = "MLA: query path, W_DKV + W_KR, latent norm, W_UK + W_UV, W_O"
        projection_note = "query path, W_DKV + W_KR, W_UK + W_UV on every token, W_O"
        attention_flops_note = (
            "2 · S · H · (n + r) + 2 · S · H · max(v, n + r) (narrower values are padded), full S×S grid"
        )
    else:
        attention_note = f"Q, K, V, O over all layers ({config.n_heads} query, {config.n_kv_heads} KV heads)"
        projection_note = "Q, K, V, O"
        attention_flops_note = "4 · S · H · d_h, full S×S grid (mask saves none)"
    if config.pos_encoding == "alibi":
        attention_flops_note += "; ALiBi's bias is an addition"
    moe_note = "router + top-k experts + shared experts per MoE layer" if config.moe else "dense: active = total"
    tables = [
        _table(
            f"Parameters (attention={config.attention}, pos_encoding={config.pos_encoding})",
            [
                ("total", f"{params.total:,}", "every weight the model stores"),
                ("active per token", f"{params.active:,}", moe_note),
                ("embedding", f"{params.embedding:,}", "token table (+ learned positions)"),
                ("lm head", f"{params.lm_head:,}", "0 when tied to the embedding"),
                ("attention", f"{params.attention:,}", attention_note),
                ("ffn / experts", f"{params.ffn_total:,}", "dense FFNs, experts, routers, shared experts"),
                ("norms", f"{params.norms:,}", f"{config.norm}: γ{' and β' if config.norm == 'layernorm' else ''}"),
                *_mtp_rows(config, params.mtp_total, "norms, M_k, block; embedding and head shared"),
            ],
        ),
        _training_state_table(config, run, state, rank),
        _kv_cache_table(config, run),
        _table(
            f"Matmul FLOPs per token (S={run.seq_len}, multiply-add = 2)",
            [
                ("projections", _human(flops.projections, "FLOP"), projection_note),
                ("attention", _human(flops.attention, "FLOP"), attention_flops_note),
                ("ffn", _human(flops.ffn, "FLOP"), "active experts only" if config.moe else "dense FFN"),
                ("lm head", _human(flops.lm_head, "FLOP"), "2 · D · V"),
                *_mtp_rows(config, _human(flops.mtp, "FLOP"), "per module M_k, a block, the shared head"),
                ("forward", _human(flops.forward, "FLOP"), "excludes softmax, norms, activations, memory traffic"),
                ("training step", _human(flops.training, "FLOP"), "≈ 3 × forward"),
            ],
        ),
    ]
    tables.insert(2, _activation_table(config, run))
    if run.ep_size > 1:
        tables.insert(2, _expert_parallel_table(config, run, state, rank))
    if run.pipeline_size > 1:
        tables.insert(2, _pipeline_table(config, run))
    return "\n\n".join(tables)


def _mtp_rows(config: ModelConfig, value, note: str) -> list[tuple[str, str, str]]:
    """A table's row for the MTP modules, only in a model that has them."""
    if not config.mtp.depth:
        return []
    return [
        (
            f"mtp ({config.mtp.depth} module{'s' if config.mtp.depth > 1 else ''})",
            f"{value:,}" if isinstance(value, int) else value,
            note,
        )
    ]


def _layout(run: RunShape) -> str:
    """The sharding layout in words: ZeRO stage and ranks, or FSDP/HSDP's shard groups; EP's expert blocks."""
    W, EP, R = run.dp_size, run.ep_size, run.replicate_size
    if not run.fsdp:
        layout = f"ZeRO-{run.zero_stage}, {W} data-parallel ranks"
    elif R > 1:
        layout = f"HSDP: {R} replicas × shards over W/R = {W // R} of W={W} ranks"
    else:
        layout = f"FSDP2 over W={W} ranks"
    if EP > 1:
        layout += f", experts over EP={EP}" + (f" × W/EP = {W // EP} expert-data-parallel" if run.fsdp else "")
    return layout


def _training_state_table(
    config: ModelConfig, run: RunShape, state: TrainingStateBytes, rank: int | None = None
) -> str:
    if run.fsdp:
        dense_shards = run.dp_size // run.replicate_size
        experts = "routed / W" if run.ep_size > 1 else f"routed / {dense_shards}"
        shards = f"non-expert / {dense_shards}, {experts}" if config.moe else f"/ {dense_shards}"
        rows = [
            ("weights", _human(state.weights, "B"), f"fp32 shards ({shards}), the master weights"),
            ("gradients", _human(state.gradients, "B"), "fp32 shards, reduce-scattered"),
            ("optimizer", _human(state.optimizer, "B"), f"{_optimizer_state(run)} of the shards"),
            ("total", _human(state.total, "B"), FSDP_ASSUMPTION),
        ]
        transient = sharding_transient_bytes(config, run, rank)
        p = run.precision  # the param dtype FSDP gathers and computes in
        if rank is None:
            gathered_note = f"root + 2 largest blocks in {p} (one prefetched)"
            gradients_note = f"root + largest block in {p}, until reduced"
        else:  # torch's pipeline stage reshards and reduces only at the step's end
            gathered_note = f"every unit of its stages in {p}, from its backward to the step's end"
            fresh = " (+ one unit's)" if p != "fp32" else ""
            gradients_note = f"all its units', summed in fp32 until the step's end{fresh}"
        rows += [
            ("gathered", _human(transient.gathered, "B"), gathered_note),
            ("unsharded grads", _human(transient.gradients, "B"), gradients_note),
            ("reduce-scatter", _human(transient.reduce_scatter, "B"), "largest unit's fp32 reduce-scatter input"),
        ]
    else:
        rows = [
            ("weights", _human(state.weights, "B"), "sharded at stage 3"),
            ("gradients", _human(state.gradients, "B"), "sharded at stage ≥ 2, then fp32 partitions"),
            ("master", _human(state.master, "B"), "DeepSpeed's fp32 partition, at stage ≥ 1"),
            ("optimizer", _human(state.optimizer, "B"), f"{_optimizer_state(run)}, sharded at stage ≥ 1"),
            ("total", _human(state.total, "B"), PRECISION_ASSUMPTIONS[run.precision]),
        ]
        if run.zero_stage == 3:
            transient = sharding_transient_bytes(config, run)
            rows += [
                ("gathered", _human(transient.gathered, "B"), f"largest module in {run.precision} (MoE layer: all E)"),
                (
                    "unsharded grads",
                    _human(transient.gradients, "B"),
                    f"its gradients in {run.precision}, until reduced",
                ),
            ]
    rows.append(("not counted", "-", "activations, buffers, allocator slack, communication buckets"))
    where = "" if rank is None else f"; pipeline rank {rank} of PP={run.pipeline_size}, the most"
    return _table(f"Training state per rank ({run.precision}, {_layout(run)}{where})", rows)


def _optimizer_state(run: RunShape) -> str:
    if run.optimizer == "muon":
        return f"Muon momentum {MUON_BYTES} B (block matrices, experts) + AdamW m, v {ADAMW_BYTES} B (the rest)"
    return "AdamW m, v"


def _kv_cache_table(config: ModelConfig, run: RunShape) -> str:
    """GQA: the per-head K and V payload. MLA: the latent payload beside what an MHA cache of the same heads and
    widths would hold, and the ratio."""
    s, B, S = run.kv_bytes_per_element, run.micro_batch_size, run.seq_len
    kv, kv_per_token = kv_cache_bytes(config, B, S, s), kv_cache_bytes(config, 1, 1, s)
    shape = f"B={B}, S={S}"
    if config.attention != "mla":
        return _table(
            f"KV cache ({s} B/element, {config.n_kv_heads} KV heads × {config.head_dim} dims)",
            [
                ("per token", _human(kv_per_token, "B"), "2 · L · H_kv · d_h · s"),
                (shape, _human(kv, "B"), "2 · B · L · S · H_kv · d_h · s, payload only"),
            ],
        )
    mla = config.mla
    mha = mha_kv_cache_bytes(config, B, S, s)
    return _table(
        f"KV cache ({s} B/element, MLA latent d_c={mla.kv_lora_rank} + RoPE key d_r={mla.qk_rope_head_dim} "
        "per layer and position)",
        [
            ("per token", _human(kv_per_token, "B"), "L · (d_c + d_r) · s"),
            (shape, _human(kv, "B"), "B · L · S · (d_c + d_r) · s, payload only (seed 001)"),
            (
                "MHA equivalent",
                _human(mha, "B"),
                f"B · L · S · H · (n + r + v) · s: keys of n + r = {mla.qk_head_dim}, values of v = "
                f"{mla.v_head_dim}, {config.n_heads} heads",
            ),
            ("ratio", f"{mha / kv:.1f}×", "MHA-equivalent / latent cache"),
        ],
    )


def _expert_parallel_table(
    config: ModelConfig, run: RunShape, state: TrainingStateBytes, rank: int | None = None
) -> str:
    """The figures EP changes, for the whole model, or under PP for pipeline rank `rank`'s stages."""
    W, EP, E = run.dp_size, run.ep_size, config.moe.num_experts
    expert_matrices = 3 if config.activation == "swiglu" else 2  # w_gate (SwiGLU only), w_up, w_down
    dense_shards, expert_shards = _shard_counts(run)
    dense_params, routed = held_params_by_rank(config, run)[rank or 0]
    expert_params = routed // EP
    muon = run.optimizer == "muon"
    experts = training_state_bytes(
        expert_params, run.precision, run.zero_stage, expert_shards, fsdp=run.fsdp,
        muon_params=expert_params if muon else 0,
    )  # fmt: skip
    expert_b = MUON_BYTES if muon else ADAMW_BYTES
    dense_b = f"({MUON_BYTES} B Muon or {ADAMW_BYTES} B AdamW)" if muon else f"{ADAMW_BYTES} B"
    if run.fsdp:
        dense = "non-expert / (W/R)" if run.replicate_size > 1 else "non-expert / W"
        optimizer_formula = f"{dense_b} · ({dense} + routed / EP / (W/EP)), FSDP2"
        expert_formula = f"{expert_b} B · routed / (EP · W/EP) = routed / W: EP splits, FSDP shards each block"
    elif run.zero_stage >= 1:
        optimizer_formula = f"{dense_b} · (replicated / W + routed / EP / (W/EP)), ZeRO-{run.zero_stage}"
        expert_formula = f"{expert_b} B · routed / EP / (W/EP): DeepSpeed partitions each block over W/EP (measured)"
    else:
        optimizer_formula = f"{dense_b} · params per rank, ZeRO-0: unsharded"
        expert_formula = f"{expert_b} B · routed / EP, ZeRO-0: each block unsharded on its W/EP ranks"
    layers = None
    if rank is not None:
        layout = pipeline_layout(config, run)
        layers = [layer for s in layout.stages_of_rank(rank) for layer in layout.layers(s)]
    a2a = all_to_all_bytes_per_step(
        config, run.micro_batch_size * run.seq_len, run.grad_accum, EP, ACTIVATION_BYTES[run.precision], layers=layers
    )
    stored = stored_params_per_rank(config, run, rank)
    where = "" if rank is None else f"; pipeline rank {rank}'s stages"
    return _table(
        f"Expert parallelism (EP={EP} of W={W} ranks: E/EP = {E // EP} experts per rank per MoE layer, "
        f"each block on W/EP = {W // EP} ranks{where})",
        [
            (
                "expert params per rank",
                f"{expert_params:,}",
                f"routed experts / EP = L_moe · (E/EP) · {expert_matrices}·D·F",
            ),
            (
                "params per rank",
                f"{dense_params + expert_params:,}",
                "replicated (all but routed experts; routers, shared experts) + routed / EP",
            ),
            *(
                [
                    (
                        "params stored per rank",
                        f"{stored:,.0f}",
                        f"sharded: non-expert / {dense_shards} + expert / {expert_shards}",
                    )
                ]
                if stored != dense_params + expert_params
                else []
            ),
            ("optimizer per rank", _human(state.optimizer, "B"), optimizer_formula),
            ("expert optimizer per rank", _human(experts.optimizer, "B"), expert_formula),
            (
                "all-to-all per step",
                _human(a2a, "B"),
                f"4 · L_moe · B·S·K · (EP-1)/EP · D · s × {run.grad_accum} micro-batches, "
                f"s = {ACTIVATION_BYTES[run.precision]} B, uniform routing, payload only",
            ),
        ],
    )


def _pipeline_table(config: ModelConfig, run: RunShape) -> str:
    """A row per pipeline rank: its stages' pieces, what it holds and, at its peak, the activations in flight."""
    layout = pipeline_layout(config, run)
    P, m, V = run.pipeline_size, run.microbatches, layout.num_stages // run.pipeline_size
    held = held_params_by_rank(config, run)
    header = ["rank", "stages", "params held", "training state", *(["gathered"] if run.fsdp else []), "in flight"]
    header += ["activations", "peak"]
    rows = []
    for p in range(P):
        state = training_state_bytes_per_rank(config, run, p).total
        transient = sharding_transient_bytes(config, run, p).total
        acts = pipeline_activation_bytes(config, run, p)
        mine = layout.stages_of_rank(p)
        flight = " + ".join(str(acts.in_flight[stage]) for stage in mine)
        dense, routed = held[p]
        pieces = {stage: [*map(str, layout.stages[stage])] for stage in mine}
        if runs_mtp(config, layout, p):  # the MTP modules after the head, reading the embedding's copy
            pieces[layout.num_stages - 1] += [
                "mtp",
                *(["(embed copy)"] if holds_embedding_copy(config, layout, p) else []),
            ]
        rows.append([
            str(p),
            " | ".join(" ".join(pieces[stage]) for stage in mine),
            f"{dense + routed // run.ep_size:,}",
            _human(state, "B"),
            *([_human(transient, "B")] if run.fsdp else []),
            flight if len(mine) == 1 else f"{sum(acts.in_flight.values())} = {flight}",
            _human(acts.total, "B"),
            _human(state + transient + acts.total, "B"),
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"Pipeline (PP={P}, schedule {run.schedule}, m={m} micro-batches of b={pipeline_micro_batch_rows(run)} rows, "
        f"V={V} stage{'s' if V > 1 else ''} per rank, each stage over W={run.dp_size} data-parallel ranks)"
    ]
    for row in [header, *rows]:  # the pieces left-aligned, the figures right-aligned
        cells = [row[i].ljust(w) if i == 1 else row[i].rjust(w) for i, w in enumerate(widths)]
        lines.append("  " + "  ".join(cells).rstrip())
    bubble = bubble_fraction(run.schedule, P, m, V)
    s = ACTIVATION_BYTES[run.precision]
    notes = [
        ("bubble", f"{bubble:.1%}", f"{BUBBLE_FORMULAS[run.schedule]}: a stage's idle share of a step, no comms"),
        (
            "params held",
            "-",
            "its stages' pieces, routed experts / EP; the rows sum to the model"
            + (" and the last stage's copy of the embedding (MTP)" if any(
                holds_embedding_copy(config, layout, p) for p in range(P)) else ""),
        ),
        ("in flight", "-", f"micro-batches held per stage at the peak, {IN_FLIGHT_FORMULAS[run.schedule]}"),
        (
            "activations",
            "-",
            f"n · (its layers + its output − its input) per stage + the last one's logits and their gradients + "
            f"torch's m receive buffers and input gradients of b·S·D·s, s = {s} B",
        ),
        ("peak", "-", "training state + gathered + activations: predict_peak's figure for the rank"),
    ]  # fmt: skip
    if run.fsdp:
        notes.insert(-1, ("gathered", "-", "FSDP's gathered units, unsharded grads and reduce-scatter input (above)"))
    width = max(len(name) for name, _, _ in notes)
    value_width = max(len(value) for _, value, _ in notes)
    lines += [f"  {name:<{width}}  {value:>{value_width}}  {note}" for name, value, note in notes]
    return "\n".join(lines)


def _activation_table(config: ModelConfig, run: RunShape) -> str:
    acts = activation_bytes(
        config, run.micro_batch_size, run.seq_len, run.precision, run.checkpointing, run.attention_mask
    )
    s = ACTIVATION_BYTES[run.precision]
    if config.attention == "mla":
        attention_note = "norm, latents and their norms, per-head q, k, v, SDPA output" + (
            "" if mla_sdpa_is_fused(config) else ", S×S probabilities (v > n + r: math SDPA)"
        )
    else:
        attention_note = "norm, Q, K, V, SDPA output"
    if config.pos_encoding == "alibi":
        attention_note += ", ALiBi's float bias once (H·S²·s" + (", × B with a mask)" if run.attention_mask else ")")
    elif run.attention_mask and (config.attention != "mla" or mla_sdpa_is_fused(config)):
        attention_note += " and mask"
    rows = [
        ("attention", _human(acts.attention, "B"), attention_note),
        ("ffn", _human(acts.ffn, "B"), "dense FFN sub-layers: norm and hidden units"),
    ]
    if config.moe is not None:
        rows += [
            ("moe", _human(acts.moe, "B"), "norm, router, expert and shared-expert hidden units"),
            ("dispatch", _human(acts.dispatch, "B"), "gathered rows A·D + combine's N·K·D + index tensors"),
        ]
    rows += [
        ("logits", _human(acts.logits, "B"), "final norm, N·V logits, fp32 log-probs and their gradients"),
        *_mtp_rows(config, _human(acts.mtp, "B"), "per module k: a block over B·(S-k) tokens, norms, its logits"),
        ("recompute", _human(acts.recompute, "B"), "the largest checkpointed piece, rebuilt once at a time"),
        (
            f"activations per micro-batch ({run.checkpointing})",
            _human(acts.total, "B"),
            "kept for backward, peak as backward starts; dropout 0",
        ),
    ]
    for mode in CHECKPOINTING:
        if mode != run.checkpointing and (mode != "moe" or config.moe is not None):
            other = activation_bytes(config, run.micro_batch_size, run.seq_len, run.precision, mode, run.attention_mask)
            rows.append((f"  with checkpointing={mode}", _human(other.total, "B"), "the same micro-batch"))
    return _table(
        f"Activations per micro-batch (B={run.micro_batch_size}, S={run.seq_len}, s = {s} B, "
        f"checkpointing={run.checkpointing})",
        rows,
    )
