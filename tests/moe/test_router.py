"""Router: top-k selection rules against hand references, fp32 routing, jitter, and bias balancing state."""

import math

import pytest
import torch

from moe.moe_config import RouterConfig
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


def apply_one_bias_step_on_this_rank(rank: int, world_size: int) -> tuple[list[float], list[int]]:
    router = TopKRouter(4, 4, 1, RouterConfig(renormalize_topk=False, bias_update_rate=0.01))
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    local = [[0, 0, 0, 1], [2, 2, 3, 3]][rank]  # summed over ranks: loads [3, 1, 2, 2], mean 2
    router(torch.nn.functional.one_hot(torch.tensor(local), 4).float())
    router.update_balancing_bias()
    return router.expert_bias.tolist(), router.load_since_update.tolist()


@pytest.mark.slow
def test_data_parallel_ranks_apply_the_same_bias_step_from_the_summed_loads():
    for bias, load in run_distributed(apply_one_bias_step_on_this_rank, 2):
        assert bias == pytest.approx([-0.01, 0.01, 0.0, 0.0]) and load == [0, 0, 0, 0]


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
