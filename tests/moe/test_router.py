"""Router: top-k selection rules against hand references, fp32 routing, jitter, and bias balancing state."""

import math

import pytest
import torch

from moe.moe_config import RouterConfig
from moe.moe_layer import step_balancing_biases
from moe.router import TopKRouter, balancing_probs, select_topk
from moe_platform.testing import run_distributed


def seed_logits() -> torch.Tensor:
    # The seeds' teaching router: probabilities 0.6, 0.3, 0.1 over three experts.
    return torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64).log()


def test_renormalised_top2_of_the_seed_example_is_two_thirds_one_third():
    ids, gates = select_topk(seed_logits(), top_k=2, renormalize=True)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(gates, torch.tensor([[2 / 3, 1 / 3]], dtype=torch.float64))


def test_without_renormalisation_the_gates_are_the_raw_probabilities():
    _, gates = select_topk(seed_logits(), top_k=2, renormalize=False)
    torch.testing.assert_close(gates, torch.tensor([[0.6, 0.3]], dtype=torch.float64))


def test_softmax_after_topk_equals_a_hand_reference_and_softmax_then_renormalise():
    logits = torch.randn(6, 5, dtype=torch.float64)
    ids, gates = select_topk(logits, top_k=2, softmax_after_topk=True)
    for n in range(6):
        row = logits[n].tolist()
        top = sorted(range(5), key=lambda e: -row[e])[:2]
        z = sum(math.exp(row[e]) for e in top)
        assert ids[n].tolist() == top
        assert gates[n].tolist() == pytest.approx([math.exp(row[e]) / z for e in top], rel=1e-12)
    ids_before, gates_before = select_topk(logits, top_k=2, renormalize=True)
    assert torch.equal(ids, ids_before)
    torch.testing.assert_close(gates, gates_before)


@pytest.mark.parametrize("renormalize", [False, True])
def test_sigmoid_scores_equal_a_hand_reference(renormalize):
    logits = torch.randn(6, 5, dtype=torch.float64)
    ids, gates = select_topk(logits, top_k=3, score_fn="sigmoid", renormalize=renormalize)
    for n in range(6):
        scores = [1 / (1 + math.exp(-v)) for v in logits[n].tolist()]
        top = sorted(range(5), key=lambda e: -scores[e])[:3]
        chosen = [scores[e] for e in top]
        expected = [s / sum(chosen) for s in chosen] if renormalize else chosen
        assert ids[n].tolist() == top
        assert gates[n].tolist() == pytest.approx(expected, rel=1e-12)


def test_balancing_probs_are_full_softmax_or_normalised_sigmoid():
    logits = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(balancing_probs(logits, "softmax"), logits.softmax(-1))
    sig = logits.sigmoid()
    torch.testing.assert_close(balancing_probs(logits, "sigmoid"), sig / sig.sum(-1, keepdim=True))


@pytest.mark.parametrize("score_fn, softmax_after_topk", [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_bias_changes_which_experts_are_selected_but_not_the_gate_values(score_fn, softmax_after_topk):
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    kwargs = dict(top_k=2, score_fn=score_fn, softmax_after_topk=softmax_after_topk, renormalize=False)
    if softmax_after_topk:
        kwargs["renormalize"] = True
    ids, gates = select_topk(logits, **kwargs)
    assert ids.tolist() == [[0, 1]]
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)  # pushes expert 3 to the top
    ids_b, gates_b = select_topk(logits, selection_bias_E=bias, **kwargs)
    assert ids_b.tolist() == [[3, 0]]
    # Gates of the biased selection are exactly what the unbiased rule gives for the same pair of experts.
    if score_fn == "sigmoid":
        expected = logits[0, [3, 0]].sigmoid()
    elif softmax_after_topk:
        expected = logits[0, [3, 0]].softmax(-1)
    else:
        expected = logits.softmax(-1)[0, [3, 0]]
    torch.testing.assert_close(gates_b[0], expected)


def test_router_weight_shape_and_init():
    router = TopKRouter(512, 8, 2, RouterConfig(), init_std=0.05)
    assert router.weight.shape == (8, 512)
    assert router.weight.mean().abs() < 0.01
    assert abs(router.weight.std().item() - 0.05) < 0.005
    assert [name for name, _ in router.named_buffers()] == []  # no balancing state unless asked for


def test_router_computes_in_fp32_under_bf16_autocast():
    router = TopKRouter(16, 4, 2, RouterConfig())
    x = torch.randn(10, 16).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x)
    assert out.logits_NE.dtype == out.gates_NK.dtype == out.probs_NE.dtype == torch.float32
    torch.testing.assert_close(out.logits_NE, x.float() @ router.weight.T)


