"""The resource ledger: four separate tables, each a pure function of the config and the run shape.

Seed 000 ("把参数、激活、缓存和运算分开记账") and seed 001 §1.5 insist that parameters, training-state bytes,
KV-cache bytes and matmul FLOPs are different quantities with different units and assumptions; adding them into
one "model size" distorts every estimate. Each row here therefore carries the assumption it was computed under.

Under expert parallelism (EP > 1) a fifth table gives the per-rank figures that EP changes. Legend there:
W all ranks, EP ranks sharing one MoE layer's experts, E routed experts, K experts per token, D model width,
L_moe MoE layers, N tokens per micro-batch, s bytes per activation element.
"""

from dataclasses import dataclass

# Parameter counts live with the config (`ModelConfig.num_params()`); the ledger only reads them, so the import
# arrow points one way: ledger → config.
from moe.config import ModelConfig, count_parameters
from moe.ffn import ffn_matmul_flops_per_token

# ---------------------------------------------------------------------------------------------------------------
# Training state
# ---------------------------------------------------------------------------------------------------------------

# Bytes per parameter for (weights, gradients, optimizer state) under stated assumptions.
PRECISION_BYTES = {
    # fp32 weights + fp32 grads + AdamW m and v in fp32: 4 + 4 + 8 = 16 B/param (seed 000).
    "fp32": (4, 4, 8),
    # bf16 weights + bf16 grads + fp32 master copy + fp32 m and v: 2 + 2 + (4 + 4 + 4) = 16 B/param (seed 001 §1.5).
    "bf16": (2, 2, 12),
}
PRECISION_ASSUMPTIONS = {
    "fp32": "fp32 weights 4 B + fp32 grads 4 B + AdamW m, v fp32 8 B",
    "bf16": "bf16 weights 2 B + bf16 grads 2 B + fp32 master 4 B + AdamW m, v fp32 8 B",
}
# Bytes per element of the hidden vectors that move between ranks (expert-parallel all-to-all).
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class TrainingStateBytes:
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def training_state_bytes(num_params: int, precision: str, zero_stage: int, dp_size: int) -> TrainingStateBytes:
    """Per-rank bytes of weights, gradients and optimizer state under ZeRO stage 0–3 with `dp_size` ranks.

    Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the weights (ZeRO paper's
    Ψ·(2 + 2 + K) accounting). Activations, buffers, allocator slack and communication buckets are not counted.
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} is unknown: use one of {tuple(PRECISION_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is invalid: use 0, 1, 2 or 3")
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    weight_b, grad_b, optim_b = PRECISION_BYTES[precision]
    shard = 1.0 / dp_size
    return TrainingStateBytes(
        weights=num_params * weight_b * (shard if zero_stage >= 3 else 1.0),
        gradients=num_params * grad_b * (shard if zero_stage >= 2 else 1.0),
        optimizer=num_params * optim_b * (shard if zero_stage >= 1 else 1.0),
    )


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------------------------------------------
#
# EP ranks split every MoE layer's E routed experts into contiguous blocks of E/EP. Everything else (embeddings,
# attention, norms, dense FFNs, routers, shared experts) is replicated on all W ranks, and each expert block is
# replicated on the W/EP ranks that hold it (its expert-data-parallel group). So ZeRO shards the replicated state
# over W ranks and the expert state over W/EP ranks.


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


def expert_params_per_rank(config: ModelConfig, ep_size: int) -> int:
    """Routed-expert parameters one rank holds: Σ over MoE layers of (E/EP) experts = routed experts / EP."""
    _check_expert_parallel(config, ep_size)
    return count_parameters(config).routed_experts // ep_size


def params_per_rank(config: ModelConfig, ep_size: int) -> int:
    """All parameters one rank holds: replicated (everything but routed experts, routers included) + routed / EP."""
    params = count_parameters(config)
    return params.total - params.routed_experts + expert_params_per_rank(config, ep_size)


def training_state_bytes_per_rank(
    config: ModelConfig, precision: str, zero_stage: int, world_size: int, ep_size: int = 1
) -> TrainingStateBytes:
    """Per-rank weights, gradients and optimizer state with `world_size` ranks of which `ep_size` split the experts.

    Replicated parameters are ZeRO-sharded over W ranks, the rank's routed experts (routed / EP) over the W/EP
    ranks that hold the same block; at EP=1 this is `training_state_bytes(total, …, W)`.
    """
    _check_expert_parallel(config, ep_size, world_size)
    params = count_parameters(config)
    replicated = training_state_bytes(params.total - params.routed_experts, precision, zero_stage, world_size)
    experts = training_state_bytes(
        expert_params_per_rank(config, ep_size), precision, zero_stage, world_size // ep_size
    )
    return TrainingStateBytes(
        weights=replicated.weights + experts.weights,
        gradients=replicated.gradients + experts.gradients,
        optimizer=replicated.optimizer + experts.optimizer,
    )


def all_to_all_bytes_per_step(
    config: ModelConfig, tokens_per_micro_batch: int, micro_batches_per_step: int, ep_size: int, bytes_per_element: int
) -> float:
    """Bytes one rank sends through expert-parallel all-to-alls per optimizer step, uniform routing, payload only.

    Per MoE layer and micro-batch the N·K (token, expert) assignments go out (dispatch) and come back (combine),
    and backward moves their gradients the same way: 4 · L_moe · N·K · (EP-1)/EP · D · s, where (EP-1)/EP is the
    share of assignments whose expert lives on another rank. Dropless: capacity drops would send fewer.
    """
    _check_expert_parallel(config, ep_size)
    if ep_size == 1:
        return 0.0
    moe_layers = sum(config.is_moe_layer(layer) for layer in range(config.n_layers))
    assignments = tokens_per_micro_batch * config.moe.top_k
    per_micro_batch = 4 * moe_layers * assignments * (ep_size - 1) / ep_size * config.d_model * bytes_per_element
    return per_micro_batch * micro_batches_per_step


# ---------------------------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------------------------


def kv_cache_bytes(config: ModelConfig, batch_size: int, seq_len: int, bytes_per_element: int) -> int:
    """2 · B · L · S · H_kv · d_h · s: K and V of every layer for every cached position, payload only."""
    return 2 * batch_size * config.n_layers * seq_len * config.n_kv_heads * config.head_dim * bytes_per_element


# ---------------------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward matmul FLOPs per token (multiply and add counted as 2), summed over layers."""

    projections: int  # Q, K, V, O
    attention: int  # QKᵀ and AV over the full S×S grid (the mask does not save these multiplies)
    ffn: int  # dense FFNs, and per MoE layer router + top-k experts + shared experts
    lm_head: int

    @property
    def forward(self) -> int:
        return self.projections + self.attention + self.ffn + self.lm_head

    @property
    def training(self) -> int:
        """Forward + backward ≈ 3× forward (backward computes grads w.r.t. both inputs and weights)."""
        return 3 * self.forward


