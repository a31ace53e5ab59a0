"""The resource ledger: four separate tables, each a pure function of the config and the run shape.

Seed 000 ("把参数、激活、缓存和运算分开记账") and seed 001 §1.5 insist that parameters, training-state bytes,
KV-cache bytes and matmul FLOPs are different quantities with different units and assumptions; adding them into
one "model size" distorts every estimate. Each row here therefore carries the assumption it was computed under.
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
    dp_size: int = 1
    kv_bytes_per_element: int = 2


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
    """The four tables, each row with the assumption it rests on."""
    params = count_parameters(config)
    state = training_state_bytes(params.total, run.precision, run.zero_stage, run.dp_size)
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
            f"Training state per rank ({run.precision}, ZeRO-{run.zero_stage}, {run.dp_size} data-parallel ranks)",
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
    return "\n\n".join(tables)