def test_jitter_perturbs_routing_only_in_training():
    router = TopKRouter(16, 4, 2, RouterConfig(jitter_eps=0.5))
    x = torch.randn(10, 16)
    clean = x @ router.weight.T
    assert not torch.allclose(router(x).logits_NE, clean)
    router.eval()
    torch.testing.assert_close(router(x).logits_NE, clean)


def biased_router(rate: float = 0.01) -> TopKRouter:
    return TopKRouter(4, 4, 1, RouterConfig(renormalize_topk=False, bias_update_rate=rate))


def routed_to(expert_ids: list[int]) -> torch.Tensor:
    """Inputs that a router with identity weights sends to the given experts (top-1)."""
    return torch.nn.functional.one_hot(torch.tensor(expert_ids), 4).float()


def test_bias_update_is_one_signed_step_from_the_loads_of_all_micro_batches_since_the_last_call():
    router = biased_router(rate=0.01)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    router(routed_to([0, 0, 0, 1]))  # micro-batch 1
    router(routed_to([0, 1, 2, 2]))  # micro-batch 2: loads so far [4, 2, 2, 0], mean 2
    assert router.load_since_update.tolist() == [4, 2, 2, 0]
    assert router.expert_bias.tolist() == [0, 0, 0, 0]  # forwards never move the bias
    router.update_balancing_bias()
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.0, 0.0, 0.01]))
    assert router.load_since_update.tolist() == [0, 0, 0, 0]
    router.update_balancing_bias()  # nothing counted since: no step
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.0, 0.0, 0.01]))


def test_bias_moves_selection_towards_an_underloaded_expert():
    router = biased_router(rate=1.0)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    x = torch.tensor([[1.0, 0.0, 0.0, 0.9]])  # prefers expert 0 narrowly over expert 3
    router(torch.cat([x, x, x, routed_to([1])]))
    router.update_balancing_bias()  # expert 0 overloaded (-1), expert 3 idle (+1)
    out = router(x)
    assert out.topk_ids_NK.tolist() == [[3]]
    torch.testing.assert_close(out.gates_NK, torch.softmax(x, -1)[:, 3:])  # unbiased score of expert 3


def test_eval_forwards_leave_the_balancing_state_alone():
    router = biased_router()
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    router(routed_to([0, 1]))
    router.eval()
    router(routed_to([3, 3, 3, 3]))
    assert router.load_since_update.tolist() == [1, 1, 0, 0]
    router.update_balancing_bias()
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, -0.01, 0.01, 0.01]))


def test_balancing_state_is_in_the_state_dict_and_restores():
    router = biased_router()
    router(torch.randn(5, 4))
    router.update_balancing_bias()
    router(torch.randn(3, 4))
    state = router.state_dict()
    assert {"weight", "expert_bias", "load_since_update"} <= set(state)
    restored = biased_router()
    restored.load_state_dict(state)
    assert torch.equal(restored.expert_bias, router.expert_bias)
    assert torch.equal(restored.load_since_update, router.load_since_update)


