"""Dispatch: the capacity formula, which assignments each drop policy keeps, and sparse dispatch vs a slow loop."""

import pytest
import torch

from moe.dispatch import combine, dispatch, expert_capacity, plan_dispatch
from moe.experts import GroupedExperts


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, capacity_factor, min_capacity, expected",
    [
        (8, 4, 1, 1.0, 0, 2),  # the seeds' Switch example: 8 tokens, 4 experts, factor 1 -> 2 slots each
        (4096, 8, 2, 1.25, 4, 1280),  # the benchmark shape
        (10, 2, 2, 1.1, 0, 11),  # 2·1.1·10/2 is 11 exactly, not ceil(11.000000000000002)
        (10, 3, 1, 1.0, 0, 4),  # ceil(3.33)
        (100, 8, 2, 0.5, 0, 13),  # ceil(12.5)
        (3, 8, 2, 1.0, 4, 4),  # the floor wins for tiny batches
        (0, 8, 2, 1.0, 0, 0),
    ],
)
def test_capacity_formula(num_tokens, num_experts, top_k, capacity_factor, min_capacity, expected):
    capacity = expert_capacity(
        num_tokens, num_experts=num_experts, top_k=top_k, capacity_factor=capacity_factor, min_capacity=min_capacity
    )
    assert capacity == expected


def test_seed_overflow_example_keeps_the_first_two_of_four_tokens_on_one_expert():
    # 8 tokens, 4 experts, factor 1 -> C = 2; tokens 0, 2, 5, 7 all choose expert 1.
    topk_ids = torch.tensor([[1], [0], [1], [2], [3], [1], [0], [1]])
    plan = plan_dispatch(topk_ids, torch.ones(8, 1), num_experts=4, capacity=2)
    assert plan.tokens_per_expert_before_E.tolist() == [2, 4, 1, 1]
    assert plan.tokens_per_expert_after_E.tolist() == [2, 2, 1, 1]
    assert plan.token_ids_A.tolist() == [1, 6, 0, 2, 3, 4]  # grouped by expert; tokens 5 and 7 overflow
    assert plan.slot_NK[5].item() == plan.slot_NK[7].item() == 6  # both point at the zero row


def random_routing(num_tokens=40, num_experts=5, top_k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] += 1.0  # skew towards expert 0 so that capacity bites
    gates, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return ids, gates


def kept_by_expert(plan, top_k):
    """{expert: [flat assignment ids kept, in slice order]} read back from a plan."""
    out, start = {}, 0
    for e, count in enumerate(plan.tokens_per_expert_after_E.tolist()):
        out[e] = plan.assignment_ids_A[start : start + count].tolist()
        start += count
    return out


def test_position_policy_keeps_each_experts_earliest_tokens():
    ids, gates = random_routing()
    capacity = 9
    plan = plan_dispatch(ids, gates, num_experts=5, capacity=capacity, drop_policy="position")
    flat_ids = ids.reshape(-1).tolist()
    for e, kept in kept_by_expert(plan, 2).items():
        routed = [a for a, expert in enumerate(flat_ids) if expert == e]
        assert kept == routed[:capacity]
    assert plan.tokens_per_expert_before_E[0] > capacity  # the test exercises a drop


def test_probs_policy_keeps_each_experts_highest_gates():
    ids, gates = random_routing()
    capacity = 9
    plan = plan_dispatch(ids, gates, num_experts=5, capacity=capacity, drop_policy="probs")
    flat_ids, flat_gates = ids.reshape(-1).tolist(), gates.reshape(-1).tolist()
    for e, kept in kept_by_expert(plan, 2).items():
        routed = [a for a, expert in enumerate(flat_ids) if expert == e]
        best = sorted(routed, key=lambda a: -flat_gates[a])[:capacity]
        assert sorted(kept) == sorted(best)
    assert plan.tokens_per_expert_before_E[0] > capacity


def test_choice_policy_keeps_first_choices_before_second_choices():
    ids, gates = random_routing()
    capacity = 9
    plan = plan_dispatch(ids, gates, num_experts=5, capacity=capacity, drop_policy="choice")
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1).tolist()
    for e, kept in kept_by_expert(plan, top_k).items():
        routed = [a for a, expert in enumerate(flat_ids) if expert == e]
        by_choice = sorted(routed, key=lambda a: (a % top_k, a // top_k))  # k first, then token
        assert kept == by_choice[:capacity]
    assert plan.tokens_per_expert_before_E[0] > capacity
    # Expert 0 is the skewed favourite: its first choices alone fill it, so every 2nd choice of it is dropped.
    assert all(a % top_k == 0 for a in kept_by_expert(plan, top_k)[0])


def test_dropless_plan_keeps_every_assignment_once():
    ids, gates = random_routing()
    plan = plan_dispatch(ids, gates, num_experts=5, capacity=None)
    assert torch.equal(plan.tokens_per_expert_after_E, plan.tokens_per_expert_before_E)
    assert sorted(plan.assignment_ids_A.tolist()) == list(range(80))
    assert torch.equal(plan.slot_NK.reshape(-1)[plan.assignment_ids_A], torch.arange(80))


def reference_moe(x_ND, ids, gates, experts, kept_assignments):
    """Slow per-token loop: out_n = Σ_k gate · Expert_e(x_n) over the kept (n, k) only."""
    out = torch.zeros_like(x_ND)
    for n in range(x_ND.shape[0]):
        for k in range(ids.shape[1]):
            if n * ids.shape[1] + k not in kept_assignments:
                continue
            e = ids[n, k].item()
            x = x_ND[n]
            if experts.activation == "swiglu":
                h = torch.nn.functional.silu(x @ experts.w_gate[e]) * (x @ experts.w_up[e])
            else:
                h = torch.nn.functional.gelu(x @ experts.w_up[e])
            out[n] += gates[n, k] * (h @ experts.w_down[e])
    return out


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("capacity, policy", [(None, "position"), (9, "position"), (9, "probs"), (9, "choice")])
def test_sparse_dispatch_equals_a_per_token_loop(activation, capacity, policy):
    ids, gates = random_routing()
    experts = GroupedExperts(8, 12, 5, activation, init_std=0.3).double()
    x = torch.randn(40, 8, dtype=torch.float64)
    gates = gates.double()
    plan = plan_dispatch(ids, gates, num_experts=5, capacity=capacity, drop_policy=policy)
    out = combine(experts(dispatch(x, plan), plan.tokens_per_expert_after_E.tolist()), gates, plan)
    expected = reference_moe(x, ids, gates, experts, set(plan.assignment_ids_A.tolist()))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("capacity", [None, 3])
def test_dispatch_and_combine_gradients_pass_gradcheck(capacity):
    ids, gates = random_routing(num_tokens=10, num_experts=4)
    plan = plan_dispatch(ids, gates, num_experts=4, capacity=capacity)
    if capacity is not None:
        assert plan.assignment_ids_A.numel() < 20  # some assignments dropped: the zero-row path is checked
    x = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(plan.assignment_ids_A.numel(), 3, dtype=torch.float64, requires_grad=True)
    g = gates.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: dispatch(x, plan), (x,))
    assert torch.autograd.gradcheck(lambda y, g: combine(y, g, plan), (y, g))


def test_grouped_experts_skip_idle_experts_and_give_them_zero_gradient():
    experts = GroupedExperts(4, 6, 3, "swiglu")
    x = torch.randn(5, 4)
    experts(x, [2, 0, 3]).sum().backward()
    assert experts.w_up.grad[1].abs().sum() == 0
    assert experts.w_up.grad[0].abs().sum() > 0 and experts.w_up.grad[2].abs().sum() > 0
