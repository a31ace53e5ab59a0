"""The dense model: analytic parameter counts equal the real module, and it equals a Hugging Face Llama."""

import itertools

import pytest
import torch

from moe import ModelConfig, Transformer, count_parameters


def real_num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates a tied embedding


VARIANTS = list(
    itertools.product(
        ["learned", "rope"],
        ["layernorm", "rmsnorm"],
        ["gelu", "swiglu"],
        [False, True],  # attention_bias
        [False, True],  # ffn_bias
        [False, True],  # tie_embeddings
        [4, 2, 1],  # n_kv_heads: MHA, GQA, MQA
    )
)


def test_num_params_equals_the_module_for_every_variant() -> None:
    for pos, norm, act, attn_bias, ffn_bias, tie, kv in VARIANTS:
        config = ModelConfig(
            vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=kv, d_ff=24, max_seq_len=11,
            pos_encoding=pos, norm=norm, activation=act, attention_bias=attn_bias, ffn_bias=ffn_bias,
            tie_embeddings=tie,
        )  # fmt: skip
        model = Transformer(config)
        assert config.num_params() == real_num_params(model), (pos, norm, act, attn_bias, ffn_bias, tie, kv)
        assert config.num_active_params() == config.num_params(), "a dense model activates everything"


def test_num_params_matches_the_seeds_closed_form() -> None:
    """Seed 000: P = 2Vd + Cd + N(4d² + 2df + f + 5d) + 2d for learned positions, bias-free attention,
    FFN with biases, LayerNorm with γ and β, GELU, untied output table."""
    V, d, f, N, C = 97, 24, 40, 3, 19
    config = ModelConfig(
        vocab_size=V, d_model=d, d_ff=f, n_layers=N, max_seq_len=C, n_heads=4, pos_encoding="learned",
        norm="layernorm", activation="gelu", attention_bias=False, ffn_bias=True, tie_embeddings=False,
    )  # fmt: skip
    expected = 2 * V * d + C * d + N * (4 * d * d + 2 * d * f + f + 5 * d) + 2 * d
    assert config.num_params() == expected == real_num_params(Transformer(config))


def test_tied_embeddings_share_one_tensor() -> None:
    model = Transformer(ModelConfig(tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    assert count_parameters(model.config).lm_head == 0


def test_init_uses_init_std() -> None:
    model = Transformer(ModelConfig(d_model=256, n_heads=4, d_ff=1024, init_std=0.05))
    std = model.blocks[0].ffn.w_up.weight.std().item()
    assert abs(std - 0.05) < 0.005


def _llama_pair(n_heads: int, n_kv_heads: int):
    import transformers  # the dev extra installs it: a missing reference must fail, not skip
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    config = ModelConfig(
        vocab_size=61, d_model=32, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=56, max_seq_len=64,
        pos_encoding="rope", rope_theta=500.0, norm="rmsnorm", norm_eps=1e-6, activation="swiglu",
    )  # fmt: skip
    hf_config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, attn_implementation="eager",
    )  # fmt: skip
    ours = Transformer(config).double().eval()
    theirs = LlamaForCausalLM(hf_config).double().eval()
    with torch.no_grad():
        theirs.model.embed_tokens.weight.copy_(ours.embed.weight)
        theirs.model.norm.weight.copy_(ours.final_norm.weight)
        theirs.lm_head.weight.copy_(ours.lm_head.weight)
        for block, layer in zip(ours.blocks, theirs.model.layers, strict=True):
            layer.input_layernorm.weight.copy_(block.attn_norm.weight)
            layer.post_attention_layernorm.weight.copy_(block.ffn_norm.weight)
            for ours_name, theirs_name in (("w_q", "q_proj"), ("w_k", "k_proj"), ("w_v", "v_proj"), ("w_o", "o_proj")):
                getattr(layer.self_attn, theirs_name).weight.copy_(getattr(block.attn, ours_name).weight)
            for ours_name, theirs_name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                getattr(layer.mlp, theirs_name).weight.copy_(getattr(block.ffn, ours_name).weight)
    assert real_num_params(ours) == real_num_params(theirs)
    return ours, theirs


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 2), (8, 1)])
def test_dense_model_equals_hugging_face_llama(n_heads: int, n_kv_heads: int) -> None:
    ours, theirs = _llama_pair(n_heads, n_kv_heads)
    ids = torch.randint(0, 61, (2, 17))
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
    torch.testing.assert_close(ours(ids).logits, expected, atol=1e-6, rtol=1e-6)


def test_block_equals_hugging_face_llama_decoder_layer_on_random_hidden_states() -> None:
    """The attention + MLP block alone, fed the same hidden states and positions."""
    ours, theirs = _llama_pair(4, 2)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    positions = torch.arange(9)
    from moe.rope import rope_tables

    rope = rope_tables(positions, ours.config.head_dim, ours.config.rope_theta, torch.float64)
    causal = torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        hf_rope = theirs.model.rotary_emb(x, positions[None])
        expected = theirs.model.layers[0](x, attention_mask=causal, position_ids=positions[None],
                                          position_embeddings=hf_rope)  # fmt: skip
        if isinstance(expected, tuple):
            expected = expected[0]
        actual, _ = ours.blocks[0](x, rope, None, None, None)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)


def test_mixed_dense_and_moe_layers_count_total_and_active_parameters_from_the_modules() -> None:
    """First layer dense, then MoE every other layer, with a shared expert: the analytic counts equal the real
    modules — total = every parameter; active = everything except the (E - K) experts a token does not visit."""
    from moe import MoEConfig, MoELayer

    moe = MoEConfig(num_experts=6, top_k=2, expert_d_ff=24, num_shared_experts=1, first_dense_layers=1,
                    moe_layer_interval=2)  # fmt: skip
    config = ModelConfig(vocab_size=40, d_model=16, n_layers=5, n_heads=4, n_kv_heads=2, d_ff=32, moe=moe)
    model = Transformer(config)
    kinds = [isinstance(block.ffn, MoELayer) for block in model.blocks]
    assert kinds == [False, True, False, True, False]
    assert config.num_params() == real_num_params(model)
    unvisited = 0
    for block in model.blocks:
        if isinstance(block.ffn, MoELayer):
            per_expert = sum(p.numel() for p in block.ffn.experts.parameters()) // moe.num_experts
            unvisited += (moe.num_experts - moe.top_k) * per_expert
    assert config.num_active_params() == real_num_params(model) - unvisited
    out = model(torch.randint(0, 40, (2, 7)))
    assert [o is not None for o in out.moe_outputs] == kinds
    expected_aux = sum(o.aux_loss + o.z_loss for o in out.moe_outputs if o is not None)
    torch.testing.assert_close(out.aux_loss, expected_aux)
