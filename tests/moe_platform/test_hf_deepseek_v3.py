"""DeepSeek-V3 as a Hugging Face interop target: exact logits against transformers' `DeepseekV3ForCausalLM` both
ways (MLA with and without a query latent, sigmoid routing with a random selection bias, group-limited top-k,
routed scaling, shared experts, first dense layers, norm_topk_prob on and off, interleaved and rotate-half RoPE),
bit-exact round trips, one-sentence refusals, `init.from_path` from a saved HF dir, and `moe-export --format hf`.

Every model is tiny, random and made here; nothing is downloaded.
"""

from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moe import ModelConfig, MoEConfig, Transformer
from moe.mla_config import MLAConfig
from moe.moe_config import RouterConfig
from moe.router import group_limited_topk
from moe_platform.config import InitConfig, TrainConfig
from moe_platform.interop.export import load_exported_model
from moe_platform.interop.export import main as moe_export
from moe_platform.interop.hf import DEEPSEEK_V3, ConversionError, from_hf, hf_architecture, to_hf
from moe_platform.interop.init_from import initial_state_dict
from moe_platform.testing import moe_train

VOCAB, TOL = 96, 1e-5
MLA = MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
SMALL = dict(vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=48, max_seq_len=64, attention="mla", norm_eps=1e-6)


def ds_moe(**router) -> MoEConfig:
    """DeepSeek-V3's MoE in small: 8 experts in 4 groups, top-2 within the best 2 groups, one shared expert, the
    first layer dense, sigmoid scores with the balancing bias, routed scaling."""
    router = {"score_fn": "sigmoid", "bias_update_rate": 1e-3, "n_group": 4, "topk_group": 2, **router}
    router.setdefault("routed_scaling_factor", 2.5)
    return MoEConfig(
        num_experts=8,
        top_k=2,
        expert_d_ff=16,
        num_shared_experts=1,
        first_dense_layers=1,
        router=RouterConfig(**router),
    )


EXPORT_CASES = {
    "q_latent_norm_topk": ModelConfig(n_layers=3, mla=MLA, **SMALL, moe=ds_moe()),
    # Full-rank query, no renormalisation, no bias buffer (exported as zeros), two groups of four, no dense layer.
    "full_rank_q_unnormalised": ModelConfig(
        n_layers=2,
        mla=replace(MLA, q_lora_rank=None),
        **SMALL,
        moe=replace(
            ds_moe(renormalize_topk=False, bias_update_rate=0.0, n_group=2, topk_group=1, routed_scaling_factor=1.5),
            num_shared_experts=2,
            first_dense_layers=0,
        ),
    ),
    # Attention biases on the three linears both sides bias, tied embeddings, training-only fields that HF drops.
    "bias_tied_no_shared": ModelConfig(
        n_layers=3,
        mla=MLA,
        attention_bias=True,
        tie_embeddings=True,
        **SMALL,
        moe=replace(ds_moe(jitter_eps=0.1), num_shared_experts=0, capacity_factor=1.0, z_loss_coef=0.01),
    ),
    "dense_mla": ModelConfig(n_layers=2, mla=MLA, **SMALL),
}


def randomize(module: torch.nn.Module, std: float = 0.2) -> None:
    """Every parameter random (norm gains included), and every selection bias random enough to change choices."""
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, std)
        for name, buffer in module.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                buffer.normal_(0.0, 0.1)


def logits(model: torch.nn.Module, ids_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids_BT).logits


def assert_same_logits(ours: Transformer, theirs: transformers.PreTrainedModel) -> float:
    ids_BT = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ours_BTV, theirs_BTV = logits(ours, ids_BT), logits(theirs, ids_BT)
    torch.testing.assert_close(ours_BTV, theirs_BTV, atol=TOL, rtol=TOL)
    return (ours_BTV - theirs_BTV).abs().max().item()


def routing_choices(ours: Transformer, ids_BT: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits_NE, selection bias_E) that each MoE layer's router saw on `ids_BT`."""
    seen = []
    hooks = []
    for block in ours.blocks:
        router = getattr(block.ffn, "router", None)
        if router is None:
            continue
        bias_E = router.expert_bias if router.uses_bias else torch.zeros(router.num_experts)

        def hook(_module, _inputs, output, bias_E=bias_E):
            seen.append((output.logits_NE.detach(), bias_E.clone()))

        hooks.append(router.register_forward_hook(hook))
    logits(ours, ids_BT)
    for handle in hooks:
        handle.remove()
    return seen


