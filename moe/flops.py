"""Matmul FLOPs per token, the ledger's FLOP table (moe/ledger.py prints it): a module of its own so that the pipeline
stages (moe/stages.py), which the ledger reads, can cost their layers with it, one-way."""

from dataclasses import dataclass

from moe.config import ModelConfig, memoized_by_config
from moe.ffn import ffn_matmul_flops_per_token


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward matmul FLOPs per token (multiply and add counted as 2), summed over layers."""

    projections: int  # Q, K, V, O (MLA: query path, W_DKV + W_KR, W_UK + W_UV, W_O)
    attention: int  # QKᵀ and AV over the full S×S grid (the mask does not save these multiplies)
    ffn: int  # dense FFNs, and per MoE layer router + top-k experts + shared experts
    lm_head: int
    # The MTP modules (moe/mtp.py), each per token: M_k 2·2D·D, its block (as the last layer), the shared head 2·D·V;
    # a module runs on T - k of the T positions, counted here as all T (an upper bound off by k / T).
    mtp: int = 0

    @property
    def forward(self) -> int:
        return self.projections + self.attention + self.ffn + self.lm_head + self.mtp

    @property
    def training(self) -> int:
        """Forward + backward ≈ 3× forward (backward computes grads w.r.t. both inputs and weights)."""
        return 3 * self.forward


def _mla_flops_per_token(config: ModelConfig, seq_len: int) -> tuple[int, int]:
    """(projections, attention) of one MLA layer per token on the expanded path every uncached forward takes
    (training, prefill). Projections: query 2·D·H·(n+r), or through its latent 2·D·Q + 2·Q·H·(n+r); W_DKV and
    W_KR 2·D·(C+r); W_UK and W_UV on every token 2·C·H·(n+v); W_O 2·H·v·D. Attention over S keys: scores
    2·S·H·(n+r), A·V 2·S·H·max(v, n+r): values narrower than n + r are padded with zeros for SDPA's fused
    kernels (moe/mla.py), and the padded columns are multiplied too. (Absorbed decode instead applies W_UK and
    W_UV per head, 2·H·C·(n+v), and attends in the latent space, 2·S·H·(2·C+r); not this table.)"""
    mla, D, H = config.mla, config.d_model, config.n_heads
    q_width = H * mla.qk_head_dim
    query = 2 * D * q_width if mla.q_lora_rank is None else 2 * D * mla.q_lora_rank + 2 * mla.q_lora_rank * q_width
    kv_down = 2 * D * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv_up = 2 * mla.kv_lora_rank * H * (mla.qk_nope_head_dim + mla.v_head_dim)
    out = 2 * H * mla.v_head_dim * D
    attention = 2 * seq_len * q_width + 2 * seq_len * H * max(mla.v_head_dim, mla.qk_head_dim)
    return query + kv_down + kv_up + out, attention


@memoized_by_config
def matmul_flops_per_token(config: ModelConfig, seq_len: int) -> FlopsPerToken:
    """GQA: projections 2·D·(2·H·d_h + 2·H_kv·d_h), attention 4·S·H·d_h; MLA: `_mla_flops_per_token`. ALiBi's
    bias is an addition, no matmul, so it changes neither."""
    if config.attention == "mla":
        projections, attention = _mla_flops_per_token(config, seq_len)
    else:
        q_width, kv_width = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        projections = 2 * config.d_model * (2 * q_width + 2 * kv_width)
        # Seed 000: QKᵀ and AV together cost 4·B·T²·d for the whole batch, i.e. 4·S·(H·d_h) per token.
        attention = 4 * seq_len * q_width
    ffn_by_block = [_ffn_flops_per_token(config, block) for block in range(config.num_blocks)]
    lm_head = 2 * config.d_model * config.vocab_size
    mtp_module = 4 * config.d_model**2 + projections + attention + ffn_by_block[-1] + lm_head
    return FlopsPerToken(
        projections=config.n_layers * projections,
        attention=config.n_layers * attention,
        ffn=sum(ffn_by_block[: config.n_layers]),
        lm_head=lm_head,
        mtp=config.mtp.depth * mtp_module,
    )


def _ffn_flops_per_token(config: ModelConfig, block: int) -> int:
    if config.is_moe_layer(block):
        return config.moe.matmul_flops_per_token(config.d_model, config.activation)
    return ffn_matmul_flops_per_token(config.d_model, config.d_ff, config.activation)
