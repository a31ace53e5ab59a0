"""How long one optimizer step of a layout takes on a cluster: the planner's time model, all of it in this module.

    step = compute + exposed all-to-all + exposed data-parallel communication + exposed pipeline P2P + bubble
           + Muon's Newton–Schulz (optim.name=muon)

Every term is per rank and taken on the slowest one (the pipeline rank with the most work; under EP the expert rank
that receives the most tokens). Legend: W ranks, PP pipeline ranks, D = W/PP data-parallel ranks per stage, EP
expert-parallel ranks, m micro-batches per step, b rows per micro-batch, S sequence length, d model width, s bytes
per activation element, p bytes per gathered weight, G GPUs per node.

compute   = F_rank · T_rank / (peak[dtype] · matmul_efficiency)  +  bytes_moved / (HBM · memory_efficiency)
            + per_layer_overhead_s · layers_rank · m.
            F_rank: the training matmul FLOPs per token of the rank's stages (moe.stages.layer_costs: 3 × forward,
            the head and the MTP modules on the last stage), + one more forward of what activation checkpointing
            rebuilds ("full": the blocks, "moe": the MoE layers), the routed experts' share × `imbalance` on the
            most loaded EP rank.
            T_rank = global batch × S / D tokens. dtype: the run's precision (bf16, fp32: plain FP32, not TF32), or
            `matmul_dtype` (e.g. fp8 for a run whose GEMMs are FP8, like DeepSeek-V3's: the planner then assumes
            every matmul at that rate, an upper bound on what FP8 training gets, whose attention and some GEMMs
            stay bf16). bytes_moved: the optimizer step moves the rank's training state `optimizer_passes`
            times (2: reads and writes it once), and elementwise work moves every activation byte
            `activation_passes` times per micro-batch (written in forward, read in backward, its gradient written).
all-to-all = m · L_moe,rank · n_a2a · (max(on_node / intra, off_node / inter) / comm_efficiency + latency) · imbalance,
            n_a2a = 4 transfers per MoE layer (dispatch and combine, forward and backward; 6 when checkpointing
            replays the forward's two), on_node + off_node = b·S·K·(EP-1)/EP·d·s bytes a rank sends, split by
            where its EP peers live (consecutive ranks fill a node first); × (1 - a2a_overlap) exposed.
data-parallel: ring collectives, all-reduce 2·(n-1)/n · bytes / bw, reduce-scatter and all-gather (n-1)/n · bytes
            / bw, bw = the group's link × comm_efficiency (NVLink inside a node, the NIC across; reduce-scatter
            and all-gather × reduce_scatter_speed, all_gather_speed relative to an all-reduce), + latency each;
            non-expert state over the stage's D ranks (HSDP: shards over D/R, all-reduce over R), expert blocks
            over their D/EP expert-data-parallel ranks. What each strategy sends:
              DDP          grads (fp32) all-reduced once per step, during the last micro-batch's backward;
              ZeRO-1       grads (p) reduce-scattered once per step + weights (p) all-gathered after the step;
              ZeRO-2       grads (p) reduce-scattered every micro-batch + weights all-gathered after the step;
              ZeRO-3       weights (p) all-gathered in forward and in backward, grads reduce-scattered, every
                           micro-batch;
              FSDP2        the same as ZeRO-3, grads in fp32 (its reduce dtype); without reshard_after_forward
                           one gather per micro-batch; under PP one gather and one reduce-scatter per step (torch's
                           stage reduces only at the step's end, and our DDP-in-stage sync waits for it too).
            Exposed = comm - min(comm, dp_overlap · the compute it can hide behind): the backward of its window
            (one micro-batch, or the step's last one), forward and backward for gathers; what runs after the last
            backward (ZeRO's weight all-gather, pipeline reductions) hides behind nothing.
pipeline P2P = 2 · (PP - 1) · (b·S·d·s / bw + latency): the fill and the drain cross every boundary once on the
            critical path; the steady state's sends overlap with the next micro-batch's compute.
bubble    = (compute + all-to-all) · f / (1 - f), f = moe.stages.bubble_fraction(schedule, PP, m, V).

muon      = NS FLOPs of the matrices the rank orthogonalises / (peak[NS dtype] · matmul_efficiency)
            + under FSDP/HSDP the all-gather of its row-sharded 2-D matrices in NS's dtype over the shard group
            (train/optimizers.py; one message per matrix), after the last backward, so hidden behind nothing.
            NS_k of an a×b matrix, a ≤ b: k·(4·a²·b + 2·a³) (`newton_schulz_flops`). Every rank of a stage runs NS
            on every whole 2-D matrix of its layers (DDP and FSDP alike: under FSDP it gathers them first); the
            routed experts are split: E/EP per rank under DDP, and under FSDP each expert stack is sharded along E
            over its holders (the busiest rank: ⌈E/EP / (D/EP)⌉ experts, ⌈E / (D/R)⌉ without EP).
tokens/s = global batch × S / step; MFU = the model's training matmul FLOPs per token (no recomputation) ·
tokens/s / (W · peak[dtype]), as monitor/throughput.py measures a run's.

Every constant is a field of `Assumptions`, stated and overridable (`moe-plan --assume name=value`); the defaults
are priors about current GPUs and NCCL, not fitted to any run. On this machine `moe-plan --calibrate` measures the
primitives instead (plan/calibrate.py), and the efficiencies become 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from moe.config import ModelConfig, memoized_by_config
from moe.ffn import ffn_matmul_flops_per_token
from moe.flops import matmul_flops_per_token
from moe.ledger import (
    ACTIVATION_BYTES,
    FP32_BYTES,
    PARAM_DTYPE_BYTES,
    RunShape,
    activation_bytes,
    held_params_by_rank,
    pipeline_layout,
    pipeline_micro_batch_rows,
    training_state_bytes_per_rank,
)
from moe.stages import bubble_fraction, layer_costs
from moe_platform.config import TrainConfig
from moe_platform.monitor.peak_memory import meta_transformer
from moe_platform.plan.hardware import Cluster


@dataclass(frozen=True)
class Assumptions:
    """The time model's constants. Defaults are priors for current NVIDIA GPUs with NCCL, stated, not fitted."""

    # Share of the dense matmul peak a training step's GEMM mix reaches: large bf16 GEMMs reach 0.7-0.8 on H100,
    # attention and the small, grouped expert GEMMs less; published MoE runs land at 0.3-0.45 MFU overall.
    matmul_efficiency: float = 0.6
    memory_efficiency: float = 0.7  # share of HBM bandwidth elementwise kernels and the optimizer step reach
    # Share of a link's bandwidth a ring or all-to-all reaches (nccl-tests bus bandwidth: ~0.75-0.85 of NVLink
    # and of a 400 Gb/s NIC at large messages).
    comm_efficiency: float = 0.75
    # Bus bandwidth of a reduce-scatter and of an all-gather over an all-reduce's: 1 for NCCL's rings; gloo's
    # reduce-scatter on CPU reaches ~0.4 of its all-reduce (plan/calibrate.py measures both).
    reduce_scatter_speed: float = 1.0
    all_gather_speed: float = 1.0
    dp_overlap: float = 0.9  # share of its window's compute that data-parallel traffic hides behind
    a2a_overlap: float = 0.0  # our MoE layer waits for its all-to-all (no overlap with compute)
    activation_passes: float = 3.0  # memory-bound passes over every activation byte per micro-batch
    optimizer_passes: float = 2.0  # times the optimizer step moves the rank's training state (2: read, write once)
    per_layer_overhead_s: float = 0.0  # launch/dispatch cost per layer per micro-batch, forward + backward
    collective_latency_s: float = 20e-6  # fixed cost of one collective or P2P message (NCCL: ~10-30 µs)
    ddp_bucket_bytes: float = 25 * 2**20  # DDP's bucket_cap_mb default: one all-reduce per bucket
    matmul_dtype: str | None = None  # None: the run's precision; "fp8": FP8 GEMMs (not a mode this platform trains)

    def with_overrides(self, pairs: list[str]) -> Assumptions:
        """`name=value` pairs (moe-plan's --assume), each checked against the fields."""
        known = {f.name: f for f in fields(self)}
        values = {}
        for pair in pairs:
            name, _, value = pair.partition("=")
            if name not in known or not value:
                raise ValueError(f"--assume {pair} is not name=value for one of {sorted(known)}")
            values[name] = value if name == "matmul_dtype" else float(value)
        return Assumptions(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **values})


