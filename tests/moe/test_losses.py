"""Balancing loss and router z-loss against their formulas."""

import math

import pytest
import torch

from moe.losses import global_load_balancing_loss, load_balancing_loss, router_z_loss


def round_robin_ids(num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """Token n picks experts n·K .. n·K+K-1 (mod E): every expert gets exactly K·N/E assignments."""
    return (torch.arange(num_tokens)[:, None] * top_k + torch.arange(top_k)) % num_experts


def test_perfectly_balanced_routing_gives_exactly_the_coefficient():
    N, E, K = 8, 4, 2
    ids = round_robin_ids(N, E, K)
    uniform = torch.full((N, E), 1 / E, dtype=torch.float64)
    assert load_balancing_loss(uniform, ids, coef=0.01).item() == 0.01
    assert load_balancing_loss(uniform.float(), ids, coef=0.01) == torch.tensor(0.01)  # fp32: the same, rounded
    # Balance needs only equal per-expert totals, not uniform rows: each token splits its mass over its picks.
    peaked = torch.zeros(N, E, dtype=torch.float64).scatter_(1, ids, 0.5)
    assert load_balancing_loss(peaked, ids, coef=0.01).item() == 0.01


def test_balancing_loss_equals_the_formula_by_hand():
    N, E, K = 6, 3, 2
    probs = torch.randn(N, E, dtype=torch.float64).softmax(-1)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [2, 0], [0, 1]])
    counts = [sum(int(e == i) for e in ids.reshape(-1).tolist()) for i in range(E)]
    mass = [sum(probs[t, i].item() for t in range(N)) for i in range(E)]
    expected = 0.1 * E / (K * N**2) * sum(mass[i] * counts[i] for i in range(E))
    assert load_balancing_loss(probs, ids, coef=0.1).item() == pytest.approx(expected, rel=1e-12)


def test_balancing_loss_gradient_flows_through_p_only_with_counts_as_constants():
    N, E, K = 6, 4, 2
    probs = torch.randn(N, E, dtype=torch.float64).softmax(-1).requires_grad_()
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0], [2, 0], [0, 1]])
    load_balancing_loss(probs, ids, coef=0.1).backward()
    counts = torch.bincount(ids.reshape(-1), minlength=E).double()
    # dL/dp_ti = coef · E/(K·N²) · c_i for every token t: c enters as a constant weight, nothing else.
    torch.testing.assert_close(probs.grad, (0.1 * E / (K * N**2) * counts).expand(N, E))

    logits = torch.randn(N, E, dtype=torch.float64, requires_grad=True)
    load_balancing_loss(logits.softmax(-1), ids, coef=0.1).backward()
    (expected,) = torch.autograd.grad((logits.softmax(-1) * (0.1 * E / (K * N**2) * counts)).sum(), logits)
    torch.testing.assert_close(logits.grad, expected)


def test_sequence_scope_is_the_mean_of_each_sequences_own_loss():
    E = 4
    # Sequence 0 uses only experts 0 and 1, sequence 1 only 2 and 3: balanced as a micro-batch, not per sequence.
    ids = torch.tensor([[0, 1]] * 4 + [[2, 3]] * 4)
    probs = torch.zeros(8, E).scatter_(1, ids, 0.5)
    groups = torch.tensor([0] * 4 + [1] * 4)
    micro_batch = load_balancing_loss(probs, ids, coef=1.0)
    per_sequence = load_balancing_loss(probs, ids, coef=1.0, group_ids_N=groups, num_groups=2)
    assert micro_batch.item() == 1.0
    seq0 = load_balancing_loss(probs[:4], ids[:4], coef=1.0)
    seq1 = load_balancing_loss(probs[4:], ids[4:], coef=1.0)
    assert per_sequence.item() == pytest.approx((seq0.item() + seq1.item()) / 2)
    assert per_sequence.item() == 2.0  # each sequence loads half the experts: twice the balanced value


def test_sequence_scope_skips_empty_sequences_and_counts_each_with_its_own_length():
    probs = torch.randn(5, 3, dtype=torch.float64).softmax(-1)
    ids = probs.topk(2, dim=-1).indices
    groups = torch.tensor([0, 0, 0, 2, 2])  # group 1 is all padding
    loss = load_balancing_loss(probs, ids, coef=1.0, group_ids_N=groups, num_groups=3)
    parts = [load_balancing_loss(probs[:3], ids[:3], coef=1.0), load_balancing_loss(probs[3:], ids[3:], coef=1.0)]
    assert loss.item() == pytest.approx(sum(p.item() for p in parts) / 2, rel=1e-12)


def test_z_loss_equals_the_formula_by_hand():
    logits = torch.randn(5, 4, dtype=torch.float64) * 3
    expected = 0.001 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 5
    assert router_z_loss(logits, coef=0.001).item() == pytest.approx(expected, rel=1e-12)


def test_losses_of_an_empty_micro_batch_are_zero():
    probs, ids = torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.long)
    assert load_balancing_loss(probs, ids, coef=0.01).item() == 0.0
    assert router_z_loss(torch.zeros(0, 4), coef=0.001).item() == 0.0


def test_global_scope_without_a_process_group_is_the_micro_batch_loss():
    probs = torch.softmax(torch.randn(10, 4, dtype=torch.float64), dim=-1)
    ids = probs.topk(2, dim=-1).indices
    torch.testing.assert_close(
        global_load_balancing_loss(probs, ids, coef=0.1), load_balancing_loss(probs, ids, coef=0.1)
    )