def assert_routing_is_not_vacuous(ours: Transformer) -> None:
    """Some token's experts differ with and without the group limit, and with and without the bias, so neither
    the group limit nor the bias could be mapped wrongly and still pass."""
    router = ours.config.moe.router
    ids_BT = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    grouped = biased = 0
    for logits_NE, bias_E in routing_choices(ours, ids_BT):
        choice_NE = logits_NE.sigmoid() + bias_E
        top_k = ours.config.moe.top_k
        limited_NK = group_limited_topk(choice_NE, top_k, router.n_group, router.topk_group).sort(-1).values
        plain_NK = choice_NE.topk(top_k, dim=-1).indices.sort(-1).values
        unbiased_NK = group_limited_topk(logits_NE.sigmoid(), top_k, router.n_group, router.topk_group)
        grouped += int((limited_NK != plain_NK).any(-1).sum())
        biased += int((limited_NK != unbiased_NK.sort(-1).values).any(-1).sum())
    assert grouped > 0, "the group limit changed no token's experts"
    if router.bias_update_rate > 0:
        assert biased > 0, "the selection bias changed no token's experts"


def assert_same_state(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


@pytest.mark.parametrize("name", EXPORT_CASES)
def test_export_matches_transformers_and_round_trips(name, tmp_path):
    config = EXPORT_CASES[name]
    assert hf_architecture(config) == DEEPSEEK_V3
    torch.manual_seed(0)
    ours = Transformer(config)
    randomize(ours)
    hf_config, hf_state = to_hf(config, ours.state_dict())
    assert hf_config.rope_interleave is True and hf_config.num_mtp_layers == 0
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    theirs.load_state_dict(hf_state, strict=True)
    theirs.save_pretrained(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(theirs).__name__ == DEEPSEEK_V3
    diff = assert_same_logits(ours, theirs)
    if config.moe is not None:
        assert_routing_is_not_vacuous(ours)
    print(f"export {name}: max |Δlogit| = {diff:.2e}")

    # ours -> HF -> ours: bit-identical weights; the config comes back up to the fields inference never reads.
    back_config, back_state = from_hf(theirs.config, theirs.state_dict())
    ours_state = ours.state_dict()
    if config.moe is not None and config.moe.router.bias_update_rate == 0:
        # The import keeps DeepSeek-V3's bias (rate 0.001): here it is the zeros the export wrote.
        extra = {k for k in back_state if k.endswith(("expert_bias", "load_since_update"))}
        assert all(not back_state[k].any() for k in extra)
        back_state = {k: v for k, v in back_state.items() if k not in extra}
    assert_same_state(back_state, ours_state)
    assert inference_view(back_config) == inference_view(config)


def inference_view(config: ModelConfig) -> ModelConfig:
    """`config` without the training-only fields no HF config holds (capacity, jitter, losses, the bias's rate)."""
    if config.moe is None:
        return config
    router = replace(config.moe.router, jitter_eps=0.0, bias_update_rate=0.0)
    return replace(
        config,
        moe=replace(config.moe, capacity_factor=None, z_loss_coef=0.0, aux_loss_coef=0.0, router=router),
    )


HF_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,  # the default run's data.seq_len, for init.from_path
    num_mtp_layers=0,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
IMPORT_CASES = {
    "interleaved_q_latent": dict(
        q_lora_rank=16, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True
    ),
    "rotate_half_full_rank_q": dict(
        q_lora_rank=None,
        rope_interleave=False,
        n_group=2,
        topk_group=1,
        n_shared_experts=2,
        first_k_dense_replace=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
    ),
    "interleaved_bias_unnormalised": dict(
        q_lora_rank=16,
        attention_bias=True,
        n_group=4,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=0,
        norm_topk_prob=False,
    ),
}


def make_hf(**fields) -> transformers.PreTrainedModel:
    torch.manual_seed(1)
    made = transformers.AutoModelForCausalLM.from_config(
        transformers.DeepseekV3Config(**{**HF_COMMON, **fields}), dtype=torch.float32
    )
    randomize(made)
    return made.eval()


@pytest.mark.parametrize("name", IMPORT_CASES)
def test_import_matches_transformers_and_round_trips(name):
    theirs = make_hf(**IMPORT_CASES[name])
    config, state = from_hf(theirs.config, theirs.state_dict())
    ours = Transformer(config)
    ours.load_state_dict(state, strict=True)
    diff = assert_same_logits(ours, theirs)
    assert_routing_is_not_vacuous(ours)
    print(f"import {name}: max |Δlogit| = {diff:.2e}")
    # HF -> ours -> HF: the same tensors (written interleaved, whichever layout they came in) and the same logits.
    hf_config, hf_state = to_hf(config, ours.state_dict())
    again = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    again.load_state_dict(hf_state, strict=True)
    assert_same_logits(ours, again)
    if theirs.config.rope_interleave:
        assert_same_state(again.state_dict(), theirs.state_dict())


def one_sentence(error: pytest.ExceptionInfo) -> None:
    assert str(error.value).count(". ") == 0 and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (dict(moe=replace(ds_moe(), router=RouterConfig(score_fn="softmax"))), "score_fn='softmax'"),
        (dict(moe=replace(ds_moe(), eval_capacity_factor=1.25)), "drops tokens at inference"),
        (dict(moe=replace(ds_moe(), first_dense_layers=0, moe_layer_interval=2)), "moe_layer_interval=2"),
        (
            dict(moe=replace(ds_moe(), router=RouterConfig(score_fn="sigmoid", n_group=8, topk_group=2))),
            "groups of one expert",
        ),
        (dict(norm="layernorm"), "model.norm='layernorm'"),
        (dict(activation="gelu", moe=None), "model.activation='gelu'"),
        (dict(ffn_bias=True, moe=ds_moe()), "model.ffn_bias=True"),
    ],
)
def test_unrepresentable_export_is_refused_in_one_sentence(overrides, needle):
    config = ModelConfig(**{"n_layers": 3, "mla": MLA, **SMALL, "moe": ds_moe(), **overrides})
    with pytest.raises(ConversionError, match=needle) as error:
        hf_architecture(config)
    one_sentence(error)