DEFAULT_ASSUMPTIONS = Assumptions()


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step by term (each the exposed part, on the slowest rank), and what follows."""

    compute: float
    all_to_all: float
    data_parallel: float
    pipeline_p2p: float
    bubble: float
    tokens_per_step: int
    model_flops_per_token: float
    world_size: int
    peak_flops: float
    muon: float = 0.0  # Newton–Schulz and, under FSDP, its gathers (0 under AdamW)

    @property
    def total(self) -> float:
        return self.compute + self.all_to_all + self.data_parallel + self.pipeline_p2p + self.bubble + self.muon

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_s / (self.world_size * self.peak_flops)


@dataclass(frozen=True)
class _Rank:
    """One pipeline rank's work per step: seconds of compute and all-to-all, and what its collectives move."""

    matmul: float
    memory: float
    overhead: float
    all_to_all: float
    backward_per_micro_batch: float  # what data-parallel traffic of one micro-batch can hide behind
    dense_params: int
    expert_params: int  # routed experts of its layers / EP
    layers: int


def step_time(
    config: TrainConfig, cluster: Cluster, assumptions: Assumptions = DEFAULT_ASSUMPTIONS, *, imbalance: float = 1.0
) -> StepTime:
    """The module docstring's step time of `config` on all of `cluster`'s GPUs (W = nodes × GPUs per node)."""
    if imbalance < 1:
        raise ValueError(f"imbalance={imbalance} is below 1: it is the busiest EP rank's load over the mean")
    W = cluster.world_size
    run = config.run_shape(W)
    if run.grad_accum < 1:
        raise ValueError(
            f"data.global_batch_size={config.data.global_batch_size} gives fewer rows than trainer.micro_batch_size × "
            f"{run.dp_size} data-parallel ranks: validate the config for {W} ranks before timing it"
        )
    model = config.model
    dtype = assumptions.matmul_dtype or run.precision
    peak = cluster.gpu.peak(dtype)
    ranks = [_rank_work(model, run, cluster, assumptions, p, imbalance, peak) for p in range(run.pipeline_size)]
    slowest = max(ranks, key=lambda r: r.matmul + r.memory + r.overhead + r.all_to_all)
    compute = slowest.matmul + slowest.memory + slowest.overhead
    dp = max(_data_parallel_seconds(config, run, cluster, assumptions, r) for r in ranks)
    p2p = _pipeline_p2p_seconds(model, run, cluster, assumptions)
    V = pipeline_layout(model, run).num_stages // run.pipeline_size if run.pipeline_size > 1 else 1
    f = bubble_fraction(run.schedule, run.pipeline_size, run.microbatches, V)
    bubble = (compute + slowest.all_to_all) * f / (1 - f)
    tokens = config.data.global_batch_size * run.seq_len
    flops = matmul_flops_per_token(model, run.seq_len).training
    muon = max(_muon_seconds(config, run, cluster, assumptions, p) for p in range(run.pipeline_size))
    return StepTime(compute, slowest.all_to_all, dp, p2p, bubble, tokens, flops, W, peak, muon)


