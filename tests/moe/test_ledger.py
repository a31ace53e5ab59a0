"""The ledger against the seeds' hand-computed cases and against torch's own FLOP counter."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from moe import ModelConfig, MoEConfig, RunShape, Transformer, format_ledger, kv_cache_bytes, matmul_flops_per_token
from moe.config import attention_num_params
from moe.ledger import training_state_bytes
from moe.moe_config import RouterConfig


def test_kv_cache_is_128_kib_per_token_in_the_seeds_example() -> None:
    """Seed 001 §1.5: 32 layers, 8 KV heads, 128 dims, 2 bytes → 131072 B/token; 8192 tokens → 1 GiB."""
    config = ModelConfig(n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, vocab_size=32000, d_ff=64)
    assert kv_cache_bytes(config, batch_size=1, seq_len=1, bytes_per_element=2) == 131072
    assert kv_cache_bytes(config, batch_size=1, seq_len=8192, bytes_per_element=2) == 2**30
    assert kv_cache_bytes(config, batch_size=4, seq_len=8192, bytes_per_element=2) == 4 * 2**30
    # Seed: two KV heads instead of eight → a quarter of the payload.
    mqa_ish = ModelConfig(n_layers=32, n_heads=32, n_kv_heads=2, d_model=4096, vocab_size=32000, d_ff=64)
    assert kv_cache_bytes(mqa_ish, 1, 8192, 2) * 4 == 2**30


def test_gqa_projection_parameters_from_the_seeds() -> None:
    """Seed 000: d=128, h_q=8, h_kv=2, d_h=16 → 40960 vs 65536 for MHA (ratio 5/8)."""
    gqa = ModelConfig(d_model=128, n_heads=8, n_kv_heads=2)
    mha = ModelConfig(d_model=128, n_heads=8, n_kv_heads=8)
    assert attention_num_params(gqa) == 40960
    assert attention_num_params(mha) == 65536
    # Seed 001: D=2048, H_q=16, H_kv=4, d_h=128 → 10,485,760 for the four projections, W_O alone 4,194,304.
    big = ModelConfig(d_model=2048, n_heads=16, n_kv_heads=4)
    assert attention_num_params(big) == 10_485_760
    assert Transformer(ModelConfig(d_model=2048, n_heads=16, n_kv_heads=4, n_layers=1, vocab_size=2, d_ff=1)) \
        .blocks[0].attn.w_o.weight.numel() == 4_194_304  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_state_is_16_bytes_per_parameter_without_zero(precision: str) -> None:
    assert training_state_bytes(1000, precision, zero_stage=0, dp_size=8).total == 16_000


def test_zero_stages_shard_what_they_claim() -> None:
    """bf16 mixed precision, Ψ params, N ranks: stage 1 = 4Ψ + 12Ψ/N, stage 2 = 2Ψ + 14Ψ/N, stage 3 = 16Ψ/N."""
    psi, n = 1_000_000, 8
    assert training_state_bytes(psi, "bf16", 1, n).total == 4 * psi + 12 * psi / n
    assert training_state_bytes(psi, "bf16", 2, n).total == 2 * psi + 14 * psi / n
    assert training_state_bytes(psi, "bf16", 3, n).total == 16 * psi / n
    assert training_state_bytes(psi, "fp32", 3, 1).total == 16 * psi


def test_training_state_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="precision"):
        training_state_bytes(10, "fp16x", 0, 1)
    with pytest.raises(ValueError, match="zero_stage"):
        training_state_bytes(10, "fp32", 4, 1)


def test_flop_terms_follow_the_seeds_formulas() -> None:
    """Seed 000 (MHA, d = H·d_h): projections 8d², FFN 4df, attention 4Td per token."""
    d, f, T, L, V = 64, 256, 32, 3, 100
    config = ModelConfig(d_model=d, d_ff=f, n_layers=L, n_heads=4, vocab_size=V, activation="gelu")
    flops = matmul_flops_per_token(config, seq_len=T)
    assert flops.projections == L * 8 * d * d
    assert flops.ffn == L * 4 * d * f
    assert flops.attention == L * 4 * T * d
    assert flops.lm_head == 2 * d * V
    assert flops.training == 3 * flops.forward


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_kv_heads": 1, "activation": "gelu"},
        {"n_kv_heads": 2, "pos_encoding": "learned"},
        # Dropless MoE: the experts compute exactly K assignments per token, plus the router and a shared expert.
        {"moe": MoEConfig(num_experts=4, top_k=2, expert_d_ff=24, num_shared_experts=1, moe_layer_interval=2)},
        {"moe": MoEConfig(num_experts=3, top_k=1, expert_d_ff=20, router=RouterConfig(renormalize_topk=False))},
    ],
)
def test_forward_flops_equal_torchs_flop_counter(overrides: dict) -> None:
    """The ledger's analytic matmul FLOPs equal what torch counts on a real forward (B·T tokens).

    The math SDPA backend runs attention as visible matmuls (the fused CPU kernel is opaque to the counter)."""
    fields = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=16)
    config = ModelConfig(**{**fields, **overrides})
    model = Transformer(config)
    B, T = 2, 16
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, 50, (B, T)))
    assert counter.get_total_flops() == B * T * matmul_flops_per_token(config, seq_len=T).forward


def test_format_ledger_prints_four_tables_with_assumptions() -> None:
    text = format_ledger(ModelConfig(), RunShape(precision="bf16", zero_stage=2, dp_size=4))
    for title in ("Parameters", "Training state per rank", "KV cache", "Matmul FLOPs per token"):
        assert title in text
    assert "fp32 master" in text and "ZeRO-2" in text and "2 · B · L · S · H_kv · d_h · s" in text
