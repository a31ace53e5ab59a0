"""bench/trainer_overhead.py compares like with like: its bare loop trains exactly what `moe-train` trains."""

import argparse

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


def test_the_bare_fsdp_loop_with_experts_split_computes_the_trainers_losses(load_bench) -> None:
    """2 ranks over torchrun, as the bench launches both: FSDP2 with EP=2 (the fsdp_ep row)."""
    bench = load_bench("trainer_overhead")
    args = argparse.Namespace(warmup=2, steps=4, log_every=1, threads=1, overrides=TINY)
    records = bench.run_trainer(args, "fsdp_ep")
    bare = bench.run_bare(args, "fsdp_ep")["loss_per_step"]
    assert bare == pytest.approx([r["loss"] for r in records], rel=1e-5)
