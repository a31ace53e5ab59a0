"""MoELayer end to end: references, parity with transformers' Mixtral block, drops, masks, eval, statistics."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from moe.ffn import FeedForward
from moe.losses import load_balancing_loss
from moe.moe_config import MoEConfig, RouterConfig
from moe.moe_layer import MoELayer, MoEOutput, update_balancing_biases
from moe.stats import MoEStats, summarize
from moe_platform.testing import run_distributed

D = 8


def make_layer(activation="swiglu", init_std=0.3, **fields) -> MoELayer:
    fields = {"num_experts": 4, "top_k": 2, "expert_d_ff": 12, "min_capacity": 0, **fields}
    return MoELayer(D, MoEConfig(**fields), activation, init_std=init_std).double()


def reference_layer(layer: MoELayer, x_BTD: torch.Tensor) -> torch.Tensor:
    """The layer's math written token by token, independent of the sorting/dispatch implementation."""
    cfg, experts = layer.config, layer.experts
    x_ND = x_BTD.reshape(-1, D)
    num_tokens = x_ND.shape[0]
    logits = x_ND @ layer.router.weight.T
    routed = []  # (token, expert, gate)
    for n in range(num_tokens):
        if cfg.router.score_fn == "sigmoid":
            scores = logits[n].sigmoid()
        else:
            scores = logits[n].softmax(-1)
        top = sorted(range(cfg.num_experts), key=lambda e: -scores[e].item())[: cfg.top_k]
        chosen = scores[top]
        gates = chosen / chosen.sum() if cfg.router.renormalize_topk else chosen
        routed += [(n, e, g) for e, g in zip(top, gates, strict=True)]
    kept = routed
    if cfg.capacity_factor is not None:
        capacity = max(math.ceil(cfg.top_k * cfg.capacity_factor * num_tokens / cfg.num_experts), cfg.min_capacity)
        kept = []
        for e in range(cfg.num_experts):
            queue = [r for r in routed if r[1] == e]  # token order
            if cfg.drop_policy == "probs":
                queue = sorted(queue, key=lambda r: -r[2].item())
            kept += queue[:capacity]
    out = torch.zeros_like(x_ND)
    for n, e, g in kept:
        x = x_ND[n]
        if experts.w_gate is not None:
            h = F.silu(x @ experts.w_gate[e]) * (x @ experts.w_up[e])
        else:
            h = F.gelu(x @ experts.w_up[e])
        out[n] += g * (h @ experts.w_down[e])
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x_ND)
    return out.view_as(x_BTD)


@pytest.mark.parametrize(
    "activation, fields",
    [
        ("swiglu", dict()),
        ("gelu", dict(capacity_factor=0.75)),
        ("swiglu", dict(capacity_factor=0.75, drop_policy="probs")),
        ("gelu", dict(num_shared_experts=2, capacity_factor=1.0)),
        ("swiglu", dict(router=RouterConfig(score_fn="sigmoid", renormalize_topk=False))),
        ("gelu", dict(top_k=3, router=RouterConfig(score_fn="sigmoid"), capacity_factor=0.5, drop_policy="probs")),
    ],
)
def test_layer_equals_a_token_by_token_reference(activation, fields):
    torch.manual_seed(0)
    layer = make_layer(activation, **fields)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    out = layer(x)
    assert isinstance(out, MoEOutput) and out[0] is out.output and out.output.shape == x.shape
    torch.testing.assert_close(out.output, reference_layer(layer, x), rtol=1e-10, atol=1e-12)


def copy_into_mixtral(layer: MoELayer, block) -> None:
    """transformers >= 5 Mixtral experts: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]."""
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        w_gate_up_EDF = torch.cat([layer.experts.w_gate, layer.experts.w_up], dim=2)
        block.experts.gate_up_proj.copy_(w_gate_up_EDF.transpose(1, 2))
        block.experts.down_proj.copy_(layer.experts.w_down.transpose(1, 2))


def test_dropless_softmax_topk_renormalise_swiglu_matches_transformers_mixtral():
    # The dev extra installs transformers: a missing reference must fail, not skip.
    from transformers.models.mixtral import modeling_mixtral as modeling
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig

    torch.manual_seed(0)
    layer = make_layer("swiglu", num_experts=6, top_k=2, capacity_factor=None)
    hf_config = MixtralConfig(
        hidden_size=D, intermediate_size=12, num_local_experts=6, num_experts_per_tok=2,
        router_jitter_noise=0.0, hidden_act="silu", experts_implementation="eager",
    )  # fmt: skip
    block = modeling.MixtralSparseMoeBlock(hf_config).double()
    copy_into_mixtral(layer, block)
    x = torch.randn(3, 11, D, dtype=torch.float64)
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = layer(x_ours).output, block(x_hf)
    # Mixtral rounds its routing probabilities to fp32 even for fp64 inputs, so each gate carries a relative
    # error up to 2**-24: agreement is to ~1e-7 of the output's scale (a routing bug would be off by O(1)).
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    grad = torch.randn_like(ours)
    ours.backward(grad)
    theirs.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=0, atol=1e-6 * x_hf.grad.abs().max().item())


