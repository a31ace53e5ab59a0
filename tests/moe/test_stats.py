"""Expert-load accounting: ratios come from raw counts, and the raw sums survive one all-reduce vector."""

import math

import pytest
import torch

from moe.stats import MoEStats, summarize


def stats_of(before, after, tokens, fully_dropped, entropy_sum, aux_sum, z_sum, micro_batches) -> MoEStats:
    return MoEStats(
        tokens_per_expert_before=torch.tensor(before),
        tokens_per_expert_after=torch.tensor(after),
        num_tokens=torch.tensor(tokens),
        fully_dropped_tokens=torch.tensor(fully_dropped),
        entropy_sum=torch.tensor(entropy_sum),
        aux_loss_sum=torch.tensor(aux_sum),
        z_loss_sum=torch.tensor(z_sum),
        num_micro_batches=torch.tensor(micro_batches),
    )


def test_summarize_computes_ratios_from_raw_counts():
    stats = stats_of([4, 2, 2, 0], [3, 2, 2, 0], 4, 1, 2.0, 0.03, 0.002, 2)
    s = summarize(stats)
    assert s["dropped_assignments"] == 1 and s["drop_frac"] == 1 / 8 and s["fully_dropped_frac"] == 1 / 4
    assert s["max_over_mean"] == 2.0
    assert s["cv"] == pytest.approx(math.sqrt(2) / 2)  # population std of [4, 2, 2, 0] is √2, mean 2
    assert s["entropy"] == 0.5
    assert s["aux_loss"] == pytest.approx(0.015) and s["z_loss"] == pytest.approx(0.001)


def test_sums_add_field_by_field_and_round_trip_through_one_vector():
    a = stats_of([4, 2, 2, 0], [3, 2, 2, 0], 4, 1, 2.0, 0.03, 0.002, 1)
    b = stats_of([1, 1, 3, 3], [1, 1, 3, 3], 4, 0, 1.5, 0.01, 0.004, 1)
    total = a + b
    assert total.tokens_per_expert_before.tolist() == [5, 3, 5, 3] and int(total.num_micro_batches) == 2
    back = MoEStats.from_vector(total.to_vector(), num_experts=4)
    assert back.tokens_per_expert_before.dtype == torch.int64
    assert summarize(back) == summarize(total)


def test_maxvio_utilisation_and_dead_experts_from_counts_before_capacity():
    # 8 assignments over 4 experts: ideal 2 each; capacity kept 7 of them, which the load metrics ignore.
    s = summarize(stats_of([4, 2, 2, 0], [3, 2, 2, 0], 4, 1, 2.0, 0.03, 0.002, 2))
    assert s["utilisation"] == [2.0, 1.0, 1.0, 0.0]
    assert s["maxvio"] == 1.0 == s["max_over_mean"] - 1  # (4 − 2) / 2
    assert s["dead_experts"] == 1


def test_even_load_collapse_and_no_tokens_are_the_extremes():
    even = summarize(stats_of([3, 3, 3, 3], [3, 3, 3, 3], 6, 0, 1.0, 0.0, 0.0, 1))
    assert even["maxvio"] == 0.0 and even["utilisation"] == [1.0] * 4 and even["dead_experts"] == 0
    # Every assignment on one expert (top-1): MaxVio is E − 1, the others are dead.
    collapsed = summarize(stats_of([12, 0, 0, 0], [12, 0, 0, 0], 12, 0, 0.0, 0.0, 0.0, 1))
    assert collapsed["maxvio"] == 3.0 and collapsed["utilisation"] == [4.0, 0.0, 0.0, 0.0]
    assert collapsed["dead_experts"] == 3
    assert sum(collapsed["utilisation"]) == 4  # utilisation averages to 1 whenever anything was routed
    empty = summarize(stats_of([0, 0, 0, 0], [0, 0, 0, 0], 0, 0, 0.0, 0.0, 0.0, 1))
    assert empty["maxvio"] == 0.0 and empty["utilisation"] == [0.0] * 4 and empty["dead_experts"] == 4


def test_dead_experts_count_over_the_summed_window():
    # Dead in one micro-batch is not dead in the window: counts are summed before the zeros are counted.
    a = stats_of([4, 0, 2, 0], [4, 0, 2, 0], 3, 0, 1.0, 0.0, 0.0, 1)
    b = stats_of([0, 3, 3, 0], [0, 3, 3, 0], 3, 0, 1.0, 0.0, 0.0, 1)
    assert summarize(a)["dead_experts"] == 2 and summarize(b)["dead_experts"] == 2
    assert summarize(a + b)["dead_experts"] == 1
