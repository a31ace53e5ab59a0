"""The ledger's activation bytes against what autograd really keeps, and the orderings checkpointing promises."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from moe import ModelConfig, MoEConfig, RunShape, Transformer, format_ledger
from moe.experts import GroupedExperts
from moe.ledger import ACTIVATION_BYTES, activation_bytes, mla_sdpa_is_fused
from moe.mla_config import MLAConfig

TINY = dict(vocab_size=258, d_model=96, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=256)
MLA_TINY = {**TINY, "n_kv_heads": None, "attention": "mla"}
CONFIGS = {
    "moe_swiglu": ModelConfig(**TINY, moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=128)),
    "dense_gelu_layernorm": ModelConfig(**TINY, activation="gelu", norm="layernorm"),
    "moe_shared_capacity": ModelConfig(
        **TINY,
        moe=MoEConfig(
            num_experts=8, top_k=2, expert_d_ff=64, num_shared_experts=2, capacity_factor=1.0, first_dense_layers=1
        ),
    ),
    # v = n + r: SDPA's fused CPU kernel; a query latent; MoE layers after a dense one.
    "mla_fused_q_latent": ModelConfig(
        **MLA_TINY,
        mla=MLAConfig(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24),
        moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=64, first_dense_layers=1),
    ),
    # DeepSeek's v < n + r: values padded to n + r for the fused kernel; full-rank query.
    "mla_padded_v_full_rank_q": ModelConfig(
        **MLA_TINY, mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    ),
    # v > n + r: the math path, which keeps the S×S probabilities.
    "mla_math_wide_v": ModelConfig(
        **MLA_TINY, mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=24)
    ),
    # One (1, H, S, S) float bias shared by every layer.
    "alibi": ModelConfig(**TINY, pos_encoding="alibi", moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=128)),
}


def saved_activation_bytes(model: Transformer, input_ids_BT: torch.Tensor, **kwargs) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward + loss, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model(input_ids_BT, **kwargs)
        F.cross_entropy(output.logits.float().flatten(0, 1), input_ids_BT.flatten())
    saved.pop(0, None)
    return sum(saved.values())


@pytest.mark.parametrize("name", CONFIGS)
def test_estimate_matches_what_autograd_saves(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved tensors + the logits the model returns = the estimate less the two fp32 [N, V] gradients that join
    them as backward starts (within 3%: the router's small [N, E] terms are counted roughly). Under a capacity
    the estimate takes every expert as full, so it bounds the dropped case from above."""
    # The experts' grouped_mm path, the one GPUs run (the CPU's eager path keeps one [A, F] less per layer).
    monkeypatch.setattr(GroupedExperts, "cpu_mm_slices", False)
    config = CONFIGS[name]
    B, S = 4, 64
    model = Transformer(config)
    saved = saved_activation_bytes(model, torch.randint(0, config.vocab_size, (B, S)))
    N, V = B * S, config.vocab_size
    expected = activation_bytes(config, B, S, "fp32").total - 2 * N * V * 4
    if config.moe is not None and config.moe.capacity_factor is not None:
        assert 0.9 * expected <= saved + N * V * 4 <= expected
    else:
        assert saved + N * V * 4 == pytest.approx(expected, rel=0.03)


def test_mla_configs_take_the_sdpa_path_they_are_named_for() -> None:
    assert mla_sdpa_is_fused(CONFIGS["mla_fused_q_latent"])
    assert mla_sdpa_is_fused(CONFIGS["mla_padded_v_full_rank_q"])
    assert not mla_sdpa_is_fused(CONFIGS["mla_math_wide_v"])