def one_hot_router(num_experts: int, local_ids: list[int]) -> TopKRouter:
    """A top-1 router with identity weights that has counted `local_ids` in one training forward."""
    router = TopKRouter(num_experts, num_experts, 1, RouterConfig(renormalize_topk=False, bias_update_rate=0.01))
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
    router(torch.nn.functional.one_hot(torch.tensor(local_ids), num_experts).float())
    return router


def apply_one_bias_step_on_this_rank(rank: int, world_size: int) -> list[tuple[list[float], list[int]]]:
    """One router stepped alone, then three (of 4, 3 and 4 experts) stepped together by step_balancing_biases."""
    alone = one_hot_router(4, [[0, 0, 0, 1], [2, 2, 3, 3]][rank])  # summed over ranks: [3, 1, 2, 2], mean 2
    alone.update_balancing_bias()
    together = [
        one_hot_router(4, [[0, 0, 0, 1], [2, 2, 3, 3]][rank]),  # [3, 1, 2, 2]
        one_hot_router(3, [[0, 1, 1], [1, 1, 1]][rank]),  # [1, 5, 0], mean 2
        one_hot_router(4, [[3, 3], [3, 3]][rank]),  # [0, 0, 0, 4], mean 1
    ]
    step_balancing_biases(together)
    return [(router.expert_bias.tolist(), router.load_since_update.tolist()) for router in (alone, *together)]


@pytest.mark.slow
def test_data_parallel_ranks_apply_the_same_bias_step_from_the_summed_loads():
    """Alone or with every layer's counts in one all-reduce: each layer steps from its own loads summed over ranks."""
    expected = [[-0.01, 0.01, 0.0, 0.0], [-0.01, 0.01, 0.0, 0.0], [0.01, -0.01, 0.01], [0.01, 0.01, 0.01, -0.01]]
    for routers in run_distributed(apply_one_bias_step_on_this_rank, 2):
        for (bias, load), want in zip(routers, expected, strict=True):
            assert bias == pytest.approx(want) and load == [0] * len(want)


def test_balancing_bias_keeps_fp32_when_the_module_is_cast_to_bf16() -> None:
    """A bf16 engine casts every floating buffer; a 1e-3 step on a bias of 0.5 would then round away."""
    router = TopKRouter(8, 4, 2, RouterConfig(score_fn="sigmoid", bias_update_rate=1e-3))
    router.expert_bias.fill_(0.5)
    router.bfloat16()
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    router.load_since_update.copy_(torch.tensor([10, 0, 0, 0]))
    router.update_balancing_bias()
    assert router.expert_bias.tolist() == pytest.approx([0.499, 0.501, 0.501, 0.501], abs=1e-7)
    router.double()
    assert router.expert_bias.dtype == torch.float64, "promotion to fp64 (parity tests) is still allowed"


# ---- DeepSeek-V3's group-limited routing and routed scaling ------------------------------------------------------


def group_limited_reference(choice: list[float], top_k: int, n_group: int, topk_group: int) -> list[int]:
    """The rule written out for one token: score each group by the sum of its two best choice scores, keep the
    topk_group best groups, then the top_k best experts among those groups' experts."""
    size = len(choice) // n_group
    groups = [list(range(g * size, (g + 1) * size)) for g in range(n_group)]
    group_score = [sum(sorted((choice[e] for e in group), reverse=True)[:2]) for group in groups]
    kept_groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    candidates = [e for g in kept_groups for e in groups[g]]
    return sorted(candidates, key=lambda e: -choice[e])[:top_k]