@pytest.mark.parametrize(
    ("pos_encoding", "router", "needle"),
    [
        ("alibi", {}, "model.pos_encoding='alibi'"),
        ("learned", {}, "model.pos_encoding='learned'"),
        ("rope", {"score_fn": "sigmoid"}, "DeepSeek-V3 needs model.attention=mla"),
        ("rope", {"n_group": 2}, "n_group=2"),
        ("rope", {"routed_scaling_factor": 2.0}, "routed_scaling_factor=2.0"),
    ],
)
def test_deepseek_features_without_mla_are_refused(pos_encoding, router, needle):
    config = ModelConfig(
        n_layers=2, vocab_size=VOCAB, d_model=32, n_heads=4, pos_encoding=pos_encoding,
        moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=16, router=RouterConfig(**router)),
    )  # fmt: skip
    with pytest.raises(ConversionError, match=needle) as error:
        hf_architecture(config)
    one_sentence(error)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type='yarn'"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2"),
        (dict(n_group=8, topk_group=4), "groups of one"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(num_experts_per_tok=1, norm_topk_prob=True, n_group=1, topk_group=1), "top-1 routing"),
    ],
)
def test_unrepresentable_import_is_refused_in_one_sentence(fields, needle):
    hf_config = transformers.DeepseekV3Config(**{**HF_COMMON, **IMPORT_CASES["interleaved_q_latent"]})
    for key, value in fields.items():  # set after construction: transformers itself could not build some of them
        setattr(hf_config, key, value)
    with pytest.raises(ConversionError, match=needle) as error:
        from_hf(hf_config, {})
    one_sentence(error)


