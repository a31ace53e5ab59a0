"""Seed invariants of attention: causality of one head, padding isolation, GQA = expanded-KV reference, masked rows,
online softmax (a model-level causality check for every attention variant: test_attention_variants.py). Everything
in float64 so "equal" means equal up to rounding (seed 001 exercise cards: 1e-8)."""

import math

import pytest
import torch

from moe import ModelConfig, Transformer, build_attention_mask, grouped_attention
from moe.online_softmax import online_softmax_attention

TOL = dict(atol=1e-10, rtol=1e-8)


def reference_attention(q_BHTd, k_BKSd, v_BKSd, allowed_BTS):
    """Slow reference: loop over query heads, head h reads KV head h // (H / K) by explicit index."""
    B, H, T, d = q_BHTd.shape
    group = H // k_BKSd.shape[1]
    out = torch.empty_like(q_BHTd)
    for h in range(H):
        k_BSd, v_BSd = k_BKSd[:, h // group], v_BKSd[:, h // group]
        scores_BTS = q_BHTd[:, h] @ k_BSd.transpose(1, 2) / math.sqrt(d)
        scores_BTS = scores_BTS.masked_fill(~allowed_BTS, -math.inf)
        out[:, h] = torch.softmax(scores_BTS, dim=-1) @ v_BSd
    return out


def tiny_model(**overrides) -> Transformer:
    fields = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32)
    fields.update(overrides)
    return Transformer(ModelConfig(**fields)).double().eval()


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 2), (8, 2), (4, 1)])
def test_grouped_attention_equals_expanded_kv_reference(n_heads: int, n_kv_heads: int) -> None:
    B, T, d = 2, 6, 8
    q = torch.randn(B, n_heads, T, d, dtype=torch.float64)
    k = torch.randn(B, n_kv_heads, T, d, dtype=torch.float64)
    v = torch.randn(B, n_kv_heads, T, d, dtype=torch.float64)
    causal_BTS = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    expected = reference_attention(q, k, v, causal_BTS)
    torch.testing.assert_close(grouped_attention(q, k, v, is_causal=True), expected, **TOL)
    torch.testing.assert_close(grouped_attention(q, k, v, mask=causal_BTS[:, None]), expected, **TOL)


def test_grouped_heads_differ_within_a_group() -> None:
    """Sharing K/V does not share the queries: heads of one group still produce different outputs."""
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 5, 8, dtype=torch.float64), torch.randn(1, 2, 5, 8, dtype=torch.float64)
    out = grouped_attention(q, k, v, is_causal=True)
    assert not torch.allclose(out[:, 0], out[:, 1])


def test_changing_a_future_value_never_changes_earlier_outputs() -> None:
    B, H, T, d = 1, 2, 7, 4
    q, k, v = (torch.randn(B, H, T, d, dtype=torch.float64) for _ in range(3))
    before = grouped_attention(q, k, v, is_causal=True)
    for future in range(1, T):
        v2 = v.clone()
        v2[:, :, future] += 100.0
        after = grouped_attention(q, k, v2, is_causal=True)
        torch.testing.assert_close(after[:, :, :future], before[:, :, :future], **TOL)
        assert not torch.allclose(after[:, :, future:], before[:, :, future:])


def test_the_seeds_hand_example() -> None:
    """Seed 001 §1.2: q=(√2,0), keys (0,1),(1,0),(2,0), third key in the future → weights ≈ 0.269, 0.731."""
    q = torch.tensor([[[[math.sqrt(2), 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[0.0, 1.0], [1.0, 0.0], [2.0, 0.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[2.0, 0.0], [0.0, 4.0], [100.0, 100.0]]]], dtype=torch.float64)
    allowed = torch.tensor([True, True, False]).view(1, 1, 1, 3)
    out = grouped_attention(q, k, v, mask=allowed).flatten()
    weight_1 = math.e / (1 + math.e)
    torch.testing.assert_close(out, torch.tensor([2 * (1 - weight_1), 4 * weight_1], dtype=torch.float64), **TOL)
    assert abs(out[0].item() - 0.538) < 1e-3 and abs(out[1].item() - 2.924) < 1e-3


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_in_one_row_never_changes_another_row(side: str) -> None:
    model = tiny_model()
    T = 9
    ids = torch.randint(0, 50, (3, T))
    alone = [model(ids[i : i + 1]).logits for i in range(3)]
    # Row 1 becomes a shorter sequence padded with junk; rows 0 and 2 must not notice.
    mask = torch.ones(3, T, dtype=torch.long)
    real = 5
    padded_ids = ids.clone()
    if side == "right":
        mask[1, real:] = 0
        padded_ids[1, real:] = 7
    else:
        mask[1, : T - real] = 0
        padded_ids[1, : T - real] = 7
    batched = model(padded_ids, attention_mask_BT=mask).logits
    torch.testing.assert_close(batched[0:1], alone[0], **TOL)
    torch.testing.assert_close(batched[2:3], alone[2], **TOL)
    assert torch.isfinite(batched).all()


def test_padding_tokens_never_change_real_positions() -> None:
    """Right padding: the real prefix's logits equal those of the unpadded sequence, whatever the pad ids are."""
    model = tiny_model()
    ids = torch.randint(0, 50, (1, 6))
    reference = model(ids).logits
    for pad_id in (0, 13, 49):
        padded = torch.cat([ids, torch.full((1, 4), pad_id)], dim=1)
        mask = torch.tensor([[1] * 6 + [0] * 4])
        torch.testing.assert_close(model(padded, attention_mask_BT=mask).logits[:, :6], reference, **TOL)


def test_mask_uses_absolute_positions_after_a_prefix() -> None:
    """Seed 001: with 3 cached positions and 2 new queries, the queries see 4 and 5 keys, not 1 and 2."""
    mask = build_attention_mask(torch.tensor([3, 4]), key_length=5)
    assert mask.shape == (1, 1, 2, 5)
    assert mask[0, 0].sum(dim=-1).tolist() == [4, 5]


def test_fully_masked_row_is_an_error_not_nan() -> None:
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    mask[0, 0, 1] = False
    with pytest.raises(ValueError, match="no visible key"):
        grouped_attention(q, k, v, mask=mask)


@pytest.mark.parametrize("block_size", [1, 2, 3, 5, 16])
def test_online_softmax_equals_dense_softmax(block_size: int) -> None:
    scores = torch.randn(6, 11, dtype=torch.float64) * 30 + 1000  # large, to exercise the max rescaling
    values = torch.randn(11, 3, dtype=torch.float64)
    allowed = torch.rand(6, 11) > 0.3
    allowed[:, 0] = True
    dense = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ values
    torch.testing.assert_close(online_softmax_attention(scores, values, allowed, block_size), dense, **TOL)


def test_online_softmax_seed_example() -> None:
    """Seed 000: scores (1000, 1001, 999, 1002) in blocks [0,1), [1,3), [3,4)."""
    scores = torch.tensor([[1000.0, 1001.0, 999.0, 1002.0]], dtype=torch.float64)
    values = torch.tensor([[2.0], [-1.0], [3.0], [4.0]], dtype=torch.float64)
    dense = torch.softmax(scores, dim=-1) @ values
    torch.testing.assert_close(online_softmax_attention(scores, values, block_size=2), dense, **TOL)


def test_online_softmax_fully_masked_row_is_an_error() -> None:
    allowed = torch.ones(2, 4, dtype=torch.bool)
    allowed[1] = False
    with pytest.raises(ValueError, match="no allowed key"):
        online_softmax_attention(torch.randn(2, 4), torch.randn(4, 3), allowed)
