"""Sparse upcycling: at step 0 the upcycled MoE model computes the dense model's logits
(moe_platform/interop/upcycle.py)."""

import dataclasses

import pytest
import torch

from moe import ModelConfig, ModelConfigError, Transformer
from moe.mla_config import MLAConfig
from moe.moe_config import MoEConfig, RouterConfig
from moe_platform.interop.upcycle import upcycle_state_dict

DENSE = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)


def _moe(**moe) -> ModelConfig:
    return dataclasses.replace(DENSE, moe=MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_d_ff": 64, **moe}))


def _upcycled_vs_dense(moe_config: ModelConfig, zero_router: bool = False) -> float:
    """Max |logit difference| between a random dense model and its upcycled MoE model (eval, fp32)."""
    torch.manual_seed(0)
    dense = Transformer(DENSE).eval()
    model = Transformer(moe_config).eval()
    model.load_state_dict(upcycle_state_dict(DENSE, dense.state_dict(), moe_config, seed=1), strict=True)
    if zero_router:  # equal logits: every gate 1/K
        for block in model.blocks:
            if hasattr(block.ffn, "router"):
                torch.nn.init.zeros_(block.ffn.router.weight)
    ids_BT = torch.randint(0, DENSE.vocab_size, (3, 16))
    with torch.no_grad():
        return (model(ids_BT).logits - dense(ids_BT).logits).abs().max().item()


@pytest.mark.parametrize(
    "moe",
    [
        {},  # every layer MoE, renormalised top-2 gates, dropless
        {"first_dense_layers": 1, "moe_layer_interval": 2},  # interleaved dense / MoE layers
        {"router": RouterConfig(softmax_after_topk=True)},
        {"router": RouterConfig(score_fn="sigmoid", bias_update_rate=1e-3)},  # renormalised sigmoid gates
        {"num_shared_experts": 1},  # f = F: shared and routed each carry half of the FFN
        {"expert_d_ff": 32, "num_shared_experts": 1},  # F = (S + 1)·f: one slice shared, the other routed
        {"expert_d_ff": 16, "num_shared_experts": 3},  # F = 4f = (S + 1)·f
    ],
    ids=["all_moe", "interleaved", "softmax_after_topk", "sigmoid_bias", "shared", "fine_shared2", "fine_shared4"],
)
def test_upcycled_logits_equal_dense_for_any_router(moe):
    assert _upcycled_vs_dense(_moe(**moe)) < 1e-5


def test_fine_grained_equals_dense_when_each_slice_group_gets_an_equal_gate():
    # F = 4f, no shared experts: expert e = 4·slice e; K = E = 4 with equal logits gives gates 1/4 each.
    assert _upcycled_vs_dense(_moe(expert_d_ff=16, top_k=4), zero_router=True) < 1e-5
    # E = 8 experts in 4 slice groups: a random router picks no such set, so only the expectation matches.
    assert _upcycled_vs_dense(_moe(expert_d_ff=16, num_experts=8, top_k=2)) > 1e-3


def test_capacity_drops_break_the_equality():
    # Dropped assignments lose their expert's share: the invariant needs dropless routing (eval capacity here).
    assert _upcycled_vs_dense(_moe(eval_capacity_factor=0.25, min_capacity=0)) > 1e-3


def test_router_is_fresh_and_seeded_and_the_rest_copied():
    dense = Transformer(DENSE)
    moe_config = _moe(first_dense_layers=1, moe_layer_interval=2)
    a = upcycle_state_dict(DENSE, dense.state_dict(), moe_config, seed=3)
    b = upcycle_state_dict(DENSE, dense.state_dict(), moe_config, seed=3)
    c = upcycle_state_dict(DENSE, dense.state_dict(), moe_config, seed=4)
    assert torch.equal(a["blocks.1.ffn.router.weight"], b["blocks.1.ffn.router.weight"])
    assert not torch.equal(a["blocks.1.ffn.router.weight"], c["blocks.1.ffn.router.weight"])
    for name, tensor in dense.state_dict().items():
        if not name.startswith(("blocks.1.ffn.", "blocks.3.ffn.")):
            assert torch.equal(a[name], tensor), name
    experts_w_up = a["blocks.3.ffn.experts.w_up"]
    assert all(torch.equal(w_DF, dense.blocks[3].ffn.w_up.weight.T) for w_DF in experts_w_up)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"d_model": 64}, "model.d_model=64 differs from the dense source's 32"),
        ({"n_layers": 2}, "model.n_layers=2 differs"),
        ({"vocab_size": 65}, "model.vocab_size=65 differs"),
        ({"n_kv_heads": 4}, "model.n_kv_heads=4 differs"),
        ({"d_ff": 128}, "model.d_ff=128 differs"),
        ({"moe": MoEConfig(num_experts=4, top_k=2, expert_d_ff=48)}, "moe.expert_d_ff=48 does not divide"),
        ({"moe": MoEConfig(num_experts=4, top_k=2, expert_d_ff=128)}, "moe.expert_d_ff=128 does not divide"),
        (
            {"moe": MoEConfig(num_experts=4, top_k=2, expert_d_ff=32, num_shared_experts=2)},
            "moe.num_shared_experts=2 with 2 slices",
        ),
        ({"moe": None}, "target's model.moe is null"),
    ],
)
def test_configs_that_disagree_are_refused_in_one_sentence(change, message):
    target = dataclasses.replace(_moe(), **change)
    with pytest.raises(ModelConfigError, match=message) as err:
        upcycle_state_dict(DENSE, Transformer(DENSE).state_dict(), target)
    assert "\n" not in str(err.value)