def test_init_from_a_saved_hf_dir_gives_hf_logits_and_ignores_mtp(tmp_path, capsys):
    theirs = make_hf(**IMPORT_CASES["interleaved_q_latent"])
    theirs.save_pretrained(tmp_path)
    # A real checkpoint also holds MTP modules after its last layer; transformers and ours both leave them out.
    files = load_file(tmp_path / "model.safetensors")
    files["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(files, tmp_path / "model.safetensors", metadata={"format": "pt"})

    config, _ = from_hf(tmp_path)
    assert "ignored 1 multi-token-prediction tensors (model.layers.3.*)" in capsys.readouterr().out
    # absorb_decode changes no weight, only how cached decode runs: a run may choose it.
    run_model = replace(config, mla=replace(config.mla, absorb_decode=False))
    state = initial_state_dict(TrainConfig(model=run_model, init=InitConfig(from_path=str(tmp_path))))
    ours = Transformer(run_model)
    ours.load_state_dict(state, strict=True)
    assert_same_logits(ours, theirs)


def test_cli_exports_a_trained_deepseek_v3_checkpoint(tmp_path):
    moe_train(tmp_path / "run", "model=deepseek_v3_like_tiny", "trainer.save_final=true", "trainer.max_steps=2")
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    moe_export([str(checkpoint), str(tmp_path / "hf"), "--format", "hf"])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(theirs).__name__ == DEEPSEEK_V3
    ours = load_exported_model(checkpoint)
    # Two optimizer steps moved the balancing bias off zero: the export carries it.
    assert any(b.ffn.router.expert_bias.any() for b in ours.blocks if hasattr(b.ffn, "router"))
    ids_BT = torch.randint(0, ours.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(ours, ids_BT), logits(theirs, ids_BT), atol=TOL, rtol=TOL)
    prompt_BT = ids_BT[:, :5]
    expected_BT = ours.generate(prompt_BT, max_new_tokens=8, temperature=0)
    got_BT = theirs.generate(prompt_BT, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(expected_BT, got_BT)


def mtp_logits(model: Transformer, ids_BT: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return model.eval()(ids_BT[:, :-1], labels_BT=ids_BT[:, 1:]).mtp_logits


def test_a_checkpoint_with_an_mtp_layer_round_trips_with_both_heads(tmp_path):
    """A DeepSeek-V3 directory whose layer L is an MTP layer (transformers' MtpLayer, random, under the checkpoint's
    names, with the copies of the embedding and head) imports into model.mtp, exports the same tensors back, and
    imports again to the same main and MTP logits."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    from moe_platform.interop.export import MTP_FILE, write_beside
    from moe_platform.interop.hf.deepseek_v3 import split_mtp

    theirs = make_hf(**IMPORT_CASES["interleaved_q_latent"], num_mtp_layers=1)
    L = theirs.config.num_hidden_layers
    theirs.save_pretrained(tmp_path / "hf")
    files = load_file(tmp_path / "hf" / "model.safetensors")
    layer = MtpLayer(theirs.config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, L)
    randomize(layer)
    checkpoint_mtp = {
        f"model.layers.{L}.{name.replace('mtp_block.', '').replace('post_norm', 'shared_head.norm')}": tensor
        for name, tensor in layer.state_dict().items()
    }
    checkpoint_mtp[f"model.layers.{L}.embed_tokens.weight"] = files["model.embed_tokens.weight"].clone()
    checkpoint_mtp[f"model.layers.{L}.shared_head.head.weight"] = files["lm_head.weight"].clone()
    save_file({**files, **checkpoint_mtp}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})

    config, state = from_hf(tmp_path / "hf")
    assert config.mtp.depth == 1 and config.is_moe_layer(L)
    ours = Transformer(config)
    ours.load_state_dict(state, strict=True)
    assert_same_logits(ours, theirs)

    hf_config, hf_state = to_hf(config, ours.state_dict())
    main, mtp = split_mtp(config, hf_state)
    assert hf_config.num_mtp_layers == 1
    assert_same_state(mtp, checkpoint_mtp)  # the checkpoint's MTP layer, tensor for tensor
    again = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    again.load_state_dict(main, strict=True)
    again.save_pretrained(tmp_path / "again")
    write_beside(tmp_path / "again", mtp, MTP_FILE)

    back_config, back_state = from_hf(tmp_path / "again")
    back = Transformer(back_config)
    back.load_state_dict(back_state, strict=True)
    ids_BT = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(back, ids_BT), logits(ours, ids_BT), atol=TOL, rtol=TOL)
    (ours_BNV,), (back_BNV,) = mtp_logits(ours, ids_BT), mtp_logits(back, ids_BT)
    assert ours_BNV.shape == (2, 15, VOCAB)
    torch.testing.assert_close(back_BNV, ours_BNV, atol=TOL, rtol=TOL)