def matmul_flops_per_token(config: ModelConfig, seq_len: int) -> FlopsPerToken:
    q_width, kv_width = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    projections = 2 * config.d_model * (2 * q_width + 2 * kv_width)
    # Seed 000: QKᵀ and AV together cost 4·B·T²·d for the whole batch, i.e. 4·S·(H·d_h) per token.
    attention = 4 * seq_len * q_width
    ffn = 0
    for layer in range(config.n_layers):
        if config.is_moe_layer(layer):
            ffn += config.moe.matmul_flops_per_token(config.d_model, config.activation)
        else:
            ffn += ffn_matmul_flops_per_token(config.d_model, config.d_ff, config.activation)
    return FlopsPerToken(
        projections=config.n_layers * projections,
        attention=config.n_layers * attention,
        ffn=ffn,
        lm_head=2 * config.d_model * config.vocab_size,
    )


# ---------------------------------------------------------------------------------------------------------------
# Printing
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
    grad_accum: int = 1  # micro-batches per optimizer step (only the all-to-all row per step uses it)


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
    """The four tables (five under expert parallelism), each row with the assumption it rests on."""
    params = count_parameters(config)
    state = training_state_bytes_per_rank(config, run.precision, run.zero_stage, run.dp_size, run.ep_size)
    flops = matmul_flops_per_token(config, run.seq_len)
    kv = kv_cache_bytes(config, run.micro_batch_size, run.seq_len, run.kv_bytes_per_element)
    kv_per_token = kv_cache_bytes(config, 1, 1, run.kv_bytes_per_element)
    moe_note = "router + top-k experts + shared experts per MoE layer" if config.moe else "dense: active = total"
    tables = [
        _table(
            "Parameters",
            [
                ("total", f"{params.total:,}", "every weight the model stores"),
                ("active per token", f"{params.active:,}", moe_note),
                ("embedding", f"{params.embedding:,}", "token table (+ learned positions)"),
                ("lm head", f"{params.lm_head:,}", "0 when tied to the embedding"),
                ("attention", f"{params.attention:,}", "Q, K, V, O over all layers"),
                ("ffn / experts", f"{params.ffn_total:,}", "dense FFNs, experts, routers, shared experts"),
                ("norms", f"{params.norms:,}", f"{config.norm}: γ{' and β' if config.norm == 'layernorm' else ''}"),
            ],
        ),
        _table(
            f"Training state per rank ({run.precision}, ZeRO-{run.zero_stage}, {run.dp_size} data-parallel ranks"
            + (f", experts over EP={run.ep_size})" if run.ep_size > 1 else ")"),
            [
                ("weights", _human(state.weights, "B"), "sharded at stage 3"),
                ("gradients", _human(state.gradients, "B"), "sharded at stage ≥ 2"),
                ("optimizer", _human(state.optimizer, "B"), "sharded at stage ≥ 1"),
                ("total", _human(state.total, "B"), PRECISION_ASSUMPTIONS[run.precision]),
                ("not counted", "-", "activations, buffers, allocator slack, communication buckets"),
            ],
        ),
        _table(
            f"KV cache ({run.kv_bytes_per_element} B/element, {config.n_kv_heads} KV heads × {config.head_dim} dims)",
            [
                ("per token", _human(kv_per_token, "B"), "2 · L · H_kv · d_h · s"),
                (
                    f"B={run.micro_batch_size}, S={run.seq_len}",
                    _human(kv, "B"),
                    "2 · B · L · S · H_kv · d_h · s, payload only",
                ),
            ],
        ),
        _table(
            f"Matmul FLOPs per token (S={run.seq_len}, multiply-add = 2)",
            [
                ("projections", _human(flops.projections, "FLOP"), "Q, K, V, O"),
                ("attention", _human(flops.attention, "FLOP"), "4 · S · H · d_h, full S×S grid (mask saves none)"),
                ("ffn", _human(flops.ffn, "FLOP"), "active experts only" if config.moe else "dense FFN"),
                ("lm head", _human(flops.lm_head, "FLOP"), "2 · D · V"),
                ("forward", _human(flops.forward, "FLOP"), "excludes softmax, norms, activations, memory traffic"),
                ("training step", _human(flops.training, "FLOP"), "≈ 3 × forward"),
            ],
        ),
    ]
    if run.ep_size > 1:
        tables.insert(2, _expert_parallel_table(config, run, state))
    return "\n\n".join(tables)