def skewed_layer(**fields) -> MoELayer:
    """Every (positive) token ranks expert 0 first, expert 1 second: capacity decides who is served."""
    layer = make_layer("gelu", **{"aux_loss_coef": 0.0, "z_loss_coef": 0.0, **fields})
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([1.0, 0.5, -1.0, -1.0])[:, None].expand(4, D))
    return layer


def test_a_token_dropped_by_all_its_experts_leaves_as_exactly_zero_and_rides_the_residual():
    layer = skewed_layer(capacity_factor=1.0)  # C = ceil(2 · 1.0 · 8 / 4) = 4
    x = torch.rand(1, 8, D, dtype=torch.float64) + 0.1
    out = layer(x)
    assert torch.equal(out.output[0, 4:], torch.zeros(4, D, dtype=torch.float64))  # tokens 4..7 overflowed
    assert torch.equal(x + out.output, torch.cat([x[:, :4] + out.output[:, :4], x[:, 4:]], dim=1))
    assert (out.output[0, :4].abs().sum(-1) > 0).all()
    stats = summarize(out.stats)
    assert stats["tokens_per_expert"] == [8, 8, 0, 0] and stats["tokens_per_expert_after"] == [4, 4, 0, 0]
    assert stats["dropped_assignments"] == 8 and stats["drop_frac"] == 0.5 and stats["fully_dropped_frac"] == 0.5


def test_dropless_mode_drops_nothing_even_under_extreme_skew():
    layer = skewed_layer(capacity_factor=None)
    x = torch.rand(1, 8, D, dtype=torch.float64) + 0.1
    out = layer(x)
    stats = summarize(out.stats)
    assert stats["dropped_assignments"] == 0 and stats["tokens_per_expert_after"] == [8, 8, 0, 0]
    assert (out.output.abs().sum(-1) > 0).all()
    torch.testing.assert_close(out.output, reference_layer(layer, x))


def test_padding_is_never_routed_counted_or_part_of_the_losses():
    torch.manual_seed(0)
    layer = make_layer("swiglu", capacity_factor=None)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    out = layer(x, mask)
    real = layer(x[mask].unsqueeze(0))  # the 7 real tokens as one unpadded sequence
    assert int(out.stats.num_tokens) == 7
    assert torch.equal(out.stats.tokens_per_expert_before, real.stats.tokens_per_expert_before)
    assert int(out.stats.tokens_per_expert_before.sum()) == 7 * 2
    torch.testing.assert_close(out.output[mask], real.output[0])
    assert torch.equal(out.output[~mask], torch.zeros(5, D, dtype=torch.float64))
    torch.testing.assert_close(out.aux_loss, real.aux_loss)
    torch.testing.assert_close(out.z_loss, real.z_loss)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_an_all_padding_micro_batch_gives_zeros_and_empty_stats(capacity_factor):
    layer = make_layer("swiglu", capacity_factor=capacity_factor, num_shared_experts=1, aux_loss_scope="sequence")
    x = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)
    out = layer(x, torch.zeros(2, 3))
    (out.output.sum() + out.aux_loss + out.z_loss).backward()
    assert torch.equal(out.output, torch.zeros_like(x)) and out.aux_loss.item() == out.z_loss.item() == 0.0
    stats = summarize(out.stats)
    assert stats["tokens_per_expert"] == [0, 0, 0, 0] and stats["drop_frac"] == 0.0 and stats["entropy"] == 0.0


def test_padding_takes_no_capacity():
    layer = skewed_layer(capacity_factor=1.0)
    x = torch.rand(1, 8, D, dtype=torch.float64) + 0.1
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]])
    stats = summarize(layer(x, mask).stats)  # 4 real tokens: C = 2 per expert
    assert stats["tokens_per_expert"] == [4, 4, 0, 0] and stats["tokens_per_expert_after"] == [2, 2, 0, 0]