@pytest.mark.parametrize("n_group, topk_group, top_k", [(4, 2, 3), (8, 3, 4), (2, 1, 2), (4, 4, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_group_limited_selection_equals_the_direct_reference(n_group, topk_group, top_k, with_bias):
    torch.manual_seed(n_group * 10 + topk_group)
    E = 16
    logits = torch.randn(200, E, dtype=torch.float64) * 2
    bias = torch.randn(E, dtype=torch.float64) * 0.3 if with_bias else None
    ids, gates = select_topk(
        logits, top_k=top_k, score_fn="sigmoid", renormalize=True, selection_bias_E=bias,
        n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
    )  # fmt: skip
    scores = logits.sigmoid()
    choice = scores + bias if with_bias else scores
    differs_from_plain_topk = 0
    for n in range(200):
        expected = group_limited_reference(choice[n].tolist(), top_k, n_group, topk_group)
        assert ids[n].tolist() == expected
        chosen = [scores[n, e].item() for e in expected]
        assert gates[n].tolist() == pytest.approx([2.5 * s / sum(chosen) for s in chosen], rel=1e-12)
        differs_from_plain_topk += set(expected) != set(choice[n].topk(top_k).indices.tolist())
    if topk_group < n_group:
        assert differs_from_plain_topk > 0, "the group limit never changed a choice: the test would be vacuous"
    else:
        assert differs_from_plain_topk == 0, "keeping every group is plain top-k"


def test_a_group_of_one_expert_is_scored_by_that_expert():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]], dtype=torch.float64)
    ids, _ = select_topk(logits, top_k=2, score_fn="sigmoid", n_group=4, topk_group=2)
    assert sorted(ids[0].tolist()) == [1, 3]


@pytest.mark.parametrize("renormalize", [False, True])
def test_routed_scaling_multiplies_the_final_gates_and_changes_no_choice(renormalize):
    logits = torch.randn(50, 8, dtype=torch.float64)
    ids, gates = select_topk(logits, top_k=3, score_fn="sigmoid", renormalize=renormalize)
    ids_s, gates_s = select_topk(
        logits, top_k=3, score_fn="sigmoid", renormalize=renormalize, routed_scaling_factor=2.5
    )
    assert torch.equal(ids, ids_s)
    torch.testing.assert_close(gates_s, 2.5 * gates, rtol=1e-15, atol=0)


def test_routed_scaling_scales_the_routed_output_not_the_shared_experts():
    from moe.moe_config import MoEConfig
    from moe.moe_layer import MoELayer

    def layer(scale: float) -> MoELayer:
        torch.manual_seed(3)
        router = RouterConfig(score_fn="sigmoid", routed_scaling_factor=scale)
        config = MoEConfig(num_experts=8, top_k=2, expert_d_ff=16, num_shared_experts=1, router=router)
        return MoELayer(12, config, "swiglu").double()

    x = torch.randn(2, 5, 12, dtype=torch.float64)
    plain, scaled = layer(1.0), layer(2.5)
    shared = plain.shared_experts(x)
    torch.testing.assert_close(
        scaled(x).output - shared, 2.5 * (plain(x).output - shared), **{"rtol": 1e-12, "atol": 1e-12}
    )


def test_the_router_limits_groups_for_the_balancing_count_too_and_keeps_gates_unbiased():
    """With the selection bias, the balancing loss counts the unbiased choice under the same group limit."""
    torch.manual_seed(5)
    config = RouterConfig(score_fn="sigmoid", bias_update_rate=1e-3, n_group=4, topk_group=2, routed_scaling_factor=2.0)
    router = TopKRouter(6, 8, 2, config).double()
    router.expert_bias.copy_(torch.randn(8, dtype=torch.float64))
    x = torch.randn(64, 6, dtype=torch.float64)
    out = router(x)
    scores = (x @ router.weight.T).sigmoid()
    for n in range(64):
        choice = (scores[n] + router.expert_bias).tolist()
        assert out.topk_ids_NK[n].tolist() == group_limited_reference(choice, 2, 4, 2)
        assert out.balance_ids_NK[n].tolist() == group_limited_reference(scores[n].tolist(), 2, 4, 2)
        chosen = scores[n, out.topk_ids_NK[n]]
        torch.testing.assert_close(out.gates_NK[n], 2.0 * chosen / chosen.sum())