@pytest.mark.parametrize(
    "name", ["moe_swiglu", "mla_fused_q_latent", "mla_padded_v_full_rank_q", "mla_math_wide_v", "alibi"]
)
def test_document_mask_adds_what_sdpa_keeps(name: str) -> None:
    """Packed documents: the block-diagonal mask SDPA's fused kernel keeps per layer (B·S²·s each), nothing on the
    math path (it adds the mask), and for ALiBi the bias grown from (1, H, S, S) to (B, H, S, S), once."""
    config = CONFIGS[name]
    B, S = 4, 64
    input_ids_BT = torch.randint(0, config.vocab_size, (B, S))
    document_ids_BT = (torch.arange(S) // 20).expand(B, S)
    model = Transformer(config)
    plain = saved_activation_bytes(model, input_ids_BT)
    masked = saved_activation_bytes(model, input_ids_BT, document_ids_BT=document_ids_BT)
    with_mask = activation_bytes(config, B, S, "fp32", attention_mask=True)
    assert masked - plain == with_mask.total - activation_bytes(config, B, S, "fp32").total
    if name == "alibi":
        assert masked - plain == (B - 1) * config.n_heads * S**2 * 4
    elif name == "mla_math_wide_v":
        assert masked == plain
    else:
        assert masked - plain == config.n_layers * B * S**2 * 4


def test_dispatch_buffers_follow_capacity() -> None:
    """A capacity below N·K/E per expert keeps fewer gathered rows; dropless keeps N·K of them."""
    dropless = CONFIGS["moe_swiglu"]
    capped = replace(dropless, moe=replace(dropless.moe, capacity_factor=0.5, min_capacity=0))
    assert activation_bytes(capped, 8, 64, "fp32").dispatch < activation_bytes(dropless, 8, 64, "fp32").dispatch


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpointing_orders_and_scales(name: str, precision: str) -> None:
    """full ≤ moe ≤ none; without checkpointing every term but ALiBi's bias is per sequence, so bytes double with
    the micro-batch; a dense model has no MoE or dispatch bytes."""
    config = CONFIGS[name]
    none, full = (activation_bytes(config, 4, 64, precision, mode) for mode in ("none", "full"))
    assert full.total < none.total
    if config.moe is not None:
        moe = activation_bytes(config, 4, 64, precision, "moe")
        assert full.total <= moe.total < none.total
    else:
        assert none.moe == none.dispatch == 0
    # ALiBi's one (1, H, S, S) bias serves the whole micro-batch: the only term that does not scale with B.
    shared = config.n_heads * 64**2 * ACTIVATION_BYTES[precision] if config.pos_encoding == "alibi" else 0
    assert activation_bytes(config, 8, 64, precision).total == 2 * none.total - shared
    assert ACTIVATION_BYTES[precision] == (4 if precision == "fp32" else 2)


def test_full_checkpointing_keeps_one_block_input_per_layer() -> None:
    """Under "full" the attention row is exactly L·N·D·s: nothing else of a block survives its forward."""
    config = CONFIGS["moe_swiglu"]
    acts = activation_bytes(config, 4, 64, "bf16", "full")
    assert acts.attention == config.n_layers * 4 * 64 * config.d_model * 2
    assert acts.ffn == acts.moe == acts.dispatch == 0


def test_bad_arguments_say_what_to_use() -> None:
    with pytest.raises(ValueError, match="checkpointing='some'"):
        activation_bytes(CONFIGS["moe_swiglu"], 1, 8, "fp32", "some")
    with pytest.raises(ValueError, match="precision='fp16'"):
        activation_bytes(CONFIGS["moe_swiglu"], 1, 8, "fp16")


def test_ledger_prints_activations_for_every_mode() -> None:
    text = format_ledger(CONFIGS["moe_swiglu"], RunShape(micro_batch_size=4, seq_len=64, checkpointing="moe"))
    assert "activations per micro-batch (moe)" in text
    assert "with checkpointing=none" in text and "with checkpointing=full" in text
    dense = format_ledger(CONFIGS["dense_gelu_layernorm"], RunShape())
    assert "dispatch" not in dense and "with checkpointing=moe" not in dense
    assert "ALiBi's float bias once" in format_ledger(CONFIGS["alibi"], RunShape())
    assert "S×S probabilities" in format_ledger(CONFIGS["mla_math_wide_v"], RunShape())
    assert "S×S probabilities" not in format_ledger(CONFIGS["mla_padded_v_full_rank_q"], RunShape())
    assert "S×S probabilities" not in format_ledger(CONFIGS["mla_fused_q_latent"], RunShape())


def test_alibi_bias_survives_full_checkpointing_once() -> None:
    """The bias is built outside the blocks, so under "full" it stays beside each block's input: H·S²·s once."""
    config = CONFIGS["alibi"]
    acts = activation_bytes(config, 4, 64, "fp32", "full")
    assert acts.attention == config.n_layers * 4 * 64 * config.d_model * 4 + config.n_heads * 64**2 * 4