def test_eval_uses_the_eval_capacity_and_leaves_balancing_state_alone():
    layer = skewed_layer(capacity_factor=0.5, eval_capacity_factor=None, router=RouterConfig(bias_update_rate=0.1))
    x = torch.rand(1, 8, D, dtype=torch.float64) + 0.1
    assert summarize(layer(x).stats)["dropped_assignments"] > 0  # training: C = 2
    load, bias = layer.router.load_since_update.clone(), layer.router.expert_bias.clone()
    layer.eval()
    assert summarize(layer(x).stats)["dropped_assignments"] == 0  # eval: dropless
    assert torch.equal(layer.router.load_since_update, load) and torch.equal(layer.router.expert_bias, bias)
    layer.train()
    update_balancing_biases(torch.nn.Sequential(layer))  # only the training forward's loads count
    assert layer.router.expert_bias.tolist() == [-0.1, -0.1, 0.1, 0.1]


def test_eval_capacity_factor_applies_only_in_eval():
    layer = skewed_layer(capacity_factor=None, eval_capacity_factor=0.5)
    x = torch.rand(1, 8, D, dtype=torch.float64) + 0.1
    assert summarize(layer(x).stats)["dropped_assignments"] == 0
    assert summarize(layer.eval()(x).stats)["tokens_per_expert_after"] == [2, 2, 0, 0]


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_with_bias_balancing_the_aux_loss_counts_the_unbiased_top_k(score_fn: str):
    """DeepSeek-V3 / Megatron-Core: the bias steers which experts compute, but the balancing loss counts the experts
    the router itself prefers; counting the biased choice flattens the counts and starves the loss of gradient."""
    torch.manual_seed(0)
    router = RouterConfig(score_fn=score_fn, bias_update_rate=1e-3)
    layer = make_layer("gelu", capacity_factor=None, router=router, aux_loss_coef=1.0, z_loss_coef=0.0)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([-1.0, -1.0, 1.0, 1.0]))  # large enough to change choices
    x = torch.randn(4, 8, D, dtype=torch.float64)
    out = layer(x)
    route = layer.router(x.reshape(-1, D))
    unbiased_ids = route.probs_NE.topk(2, dim=-1).indices
    assert not torch.equal(route.topk_ids_NK.sort(-1).values, unbiased_ids.sort(-1).values), "the bias mattered"
    expected = load_balancing_loss(route.probs_NE, unbiased_ids, coef=1.0)
    torch.testing.assert_close(out.aux_loss, expected)
    # The statistics still report the experts that really computed (the biased choice).
    biased_counts = torch.bincount(route.topk_ids_NK.flatten(), minlength=4)
    assert out.stats.tokens_per_expert_before.tolist() == biased_counts.tolist()


def global_scope_loss_and_router_grad(rank: int, world_size: int, x, mask, state) -> tuple[torch.Tensor, torch.Tensor]:
    layer = make_layer("gelu", aux_loss_scope="global", aux_loss_coef=1.0, z_loss_coef=0.0)
    layer.load_state_dict(state)
    out = layer(x.chunk(world_size)[rank], mask.chunk(world_size)[rank])
    out.aux_loss.backward()
    return out.aux_loss.detach(), layer.router.weight.grad


@pytest.mark.slow
def test_global_scope_on_two_ranks_equals_one_process_on_the_concatenated_batch():
    """Megatron's global_aux_loss: counts pooled over data-parallel ranks. The ranks' mean loss and mean router
    gradient (what DDP averages) equal one process's on both ranks' micro-batches together; ranks hold unequal
    numbers of real tokens."""
    torch.manual_seed(0)
    layer = make_layer("gelu", aux_loss_scope="global", aux_loss_coef=1.0, z_loss_coef=0.0)
    x = torch.randn(4, 6, D, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[3, 2:] = 0  # rank 1 routes 8 real tokens, rank 0 twelve
    ranks = run_distributed(global_scope_loss_and_router_grad, 2, x, mask, layer.state_dict())
    pooled = layer(x, mask)
    pooled.aux_loss.backward()
    torch.testing.assert_close(torch.stack([loss for loss, _ in ranks]).mean(), pooled.aux_loss.detach())
    torch.testing.assert_close(torch.stack([grad for _, grad in ranks]).mean(dim=0), layer.router.weight.grad)
    # Balance per rank alone is a different objective, so the test above can tell the two apart.
    local = make_layer("gelu", aux_loss_coef=1.0, z_loss_coef=0.0)
    local.load_state_dict(layer.state_dict())
    per_rank = torch.stack([local(x[:2], mask[:2]).aux_loss, local(x[2:], mask[2:]).aux_loss]).mean()
    assert abs(per_rank.item() - pooled.aux_loss.item()) > 1e-6


def test_sequence_scope_balances_each_sequence_of_the_micro_batch():
    torch.manual_seed(0)
    layer = make_layer("gelu", aux_loss_scope="sequence")
    x = torch.randn(3, 5, D, dtype=torch.float64)
    per_sequence = torch.stack([layer(x[b : b + 1]).aux_loss for b in range(3)])
    torch.testing.assert_close(layer(x).aux_loss, per_sequence.mean())
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])  # sequence 1 is all padding
    expected = (layer(x[:1, :3]).aux_loss + layer(x[2:]).aux_loss) / 2
    torch.testing.assert_close(layer(x, mask).aux_loss, expected)


