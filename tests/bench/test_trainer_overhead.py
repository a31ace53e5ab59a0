"""bench/trainer_overhead.py compares like with like: its bare loop trains exactly what `moe-train` trains."""

import argparse
from pathlib import Path

import pytest
import torch

TINY = [
    "data.synthetic.num_tokens=131072",
    "data.seq_len=32",
    "data.global_batch_size=8",
    "trainer.micro_batch_size=2",  # 4 micro-batches per step: the accumulation path too
    "data.val.max_batches=1",
]


def test_the_bare_loop_computes_the_trainers_losses_step_for_step(load_bench, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("trainer_overhead")
    args = argparse.Namespace(bare="single", out=None, warmup=2, steps=4, log_every=2, threads=1, overrides=TINY)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    records = bench.run_trainer(argparse.Namespace(**{**vars(args), "log_every": 1}), "single")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the trainer's process ran: one thread keeps a loaded 2-core machine fast
    try:
        bare = bench.bare_loop(args)
    finally:
        torch.set_num_threads(threads)
    # Same model, batches, optimizer, schedule, clipping and bias updates: the same losses (up to the rounding
    # that another thread count may bring).
    assert [r["step"] for r in records] == list(range(1, 7))
    assert bare == pytest.approx([r["loss"] for r in records], rel=1e-5)
    # The stamps the timing reads: one per log, in order.
    assert all(seconds > 0 for seconds in bench.seconds_per_step(records, [2, 4, 6]))


@pytest.mark.parametrize(
    "mode",
    [
        "fsdp_ep",  # FSDP2 with the experts split over both ranks (EP=2)
        "zero3",  # ZeRO-3's partitioned build and engine steps; the zero1/zero2 rows take its path with another stage
    ],
)
def test_the_bare_loops_over_torchrun_compute_the_trainers_losses(
    load_bench, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 ranks over torchrun, as the bench launches both. Neither JIT-compiles a DeepSpeed op: its CPU backend's
    shared-memory all-reduce (~45 s of C++ on 2 cores, in every new environment) serves inference alone."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    bench = load_bench("trainer_overhead")
    # 3 steps: each launch is mostly start-up (torchrun, imports, the engine: ~10 s), a step ~1 s more on 2 cores
    args = argparse.Namespace(warmup=1, steps=2, log_every=1, threads=1, overrides=TINY)
    records = bench.run_trainer(args, mode)
    bare = bench.run_bare(args, mode)["loss_per_step"]
    assert bare == pytest.approx([r["loss"] for r in records], rel=1e-5)
    built = sorted(p.name for p in (tmp_path / "torch_extensions").rglob("*.so"))
    assert built == [], f"the runs compiled {built}"


def test_the_ablation_switches_each_addition_off_in_its_own_windows_and_times_the_rest(load_bench) -> None:
    """One process: every variant gets one window per cycle; a window with an addition off never enters it, and
    with everything on each addition's calls (and the log) take measurable time."""
    bench = load_bench("trainer_overhead")
    ablation = load_bench("trainer_ablation")
    args = argparse.Namespace(warmup=2, log_every=1, cycles=2, threads=1, overrides=TINY)
    args.steps = args.log_every * len(ablation.VARIANTS) * args.cycles
    windows = bench.run_ablation(args, "single")
    assert [w["variant"] for w in windows] == ablation.schedule(args.cycles)
    n = len(ablation.VARIANTS)
    for cycle in (ablation.schedule(3)[i : i + n] for i in range(0, 3 * n, n)):
        assert sorted(cycle) == sorted(ablation.VARIANTS)
    for window in windows:
        off = ablation.switched_off(window["variant"])
        timed = set(window["inside_s_per_step"]) - {"window", "log"}
        assert timed == set(ablation.ADDITIONS) - off, window
        assert window["s_per_step"] > 0 and window["inside_s_per_step"]["log"] > 0
        assert window["inside_s_per_step"]["window"] > 0
    assert set(bench.by_variant(windows)) >= {*ablation.VARIANTS, "inside:log"}