def _expert_parallel_table(config: ModelConfig, run: RunShape, state: TrainingStateBytes) -> str:
    W, EP, E = run.dp_size, run.ep_size, config.moe.num_experts
    optim_b = PRECISION_BYTES[run.precision][2]
    expert_matrices = 3 if config.activation == "swiglu" else 2  # w_gate (SwiGLU only), w_up, w_down
    if run.zero_stage >= 1:
        optimizer_formula = f"{optim_b} B · (replicated / W + routed / EP / (W/EP)), ZeRO-{run.zero_stage}"
    else:
        optimizer_formula = f"{optim_b} B · params per rank, ZeRO-0: unsharded"
    a2a = all_to_all_bytes_per_step(
        config, run.micro_batch_size * run.seq_len, run.grad_accum, EP, ACTIVATION_BYTES[run.precision]
    )
    return _table(
        f"Expert parallelism (EP={EP} of W={W} ranks: E/EP = {E // EP} experts per rank per MoE layer, "
        f"each block on W/EP = {W // EP} ranks)",
        [
            (
                "expert params per rank",
                f"{expert_params_per_rank(config, EP):,}",
                f"routed experts / EP = L_moe · (E/EP) · {expert_matrices}·D·F",
            ),
            (
                "params per rank",
                f"{params_per_rank(config, EP):,}",
                "replicated (all but routed experts; routers, shared experts) + routed / EP",
            ),
            ("optimizer per rank", _human(state.optimizer, "B"), optimizer_formula),
            (
                "all-to-all per step",
                _human(a2a, "B"),
                f"4 · L_moe · B·S·K · (EP-1)/EP · D · s × {run.grad_accum} micro-batches, "
                f"s = {ACTIVATION_BYTES[run.precision]} B, uniform routing, payload only",
            ),
        ],
    )