def test_an_moe_source_is_refused():
    with pytest.raises(ModelConfigError, match="already has MoE layers"):
        upcycle_state_dict(_moe(), {}, _moe())


MLA_DENSE = dataclasses.replace(
    DENSE, n_kv_heads=None, attention="mla",
    mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
)  # fmt: skip
# DeepSeek-V3's routing: sigmoid scores with the balancing bias, top-2 inside the best 2 of 4 groups, gates scaled
# by 2.5, a shared expert of half the FFN beside the routed half, the first layer dense.
V3_MOE = MoEConfig(
    num_experts=8, top_k=2, expert_d_ff=32, num_shared_experts=1, first_dense_layers=1,
    router=RouterConfig(score_fn="sigmoid", bias_update_rate=1e-3, n_group=4, topk_group=2, routed_scaling_factor=2.5),
)  # fmt: skip


@pytest.mark.parametrize(
    "dense_config", [MLA_DENSE, dataclasses.replace(DENSE, pos_encoding="alibi")], ids=["mla", "gqa_alibi"]
)
def test_a_dense_model_upcycles_into_deepseek_v3_routing_with_equal_logits(dense_config):
    """Every attention tensor (MLA's w_q latent and norm, w_kv_down, kv_norm, w_kv_up, w_o) is carried across by
    name, and the routed experts' share is divided by routed_scaling_factor, so the logits are the dense model's
    for any group-limited choice. (MLA takes its positions from its own RoPE branch: ALiBi goes with GQA.)"""
    moe_config = dataclasses.replace(dense_config, moe=V3_MOE)
    torch.manual_seed(0)
    dense = Transformer(dense_config).eval()
    state = upcycle_state_dict(dense_config, dense.state_dict(), moe_config, seed=1)
    attention = {name for name in dense.state_dict() if ".attn." in name}
    if dense_config.attention == "mla":
        assert {"blocks.0.attn.w_kv_down.weight", "blocks.0.attn.kv_norm.weight", "blocks.3.attn.w_q.1.weight"} <= (
            attention
        )
    for name in attention:
        assert torch.equal(state[name], dense.state_dict()[name]), name
    model = Transformer(moe_config).eval()
    model.load_state_dict(state, strict=True)
    ids_BT = torch.randint(0, DENSE.vocab_size, (3, 16))
    with torch.no_grad():
        assert (model(ids_BT).logits - dense(ids_BT).logits).abs().max().item() < 1e-5


def test_routed_scaling_alone_keeps_upcycling_exact():
    assert _upcycled_vs_dense(_moe(router=RouterConfig(routed_scaling_factor=2.5))) < 1e-5


def test_mla_shapes_must_match_but_absorbed_decoding_is_the_runs_choice():
    dense = Transformer(MLA_DENSE).state_dict()
    absorbed = dataclasses.replace(MLA_DENSE.mla, absorb_decode=not MLA_DENSE.mla.absorb_decode)
    upcycle_state_dict(MLA_DENSE, dense, dataclasses.replace(MLA_DENSE, mla=absorbed, moe=V3_MOE))
    narrower = dataclasses.replace(MLA_DENSE.mla, kv_lora_rank=8)
    with pytest.raises(ModelConfigError, match=r"model.mla=.* differs from the dense source's"):
        upcycle_state_dict(MLA_DENSE, dense, dataclasses.replace(MLA_DENSE, mla=narrower, moe=V3_MOE))
