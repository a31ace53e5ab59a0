"""Block-diagonal causal attention over packed documents (`Transformer.forward(document_ids_BT=...)`): no token sees
another document, in the logits and in the gradients; one document per window is plain causal attention. Models are
dropless (capacity_factor=None): a capacity limit would couple documents through the experts, not the attention."""

import pytest
import torch

from moe import ModelConfig, Transformer, build_attention_mask
from moe.moe_config import MoEConfig, RouterConfig

# Row 0: documents [0, 5) [5, 12) [12, 16); row 1: [0, 9) [9, 16).
DOCUMENTS_BT = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
SPANS = [(0, 0, 5), (0, 5, 12), (0, 12, 16), (1, 0, 9), (1, 9, 16)]  # (row, start, end)


def tiny_model(pos_encoding: str, moe: bool, attention: str = "gqa") -> Transformer:
    """GQA models route by softmax; the MLA model routes as DeepSeek-V3 (sigmoid, top-2 within the best 2 of 4
    groups, routed scaling, a shared expert)."""
    fields = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32, attention=attention)
    if attention == "gqa":
        fields["n_kv_heads"] = 2
    if moe and attention == "mla":
        router = RouterConfig(score_fn="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
        fields["moe"] = MoEConfig(num_experts=8, top_k=2, expert_d_ff=16, num_shared_experts=1, router=router)
    elif moe:
        fields["moe"] = MoEConfig(num_experts=4, top_k=2, expert_d_ff=24)
    torch.manual_seed(0)
    return Transformer(ModelConfig(pos_encoding=pos_encoding, **fields)).double().eval()


MODELS = [
    ("rope", False, "gqa"),
    ("rope", True, "gqa"),
    ("learned", False, "gqa"),
    ("alibi", True, "gqa"),
    ("rope", True, "mla"),
]


def same_logits(a: torch.Tensor, b: torch.Tensor, moe: bool) -> bool:
    """Bit for bit for dense models. In an MoE model the changed tokens route elsewhere, so each expert's GEMM
    multiplies another number of rows, and BLAS may block a row's dot products by that number: other documents'
    logits then differ in the last bits (seen in float64 on an AMD EPYC, ~1e-16 relative), while a leak moves them
    by ~1e-2."""
    return torch.equal(a, b) if not moe else torch.allclose(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize(("pos_encoding", "moe", "attention"), MODELS)
def test_changing_one_document_leaves_every_other_documents_logits_unchanged(
    pos_encoding: str, moe: bool, attention: str
) -> None:
    model = tiny_model(pos_encoding, moe, attention)
    ids_BT = torch.randint(0, 50, DOCUMENTS_BT.shape, generator=torch.Generator().manual_seed(1))
    logits = model(ids_BT, document_ids_BT=DOCUMENTS_BT).logits
    for row, start, end in SPANS:
        changed_BT = ids_BT.clone()
        changed_BT[row, start:end] = (changed_BT[row, start:end] + 1) % 50
        changed = model(changed_BT, document_ids_BT=DOCUMENTS_BT).logits
        other_BT = torch.ones_like(ids_BT, dtype=torch.bool)
        other_BT[row, start:end] = False
        assert same_logits(changed[other_BT], logits[other_BT], moe), f"document [{start}, {end}) of row {row} leaked"
        assert not torch.equal(changed[row, start:end], logits[row, start:end])
        # Causal within the document: changing its last token changes none of its earlier logits.
        last_BT = ids_BT.clone()
        last_BT[row, end - 1] = (last_BT[row, end - 1] + 1) % 50
        earlier = model(last_BT, document_ids_BT=DOCUMENTS_BT).logits[row, : end - 1]
        assert same_logits(earlier, logits[row, : end - 1], moe)


@pytest.mark.parametrize(("pos_encoding", "moe", "attention"), MODELS)
def test_a_documents_loss_has_zero_gradient_on_other_documents_embeddings(
    pos_encoding: str, moe: bool, attention: str
) -> None:
    model = tiny_model(pos_encoding, moe, attention)
    ids_BT = torch.randint(0, 50, DOCUMENTS_BT.shape, generator=torch.Generator().manual_seed(2))
    embedded = {}

    def keep_embeddings(module, inputs, output_BTD):
        output_BTD.retain_grad()
        embedded["x_BTD"] = output_BTD

    handle = model.embed.register_forward_hook(keep_embeddings)
    try:
        for row, start, end in SPANS:
            model.zero_grad(set_to_none=True)
            logits = model(ids_BT, document_ids_BT=DOCUMENTS_BT).logits
            logits[row, start:end].square().sum().backward()
            grad_BTD = embedded["x_BTD"].grad
            outside_BT = torch.ones_like(ids_BT, dtype=torch.bool)
            outside_BT[row, start:end] = False
            assert (grad_BTD[outside_BT] == 0).all(), f"document [{start}, {end}) of row {row} reads another"
            assert (grad_BTD[row, start:end].abs().sum(dim=-1) > 0).all()
    finally:
        handle.remove()


@pytest.mark.parametrize(("pos_encoding", "moe", "attention"), MODELS)
def test_one_document_per_window_is_plain_causal_attention(pos_encoding: str, moe: bool, attention: str) -> None:
    model = tiny_model(pos_encoding, moe, attention)
    ids_BT = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(3))
    one_document_BT = torch.zeros_like(ids_BT)
    masked = model(ids_BT, document_ids_BT=one_document_BT).logits
    # The same boolean-mask path with nothing padded: equal bit for bit; SDPA's fused causal path: up to rounding.
    assert torch.equal(masked, model(ids_BT, attention_mask_BT=torch.ones_like(ids_BT)).logits)
    torch.testing.assert_close(masked, model(ids_BT).logits, atol=1e-12, rtol=1e-10)


def test_rope_positions_need_no_reset_at_a_document_start() -> None:
    """Under RoPE a score depends on key-query distance only, so a document's logits do not depend on where in the
    window it starts: absolute window positions equal per-document positions."""
    model = tiny_model("rope", moe=False)
    document_T = torch.randint(0, 50, (7,), generator=torch.Generator().manual_seed(4))
    prefix_T = torch.randint(0, 50, (9,), generator=torch.Generator().manual_seed(5))
    alone = model(document_T[None]).logits[0]
    packed_ids = torch.cat([prefix_T, document_T])[None]
    packed = model(packed_ids, document_ids_BT=torch.tensor([[0] * 9 + [1] * 7])).logits[0, 9:]
    torch.testing.assert_close(packed, alone, atol=1e-12, rtol=1e-10)


def test_document_mask_combines_with_padding_as_a_conjunction() -> None:
    positions_T = torch.arange(16)
    valid_BS = torch.ones_like(DOCUMENTS_BT)
    valid_BS[1, :3] = 0  # left padding in row 1
    both = build_attention_mask(positions_T, 16, valid_BS, DOCUMENTS_BT)[:, 0]
    padding = build_attention_mask(positions_T, 16, valid_BS)[:, 0]
    documents = build_attention_mask(positions_T, 16, document_ids_BS=DOCUMENTS_BT)[:, 0]
    real_BT = valid_BS.bool()
    assert torch.equal(both[real_BT], (padding & documents)[real_BT])
    same_document_BTS = DOCUMENTS_BT[:, :, None] == DOCUMENTS_BT[:, None, :]
    assert torch.equal(documents, same_document_BTS & torch.ones(16, 16, dtype=torch.bool).tril())


def test_document_ids_are_refused_with_a_kv_cache_or_a_wrong_shape() -> None:
    model = tiny_model("rope", moe=False)
    ids_BT = torch.zeros_like(DOCUMENTS_BT)
    with pytest.raises(ValueError, match="KV cache"):
        model(ids_BT, kv_cache=model.new_kv_cache(2), document_ids_BT=DOCUMENTS_BT)
    with pytest.raises(ValueError, match="must match"):
        model(ids_BT, document_ids_BT=DOCUMENTS_BT[:, :8])
