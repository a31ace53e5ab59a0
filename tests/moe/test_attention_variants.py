"""The invariants every attention variant keeps (seed 001): a token never sees the future, padding changes no other
row and no real position, and cached decode in any chunking equals recomputing the whole prefix. Each case is one
attention × position encoding; tests/moe/test_attention.py and test_kv_cache.py hold the GQA-specific ones (learned
positions' padding cases among them: a left-padded row moves, so only distance-only encodings equal it here)."""

import pytest
import torch

from moe import ModelConfig, Transformer
from moe.moe_config import MoEConfig, RouterConfig

TOL = dict(atol=1e-10, rtol=1e-8)
VOCAB = 40
MLA_SHAPE = dict(q_lora_rank=24, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
MOE = MoEConfig(num_experts=4, top_k=2, expert_d_ff=16, first_dense_layers=1)
# DeepSeek-V3's routing: sigmoid, top-2 within the best 2 of 4 groups, routed scaling, a shared expert.
V3_ROUTER = RouterConfig(score_fn="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
V3_MOE = MoEConfig(num_experts=8, top_k=2, expert_d_ff=16, num_shared_experts=1, router=V3_ROUTER)

# Scores that depend on the key-query distance only: RoPE (MLA's decoupled branch included) and ALiBi.
DISTANCE_ONLY = {
    "gqa_rope": dict(n_kv_heads=2),
    "mha_rope": dict(n_kv_heads=4),
    "mqa_rope_layernorm_gelu": dict(n_kv_heads=1, norm="layernorm", activation="gelu"),
    "mla_absorbed_decode": dict(attention="mla", mla=dict(MLA_SHAPE, absorb_decode=True), moe=V3_MOE),
    "mla_unabsorbed_decode": dict(attention="mla", mla=dict(MLA_SHAPE, absorb_decode=False)),
    "mla_full_rank_query": dict(attention="mla", mla=dict(MLA_SHAPE, q_lora_rank=None)),
    "alibi_mha": dict(pos_encoding="alibi", n_heads=6, head_dim=4, moe=MOE),
    "alibi_gqa": dict(pos_encoding="alibi", n_heads=6, n_kv_heads=3, head_dim=4),
    "alibi_mqa": dict(pos_encoding="alibi", n_heads=6, n_kv_heads=1, head_dim=4),
}
VARIANTS = {
    **DISTANCE_ONLY,
    "gqa_learned_biases": dict(n_kv_heads=2, pos_encoding="learned", attention_bias=True, ffn_bias=True),
}


def model_for(variant: str) -> Transformer:
    fields = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=40, max_seq_len=48)
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**fields, **VARIANTS[variant]})).double().eval()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunks", [[1] * 10, [4, 1, 3, 2], [10], [6, 4]])
def test_prefix_cache_decode_equals_full_recomputation(variant, chunks) -> None:
    model = model_for(variant)
    ids = torch.randint(0, VOCAB, (2, sum(chunks)))
    full = model(ids).logits
    cache = model.new_kv_cache(batch_size=2)
    start, pieces = 0, []
    for size in chunks:
        pieces.append(model(ids[:, start : start + size], kv_cache=cache).logits)
        start += size
    assert cache.length == sum(chunks)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_changing_a_future_token_never_changes_earlier_logits(variant) -> None:
    model = model_for(variant)
    ids = torch.randint(0, VOCAB, (2, 9))
    before = model(ids).logits
    for future in range(1, 9):
        changed = ids.clone()
        changed[:, future] = (changed[:, future] + 1) % VOCAB
        after = model(changed).logits
        torch.testing.assert_close(after[:, :future], before[:, :future], **TOL)
        assert not torch.allclose(after[:, future], before[:, future])


@pytest.mark.parametrize("variant", DISTANCE_ONLY)
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_changes_no_other_row_and_no_real_position(variant, side) -> None:
    """Rows 0 and 2 equal their unpadded selves; row 1's real tokens equal the unpadded sequence too, on either
    side: RoPE and ALiBi see only distances, so moving a sequence right by its left padding changes nothing."""
    model = model_for(variant)
    T, real = 9, 5
    ids = torch.randint(0, VOCAB, (3, T))
    alone = [model(ids[i : i + 1]).logits for i in range(3)]
    mask = torch.ones(3, T, dtype=torch.long)
    padded_ids = ids.clone()
    span = slice(real, T) if side == "right" else slice(0, T - real)
    mask[1, span], padded_ids[1, span] = 0, 7
    batched = model(padded_ids, attention_mask_BT=mask).logits
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched[0:1], alone[0], **TOL)
    torch.testing.assert_close(batched[2:3], alone[2], **TOL)
    real_tokens = mask[1].bool()
    torch.testing.assert_close(batched[1:2, real_tokens], model(padded_ids[1:2, real_tokens]).logits, **TOL)
