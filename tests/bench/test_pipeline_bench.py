"""bench/pipeline.py: its replay reproduces the 1F1B theory on ideal durations, and its quick run measures every
schedule on the same work (same first loss as the PP=1 loop) with idle shares that are shares."""

import pytest

from moe.stages import bubble_fraction


def one_f_one_b(stage: int, pp: int, m: int, forward: float, backward: float) -> list[tuple]:
    """torch's Schedule1F1B order for `stage`: min(m, PP - stage) forwards, then B, F alternating, then the rest."""
    warmup = min(m, pp - stage)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("B", i), ("F", warmup + i)]
    order += [("B", i) for i in range(m - warmup, m)]
    durations = {"F": forward, "B": backward}
    return [(kind, stage, i, 0.0, durations[kind], durations[kind]) for kind, i in order]


@pytest.mark.parametrize("pp", [2, 4])
def test_the_replay_of_ideal_1f1b_durations_gives_the_theory(load_bench, pp: int) -> None:
    bench, m = load_bench("pipeline"), 8
    step = [{"actions": one_f_one_b(s, pp, m, forward=1.0, backward=2.0)} for s in range(pp)]
    span, busy = bench.replay(step, pp)
    assert span == pytest.approx((m + pp - 1) * 3.0)
    idle = sum(1 - b / span for b in busy) / pp
    assert idle == pytest.approx(bubble_fraction("1f1b", pp, m))


def test_quick_run_measures_every_schedule_on_the_same_work(load_bench) -> None:
    bench = load_bench("pipeline")
    (result,) = bench.main(["--quick"])
    losses = result["first_loss"]
    assert set(losses) == {"1f1b", "interleaved_1f1b", "zbv", "pp1"}
    assert all(loss == pytest.approx(losses["pp1"], rel=1e-5) for loss in losses.values())
    for row in result["rows"]:
        virtual = 1 if row["schedule"] == "1f1b" else 2
        assert row["theory"] == bubble_fraction(row["schedule"], 2, bench.QUICK.microbatches, virtual)
        assert all(0 < idle < 1 for idle in row["idle"] + row["replayed"])
        assert all(0 <= share <= idle for share, idle in zip(row["p2p"], row["idle"], strict=True))
        assert row["stage_ms"] and len(row["stage_ms"]) == 2 * virtual
    assert result["pp1"]["step_ms"][0] > 0