def test_router_entropy_statistic_is_log_e_for_a_uniform_router():
    layer = make_layer("gelu")
    with torch.no_grad():
        layer.router.weight.zero_()
    stats = summarize(layer(torch.randn(2, 3, D, dtype=torch.float64)).stats)
    assert stats["entropy"] == pytest.approx(math.log(4))


def test_summed_micro_batch_stats_equal_the_stats_of_the_whole_batch():
    torch.manual_seed(0)
    layer = make_layer("gelu", capacity_factor=None)
    x = torch.randn(4, 5, D, dtype=torch.float64)
    whole = layer(x).stats
    summed = layer(x[:2]).stats + layer(x[2:]).stats
    assert torch.equal(summed.tokens_per_expert_before, whole.tokens_per_expert_before)
    assert int(summed.num_micro_batches) == 2
    a, b = summarize(summed), summarize(whole)
    for key in ("tokens_per_expert", "drop_frac", "max_over_mean", "cv"):
        assert a[key] == b[key]
    assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
    # One vector for one all-reduce over ranks, and back.
    back = MoEStats.from_vector(summed.to_vector(), num_experts=4)
    assert summarize(back) == summarize(summed)


def test_per_layer_losses_are_returned_with_coefficients_applied_and_recorded_in_stats():
    torch.manual_seed(0)
    layer = make_layer("gelu", aux_loss_coef=0.5, z_loss_coef=0.25)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    out = layer(x)
    layer.config = dataclasses.replace(layer.config, aux_loss_coef=1.0, z_loss_coef=1.0)
    unit = layer(x)
    torch.testing.assert_close(out.aux_loss, 0.5 * unit.aux_loss)
    torch.testing.assert_close(out.z_loss, 0.25 * unit.z_loss)
    assert out.aux_loss.requires_grad and out.z_loss.requires_grad
    assert out.stats.aux_loss_sum.item() == pytest.approx(out.aux_loss.item())
    assert out.stats.z_loss_sum.item() == pytest.approx(out.z_loss.item())


def test_fused_shared_experts_equal_the_sum_of_separate_ffns():
    torch.manual_seed(0)
    layer = make_layer("swiglu", num_shared_experts=2)
    fused = layer.shared_experts
    x = torch.randn(5, D, dtype=torch.float64)
    total = torch.zeros_like(x)
    for s in range(2):
        ffn = FeedForward(D, 12, "swiglu").double()
        rows = slice(12 * s, 12 * (s + 1))
        with torch.no_grad():
            ffn.w_gate.weight.copy_(fused.w_gate.weight[rows])
            ffn.w_up.weight.copy_(fused.w_up.weight[rows])
            ffn.w_down.weight.copy_(fused.w_down.weight[:, rows])
        total += ffn(x)
    torch.testing.assert_close(fused(x), total)


def test_every_parameter_gets_a_gradient_and_the_router_learns_from_the_model_loss():
    torch.manual_seed(0)
    layer = make_layer("swiglu", num_shared_experts=1, aux_loss_coef=0.0, z_loss_coef=0.0)
    out = layer(torch.randn(2, 6, D, dtype=torch.float64))
    out.output.pow(2).sum().backward()  # no auxiliary loss: the router's gradient comes through the gates
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_weight_layout_and_init():
    layer = MoELayer(64, MoEConfig(num_experts=4, top_k=2, expert_d_ff=96), "swiglu", init_std=0.05)
    assert layer.router.weight.shape == (4, 64)
    assert layer.experts.w_gate.shape == layer.experts.w_up.shape == (4, 64, 96)
    assert layer.experts.w_down.shape == (4, 96, 64)
    for w in (layer.router.weight, layer.experts.w_up, layer.experts.w_down):
        assert abs(w.std().item() - 0.05) < 0.005
    assert MoELayer(64, MoEConfig(4, 2, 96), "gelu").experts.w_gate is None


def test_bf16_autocast_forward_and_backward_run_with_fp32_routing():
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(num_experts=4, top_k=2, expert_d_ff=12, capacity_factor=1.25), "swiglu")
    x = torch.randn(2, 6, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.aux_loss.dtype == out.z_loss.dtype == torch.float32
    (out.output.float().sum() + out.aux_loss + out.z_loss).backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.router.weight.grad).all()
