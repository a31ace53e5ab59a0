"""MoEConfig: validation messages, which layers are MoE, and analytic counts against the real MoELayer."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moe.moe_config import MoEConfig, RouterConfig
from moe.moe_layer import MoELayer

BASE = dict(num_experts=4, top_k=2, expert_d_ff=16)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(top_k=5), "moe.top_k=5 exceeds moe.num_experts=4"),
        (dict(top_k=0), "moe.top_k"),
        (dict(num_experts=0, top_k=1, router=RouterConfig(renormalize_topk=False)), "moe.num_experts"),
        (dict(expert_d_ff=0), "moe.expert_d_ff"),
        (dict(num_shared_experts=-1), "moe.num_shared_experts"),
        (dict(first_dense_layers=-1), "moe.first_dense_layers"),
        (dict(moe_layer_interval=0), "moe.moe_layer_interval"),
        (dict(capacity_factor=0.0), "moe.capacity_factor"),
        (dict(capacity_factor=-1.25), "moe.capacity_factor"),
        (dict(eval_capacity_factor=0.0), "moe.eval_capacity_factor"),
        (dict(min_capacity=-1), "moe.min_capacity"),
        (dict(drop_policy="random"), "moe.drop_policy"),
        (dict(aux_loss_coef=-0.01), "moe.aux_loss_coef"),
        (dict(z_loss_coef=-0.01), "moe.z_loss_coef"),
        (dict(aux_loss_scope="batch"), "moe.aux_loss_scope"),
        (dict(top_k=1), "moe.router.renormalize_topk=True with moe.top_k=1"),
        (dict(router=dict(score_fn="relu")), "moe.router.score_fn"),
        (dict(router=dict(score_fn="sigmoid", softmax_after_topk=True)), "moe.router.softmax_after_topk"),
        (dict(router=dict(softmax_after_topk=True, renormalize_topk=False)), "moe.router.softmax_after_topk"),
        (dict(router=dict(jitter_eps=1.0)), "moe.router.jitter_eps"),
        (dict(router=dict(bias_update_rate=-1e-3)), "moe.router.bias_update_rate"),
        (dict(router=dict(n_group=3)), "moe.router.n_group=3"),
        (dict(router=dict(n_group=2, topk_group=3)), "moe.router.n_group=2, topk_group=3"),
        (dict(router=dict(n_group=0)), "moe.router.n_group=0"),
        (dict(top_k=3, router=dict(n_group=4, topk_group=1)), "moe.top_k=3 exceeds the 1 experts"),
        (dict(router=dict(routed_scaling_factor=0.0)), "moe.router.routed_scaling_factor"),
    ],
)
def test_invalid_configs_raise_a_sentence_naming_the_field_and_the_fix(changes, field):
    with pytest.raises(ValueError) as excinfo:
        MoEConfig(**{**BASE, **changes})
    message = str(excinfo.value)
    assert field in message
    assert ": " in message.split(field, 1)[1]  # the fix follows the diagnosis


def test_valid_corner_configs_are_accepted():
    MoEConfig(**{**BASE, "top_k": 1, "router": RouterConfig(renormalize_topk=False)})  # Switch
    MoEConfig(**{**BASE, "top_k": 4, "capacity_factor": 1.0, "eval_capacity_factor": 2.0, "min_capacity": 0})
    cfg = MoEConfig(**BASE, router={"score_fn": "sigmoid", "bias_update_rate": 1e-3})
    assert cfg.router == RouterConfig(score_fn="sigmoid", bias_update_rate=1e-3)


@pytest.mark.parametrize(
    "first_dense, interval, expected",
    [
        (0, 1, [0, 1, 2, 3, 4, 5]),  # every layer
        (0, 2, [0, 2, 4]),  # every other layer
        (2, 1, [2, 3, 4, 5]),  # first N dense, then MoE (DeepSeek)
        (1, 2, [1, 3, 5]),
    ],
)
def test_is_moe_layer_patterns(first_dense, interval, expected):
    cfg = MoEConfig(**BASE, first_dense_layers=first_dense, moe_layer_interval=interval)
    assert [i for i in range(6) if cfg.is_moe_layer(i, 6)] == expected


def test_is_moe_layer_rejects_a_model_without_moe_layers_and_bad_indices():
    with pytest.raises(ValueError, match=r"moe\.first_dense_layers=6"):
        MoEConfig(**BASE, first_dense_layers=6).is_moe_layer(0, 6)
    with pytest.raises(ValueError, match="layer_idx=6"):
        MoEConfig(**BASE).is_moe_layer(6, 6)


CONFIGS = [
    (MoEConfig(num_experts=4, top_k=2, expert_d_ff=16), "gelu"),
    (MoEConfig(num_experts=4, top_k=2, expert_d_ff=16), "swiglu"),
    (MoEConfig(8, 1, 12, num_shared_experts=2, router=RouterConfig(renormalize_topk=False)), "gelu"),
    (MoEConfig(6, 3, 8, num_shared_experts=1, router=RouterConfig(bias_update_rate=1e-3)), "swiglu"),
]


@pytest.mark.parametrize("cfg, activation", CONFIGS)
def test_num_params_equals_the_real_module(cfg, activation):
    layer = MoELayer(24, cfg, activation)
    assert cfg.num_params(24, activation) == sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("cfg, activation", CONFIGS)
def test_num_active_params_is_router_plus_k_experts_plus_shared(cfg, activation):
    layer = MoELayer(24, cfg, activation)
    one_expert = sum(p.numel() for p in layer.experts.parameters()) // cfg.num_experts
    shared = sum(p.numel() for p in layer.shared_experts.parameters()) if layer.shared_experts else 0
    expected = layer.router.weight.numel() + cfg.top_k * one_expert + shared
    assert cfg.num_active_params(24, activation) == expected


@pytest.mark.parametrize("cfg, activation", CONFIGS)
def test_matmul_flops_per_token_equals_the_matmuls_a_dropless_forward_runs(cfg, activation):
    layer = MoELayer(24, dataclasses.replace(cfg, capacity_factor=None), activation)
    x = torch.randn(2, 5, 24)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    assert counter.get_total_flops() == 10 * cfg.matmul_flops_per_token(24, activation)


def test_matmul_flops_per_token_hand_value():
    cfg = MoEConfig(num_experts=4, top_k=2, expert_d_ff=16, num_shared_experts=1)
    # router 2·D·E + (K + shared) · 3 projections · 2·D·F for SwiGLU
    assert cfg.matmul_flops_per_token(8, "swiglu") == 2 * 8 * 4 + 3 * 3 * 2 * 8 * 16
