"""Multi-head latent attention (seed 001, MLA): a direct per-head reference, the latent cache's bytes, absorbed ==
unabsorbed decode, generation, parameter counts. The causal, padding and prefix-cache invariants every attention
keeps are in test_attention_variants.py, with MLA's cases among them."""

import math

import pytest
import torch

from moe import ModelConfig, Transformer
from moe.moe_config import MoEConfig
from moe.rope import apply_rope, rope_tables

TOL = dict(atol=1e-10, rtol=1e-8)
VOCAB = 40


def mla_config(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=40, max_seq_len=48, attention="mla",
        mla=dict(q_lora_rank=24, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
    )  # fmt: skip
    fields.update(overrides)
    return ModelConfig(**fields)


def mla_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(mla_config(**overrides)).double().eval()


def set_absorb(model: Transformer, absorb: bool) -> None:
    for block in model.blocks:
        block.attn.absorb_decode = absorb


def reference_mla(attn, x_BTD: torch.Tensor) -> torch.Tensor:
    """MLA written out head by head from the paper's equations, with an explicit causal softmax (no SDPA, no
    cache, no fused projections), to check the module's wiring."""
    B, T, _ = x_BTD.shape
    n, r, v, C = attn.nope_dim, attn.rope_dim, attn.v_dim, attn.latent_dim
    q_BTHq = attn.w_q(x_BTD).view(B, T, attn.n_heads, n + r)
    w_dkv_CD, w_kr_rD = attn.w_kv_down.weight.split([C, r])
    c_BTC = attn.kv_norm(x_BTD @ w_dkv_CD.T + (attn.w_kv_down.bias[:C] if attn.w_kv_down.bias is not None else 0))
    k_rope_BTr = x_BTD @ w_kr_rD.T + (attn.w_kv_down.bias[C:] if attn.w_kv_down.bias is not None else 0)
    cos, sin = rope_tables(torch.arange(T), r, 10000.0, x_BTD.dtype)
    k_rope_BTr = apply_rope(k_rope_BTr, cos, sin)
    w_up = attn.w_kv_up.weight.view(attn.n_heads, n + v, C)
    heads = []
    for h in range(attn.n_heads):
        q_nope, q_rope = q_BTHq[:, :, h, :n], apply_rope(q_BTHq[:, :, h, n:], cos, sin)
        k_BTq = torch.cat((c_BTC @ w_up[h, :n].T, k_rope_BTr), dim=-1)
        v_BTv = c_BTC @ w_up[h, n:].T
        scores_BTT = torch.cat((q_nope, q_rope), dim=-1) @ k_BTq.transpose(1, 2) / math.sqrt(n + r)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        weights = scores_BTT.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        heads.append(weights @ v_BTv)
    return attn.w_o(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("attention_bias", [False, True])
def test_module_equals_the_head_by_head_reference(q_lora_rank, attention_bias) -> None:
    config = mla_config(
        attention_bias=attention_bias,
        mla=dict(q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
    )
    torch.manual_seed(1)
    attn = Transformer(config).double().blocks[0].attn
    for p in attn.parameters():  # biases and norm gains away from their 0 / 1 initial values
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    cos_sin = rope_tables(torch.arange(7), 4, 10000.0, torch.float64)
    torch.testing.assert_close(attn(x, cos_sin, None), reference_mla(attn, x), **TOL)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, TOL), (torch.float32, dict(atol=1e-5, rtol=1e-5))])
def test_absorbed_and_unabsorbed_decode_give_the_same_logits(dtype, tol) -> None:
    model = mla_model(moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=16)).to(dtype)
    ids = torch.randint(0, VOCAB, (3, 12))
    logits = {}
    for absorb in (False, True):
        set_absorb(model, absorb)
        cache = model.new_kv_cache(batch_size=3)
        steps = [model(ids[:, :5], kv_cache=cache).logits]
        steps += [model(ids[:, t : t + 1], kv_cache=cache).logits for t in range(5, 12)]
        logits[absorb] = torch.cat(steps, dim=1)
    torch.testing.assert_close(logits[True], logits[False], **tol)


def test_greedy_generation_with_the_latent_cache_equals_recomputing_everything() -> None:
    model = mla_model()
    prompt = torch.randint(0, VOCAB, (2, 4))
    generated = model.generate(prompt, max_new_tokens=8, temperature=0)
    tokens = prompt
    for _ in range(8):
        tokens = torch.cat([tokens, model(tokens).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_holds_only_the_latent_and_the_position_key(dtype) -> None:
    """Seed 001: B·L·S·(d_c + d_r)·s bytes, not the per-head K and V (nor the GQA formula with d_c plugged in)."""
    model = mla_model(n_layers=3).to(dtype)
    cache = model.new_kv_cache(batch_size=2, max_len=20)
    assert cache.latent_LBSC.shape == (3, 2, 20, 12) and cache.k_rope_LBSr.shape == (3, 2, 20, 4)
    s = torch.finfo(dtype).bits // 8
    assert cache.num_bytes == 2 * 3 * 20 * (12 + 4) * s
    per_head_kv = 2 * 3 * 20 * 4 * (6 + 4 + 5) * s  # what expanded keys and values of 4 heads would take
    assert cache.num_bytes < per_head_kv


def test_cache_overflow_is_a_clear_error() -> None:
    model = mla_model()
    cache = model.new_kv_cache(batch_size=1, max_len=4)
    model(torch.randint(0, VOCAB, (1, 3)), kv_cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        model(torch.randint(0, VOCAB, (1, 2)), kv_cache=cache)


@pytest.mark.parametrize("q_lora_rank", [None, 8])
@pytest.mark.parametrize("attention_bias", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_num_params_equals_the_module(q_lora_rank, attention_bias, tie) -> None:
    for moe in (None, MoEConfig(num_experts=4, top_k=2, expert_d_ff=8, num_shared_experts=1, first_dense_layers=1)):
        config = mla_config(
            attention_bias=attention_bias,
            tie_embeddings=tie,
            moe=moe,
            mla=dict(q_lora_rank=q_lora_rank, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=3),
        )
        model = Transformer(config)
        assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_unset_shapes_take_deepseek_v2_ratios_to_the_head_width() -> None:
    config = ModelConfig(d_model=64, n_heads=4, attention="mla")
    assert (config.mla.qk_nope_head_dim, config.mla.qk_rope_head_dim, config.mla.v_head_dim) == (16, 8, 16)
    assert config.mla.kv_lora_rank == 64 and config.mla.q_lora_rank is None and config.rope_dim == 8
