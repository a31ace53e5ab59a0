"""ALiBi (Press et al.): slopes as in the paper, scores that depend on distance only, a direct-formula reference.
Hugging Face has no ALiBi decoder in this family, so the reference is the formula itself. The invariants every
position encoding keeps (causality, padding, KV-cache prefix equivalence) are in test_attention_variants.py."""

import math

import pytest
import torch

from moe import ModelConfig, Transformer, build_attention_mask
from moe.alibi import alibi_bias, alibi_slopes
from moe.moe_config import MoEConfig

TOL = dict(atol=1e-10, rtol=1e-8)
VOCAB = 40


def alibi_model(**overrides) -> Transformer:
    fields = dict(
        vocab_size=VOCAB, d_model=24, n_layers=2, n_heads=6, n_kv_heads=3, head_dim=4, d_ff=32, max_seq_len=48,
        pos_encoding="alibi",
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(0)
    return Transformer(ModelConfig(**fields)).double().eval()


@pytest.mark.parametrize(
    "n_heads, expected",
    [
        (1, [2**-8]),
        (4, [2**-2, 2**-4, 2**-6, 2**-8]),
        (8, [2**-h for h in range(1, 9)]),
        # Not a power of two: the 4-head slopes, then the odd-numbered slopes of 8 heads (2^-1, 2^-3).
        (6, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]),
        (12, [2 ** (-h) for h in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]),
    ],
)
def test_slopes_follow_the_paper_for_powers_of_two_and_others(n_heads, expected) -> None:
    assert alibi_slopes(n_heads).tolist() == pytest.approx(expected, rel=1e-15)


def test_bias_is_minus_slope_times_distance_and_minus_infinity_in_the_future() -> None:
    bias = alibi_bias(torch.arange(5), 5, n_heads=4, dtype=torch.float64, allowed=None)[0]
    slopes = alibi_slopes(4)
    for h in range(4):
        for i in range(5):
            for j in range(5):
                expected = -slopes[h].item() * (i - j) if j <= i else float("-inf")
                assert bias[h, i, j].item() == expected


def test_bias_depends_only_on_the_distance_between_query_and_key() -> None:
    """Queries at positions p_i after a prefix of s cached keys see the same bias, distance for distance, as the
    same queries without the prefix: nothing depends on absolute position."""
    plain = alibi_bias(torch.arange(6), 6, n_heads=3, dtype=torch.float64, allowed=None)
    for shift in (1, 7):
        shifted = alibi_bias(torch.arange(shift, shift + 6), shift + 6, n_heads=3, dtype=torch.float64, allowed=None)
        assert torch.equal(shifted[..., shift:], plain)


def test_a_documents_logits_do_not_depend_on_where_it_starts_in_the_window() -> None:
    """Model-level: with a document mask, document 2's logits are those of document 2 alone at positions 0…,
    bit for bit up to rounding, because ALiBi carries only distances (learned positions would fail this)."""
    model = alibi_model(moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=16))
    ids = torch.randint(0, VOCAB, (1, 14))
    documents = torch.tensor([[0] * 5 + [1] * 9])
    packed = model(ids, document_ids_BT=documents).logits
    torch.testing.assert_close(packed[:, 5:], model(ids[:, 5:]).logits, **TOL)


def test_attention_equals_the_direct_formula() -> None:
    """softmax(q·k/√d - m_h (i - j)) v over j ≤ i, head by head, against the first block's attention."""
    model = alibi_model(n_kv_heads=6)
    attn = model.blocks[0].attn
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    mask = alibi_bias(torch.arange(7), 7, n_heads=6, dtype=torch.float64, allowed=None)
    out = attn(x, None, mask)
    q = attn.w_q(x).view(2, 7, 6, 4)
    k = attn.w_k(x).view(2, 7, 6, 4)
    v = attn.w_v(x).view(2, 7, 6, 4)
    slopes = alibi_slopes(6)
    heads = []
    for h in range(6):
        scores = q[:, :, h] @ k[:, :, h].transpose(1, 2) / math.sqrt(4)
        distance = torch.arange(7)[:, None] - torch.arange(7)[None, :]
        scores = scores - slopes[h] * distance
        scores = scores.masked_fill(distance < 0, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, h])
    torch.testing.assert_close(out, attn.w_o(torch.cat(heads, dim=-1)), **TOL)


def test_the_model_has_no_position_parameters() -> None:
    model = alibi_model()
    assert model.pos_embed is None
    assert model.config.num_params() == sum(p.numel() for p in model.parameters())
    names = {name for name, _ in model.named_parameters()}
    assert not any("pos" in name for name in names)


def test_a_key_the_mask_forbids_stays_forbidden_under_the_bias() -> None:
    allowed = build_attention_mask(torch.arange(4), 4, key_valid_BS=torch.tensor([[1, 1, 0, 1]]))
    bias = alibi_bias(torch.arange(4), 4, n_heads=2, dtype=torch.float32, allowed=allowed)
    assert torch.equal(torch.isfinite(bias), allowed.expand(1, 2, 4, 4))