def _rank_work(
    model: ModelConfig,
    run: RunShape,
    cluster: Cluster,
    assume: Assumptions,
    pipeline_rank: int,
    imbalance: float,
    peak: float,
) -> _Rank:
    P = run.pipeline_size
    stages = _stages_of_rank(model, run, pipeline_rank)
    costs = layer_costs(model, run.seq_len)
    head = 3 * matmul_flops_per_token(model, run.seq_len).lm_head
    layers = [layer for stage_layers, _ in stages for layer in stage_layers]
    flops_per_token = float(sum(costs[layer] for layer in layers))
    moe_layers = [layer for layer in layers if model.is_moe_layer(layer)]
    if model.moe is not None and run.ep_size > 1:  # the busiest EP rank runs `imbalance` × the mean expert work
        routed = model.moe.top_k * ffn_matmul_flops_per_token(model.d_model, model.moe.expert_d_ff, model.activation)
        flops_per_token += 3 * routed * len(moe_layers) * (imbalance - 1)
    flops_per_token += _recompute_flops(model, run, layers, costs, head if any(h for _, h in stages) else 0)
    rows = pipeline_micro_batch_rows(run)
    micro_batches = run.microbatches if P > 1 else run.grad_accum
    tokens = rows * run.seq_len * micro_batches
    matmul = flops_per_token * tokens / (peak * assume.matmul_efficiency)
    state = training_state_bytes_per_rank(model, run, pipeline_rank if P > 1 else None).total
    activation_moved = 0.0
    for stage_layers, has_head in stages:
        acts = activation_bytes(
            model, rows, run.seq_len, run.precision, run.checkpointing, run.attention_mask,
            layers=stage_layers, head=has_head,
        )  # fmt: skip
        activation_moved += acts.total * assume.activation_passes * micro_batches
    moved = assume.optimizer_passes * state + activation_moved
    memory = moved / (cluster.gpu.memory_bandwidth * assume.memory_efficiency)
    overhead = assume.per_layer_overhead_s * len(layers) * micro_batches
    a2a = _all_to_all_seconds(model, run, cluster, assume, len(moe_layers), rows, micro_batches) * imbalance
    dense, routed = held_params_by_rank(model, run)[pipeline_rank if P > 1 else 0]
    backward = 2 / 3 * matmul / micro_batches
    return _Rank(matmul, memory, overhead, a2a, backward, dense, routed // run.ep_size, len(layers))


def _stages_of_rank(model: ModelConfig, run: RunShape, pipeline_rank: int) -> list[tuple[tuple[int, ...], bool]]:
    """(its layers, whether it is the last stage, which runs the head and the MTP modules) of each stage the
    pipeline rank runs; without a pipeline, the whole model as one last stage."""
    if run.pipeline_size == 1:
        return [(tuple(range(model.n_layers)), True)]
    layout = pipeline_layout(model, run)
    return [(layout.layers(s), s == layout.num_stages - 1) for s in layout.stages_of_rank(pipeline_rank)]


def _recompute_flops(model: ModelConfig, run: RunShape, layers: list[int], costs: list[int], head: int) -> float:
    """Per token: one more forward of what checkpointing rebuilds in backward (a third of the training cost)."""
    if run.checkpointing == "full":
        return (sum(costs[layer] for layer in layers) - head) / 3
    if run.checkpointing == "moe" and model.moe is not None:
        moe_forward = model.moe.matmul_flops_per_token(model.d_model, model.activation)
        return float(moe_forward * sum(model.is_moe_layer(layer) for layer in layers))
    return 0.0


def _all_to_all_seconds(
    model: ModelConfig, run: RunShape, cluster: Cluster, assume: Assumptions, moe_layers: int, rows: int, m: int
) -> float:
    EP = run.ep_size
    if EP == 1 or moe_layers == 0:
        return 0.0
    s = ACTIVATION_BYTES[run.precision]
    sent = rows * run.seq_len * model.moe.top_k * (EP - 1) / EP * model.d_model * s
    G = cluster.gpus_per_node
    on_node_peers = min(EP, G) - 1  # EP groups are consecutive ranks; a group wider than a node spans whole nodes
    off_node = sent * (EP - 1 - on_node_peers) / (EP - 1)
    seconds = max((sent - off_node) / cluster.intra_node_bandwidth, off_node / cluster.inter_node_bandwidth)
    transfers = 6 if run.checkpointing in ("moe", "full") else 4
    per_layer = transfers * (seconds / assume.comm_efficiency + assume.collective_latency_s)
    return m * moe_layers * per_layer * (1 - assume.a2a_overlap)


def _ring(kind: str, num_bytes: float, group: int, bandwidth: float, assume: Assumptions, messages: int = 1) -> float:
    """A ring collective over `group` ranks: all-reduce 2·(n-1)/n of the bytes, reduce-scatter or all-gather
    (n-1)/n, at bandwidth × comm_efficiency (× the kind's speed relative to an all-reduce), + one latency per
    message."""
    if group <= 1 or num_bytes == 0:
        return 0.0
    share = (2 if kind == "all_reduce" else 1) * (group - 1) / group
    speed = {"reduce_scatter": assume.reduce_scatter_speed, "all_gather": assume.all_gather_speed}.get(kind, 1.0)
    return share * num_bytes / (bandwidth * assume.comm_efficiency * speed) + messages * assume.collective_latency_s


def _data_parallel_seconds(
    config: TrainConfig, run: RunShape, cluster: Cluster, assume: Assumptions, rank: _Rank
) -> float:
    """Exposed data-parallel seconds per step of one pipeline rank (the module docstring's table)."""
    dist = config.distributed
    D, EP, P = run.dp_size, run.ep_size, run.pipeline_size
    m = run.microbatches if P > 1 else run.grad_accum
    p = PARAM_DTYPE_BYTES[run.precision]
    hide = assume.dp_overlap * rank.backward_per_micro_batch
    # Groups: the stage's D consecutive ranks; each expert block's D/EP holders, EP apart.
    dense_group, dense_bw = D, cluster.group_bandwidth(D)
    expert_group, expert_bw = (D // EP, cluster.group_bandwidth(D // EP, EP)) if EP > 1 else (D, dense_bw)
    dense, experts = rank.dense_params, rank.expert_params
    if EP == 1:
        dense, experts = dense + experts, 0

    def both(kind: str, bytes_per_param: float, messages: int = 1) -> float:
        return _ring(kind, dense * bytes_per_param, dense_group, dense_bw, assume, messages) + _ring(
            kind, experts * bytes_per_param, expert_group, expert_bw, assume, messages
        )

    if dist.strategy == "single":
        return 0.0
    if dist.strategy == "ddp" or (dist.strategy == "deepspeed" and dist.zero_stage == 0):
        buckets = max(1, math.ceil((dense + experts) * FP32_BYTES / assume.ddp_bucket_bytes))
        comm = both("all_reduce", FP32_BYTES, buckets)
        return comm if P > 1 else comm - min(comm, hide)  # under PP the stage's sync runs after the schedule
    if dist.strategy == "deepspeed":
        gather_after = both("all_gather", p)
        if dist.zero_stage == 1:
            reduce = both("reduce_scatter", p)
            return reduce - min(reduce, hide) + gather_after
        if dist.zero_stage == 2:
            reduce = both("reduce_scatter", p)
            return m * (reduce - min(reduce, hide)) + gather_after
        per_micro_batch = 2 * both("all_gather", p) + both("reduce_scatter", p)  # ZeRO-3
        return m * (per_micro_batch - min(per_micro_batch, 1.5 * hide))
    # FSDP2 / HSDP
    R = dist.fsdp.replicate_size
    shard_group = dense_group // R
    shard_bw = cluster.group_bandwidth(shard_group)
    replica_bw = cluster.group_bandwidth(R, shard_group)
    gather = _ring("all_gather", dense * p, shard_group, shard_bw, assume, rank.layers + 1)
    gather += _ring("all_gather", experts * p, expert_group, expert_bw, assume, rank.layers)
    reduce = _ring("reduce_scatter", dense * FP32_BYTES, shard_group, shard_bw, assume, rank.layers + 1)
    reduce += _ring("reduce_scatter", experts * FP32_BYTES, expert_group, expert_bw, assume, rank.layers)
    reduce += _ring("all_reduce", dense * FP32_BYTES / shard_group, R, replica_bw, assume, rank.layers + 1)
    if P > 1:
        return gather - min(gather, 1.5 * hide) + reduce
    gathers = 2 if dist.fsdp.reshard_after_forward else 1
    per_micro_batch = gathers * gather + reduce
    return m * (per_micro_batch - min(per_micro_batch, 1.5 * hide))


@dataclass(frozen=True)
class MuonWork:
    """Newton–Schulz work of one block's hidden matrices (or the MTP modules'), k steps each."""

    dense_flops: float  # its 2-D matrices: attention, dense FFN, shared experts, M_k
    dense_params: int  # their elements: what FSDP gathers for NS
    dense_matrices: int
    expert_flops: float  # one routed expert's matrices
    experts: int  # E


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """NS_k of one matrix: per step X·Xᵀ (2·a²·b), its square (2·a³) and that times X (2·a²·b), a ≤ b."""
    a, b = sorted((rows, cols))
    return steps * (4 * a * a * b + 2 * a**3)


@memoized_by_config
def muon_work_by_block(model: ModelConfig, ns_steps: int) -> dict[int | str, MuonWork]:
    """Block index (and "mtp" for the MTP modules, on the head's stage) → its `MuonWork`, read off the matrices Muon
    steps in the real module (train/optimizers.py `hidden_matrices`, on the meta device). Do not modify it."""
    from moe_platform.train.optimizers import hidden_matrices  # only under Muon: it imports Accelerate

    sums: dict[int | str, list] = {}
    for name, p in hidden_matrices(meta_transformer(model)):
        top, index = name.split(".")[:2]
        work = sums.setdefault(int(index) if top == "blocks" else "mtp", [0.0, 0, 0, 0.0, 0])
        if p.ndim == 3:  # a stack [E, in, out]: E matrices, each orthogonalised alone
            work[3] += newton_schulz_flops(p.shape[1], p.shape[2], ns_steps)
            work[4] = p.shape[0]
        else:
            work[0] += newton_schulz_flops(p.shape[0], p.shape[1], ns_steps)
            work[1] += p.numel()
            work[2] += 1
    return {key: MuonWork(*work) for key, work in sums.items()}


def _muon_seconds(config: TrainConfig, run: RunShape, cluster: Cluster, assume: Assumptions, pipeline_rank: int):
    """Muon's seconds per step on one pipeline rank (the module docstring's `muon`); 0 under AdamW."""
    if config.optim.name != "muon":
        return 0.0
    model, muon, dist = config.model, config.optim.muon, config.distributed
    work = muon_work_by_block(model, muon.ns_steps)
    stages = _stages_of_rank(model, run, pipeline_rank)
    keys = [key for layers, last in stages for key in (*layers, *(["mtp"] if last else []))]
    blocks = [work[key] for key in keys if key in work]
    D, EP = run.dp_size, run.ep_size
    fsdp = dist.strategy == "fsdp"
    shard_group = D // dist.fsdp.replicate_size if fsdp else 1
    expert_flops = 0.0
    for block in blocks:
        local = block.experts // EP
        if fsdp:  # each expert stack sharded along E over its holders: the busiest rank's whole experts
            local = math.ceil(local / (D // EP)) if EP > 1 else math.ceil(block.experts / shard_group)
        expert_flops += block.expert_flops * local
    flops = sum(block.dense_flops for block in blocks) + expert_flops
    dtype = "bf16" if muon.ns_dtype == "bfloat16" else "fp32"
    # A calibration of this machine (--this-machine) may hold only the run's dtype: NS is then timed at that rate.
    rate = cluster.gpu.peak_flops.get(dtype) or cluster.gpu.peak(assume.matmul_dtype or run.precision)
    seconds = flops / (rate * assume.matmul_efficiency)
    if fsdp:
        gathered = sum(block.dense_params for block in blocks) * PARAM_DTYPE_BYTES[dtype]
        matrices = sum(block.dense_matrices for block in blocks)
        seconds += _ring("all_gather", gathered, shard_group, cluster.group_bandwidth(shard_group), assume, matrices)
    return seconds


def _pipeline_p2p_seconds(model: ModelConfig, run: RunShape, cluster: Cluster, assume: Assumptions) -> float:
    if run.pipeline_size == 1:
        return 0.0
    boundary = pipeline_micro_batch_rows(run) * run.seq_len * model.d_model * ACTIVATION_BYTES[run.precision]
    bandwidth = cluster.group_bandwidth(2, run.dp_size)  # ranks p·D + d and (p + 1)·D + d
    hop = boundary / (bandwidth * assume.comm_efficiency) + assume.collective_latency_s
    return 2 * (run.pipeline_size - 1) * hop
