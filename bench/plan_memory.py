"""The planner's peak memory per rank (plan/memory.py) against the measured peak of real runs, every rank.

    .venv/bin/python bench/plan_memory.py                         # moe_tiny, fp32, the whole grid below
    .venv/bin/python bench/plan_memory.py --layouts ddp4,fsdp4_ep2 -- trainer.precision=bf16

Each layout is one real `moe-train` run of three steps on 2-8 gloo ranks (torchrun on 127.0.0.1) with
logging.peak_memory=true: the trainer measures every rank's second step (monitor/peak_memory.py: on CPU the bytes
Python-reachable tensors hold at its start + the highest running sum of the allocator's records under
torch.profiler) and writes, in the record of that step, each rank's measured peak beside the planner's prediction for
that rank (`memory/peak_bytes_per_rank`, `plan/peak_bytes_per_rank`). Printed per layout: the worst rank's measured
peak, its prediction and their ratio, and the largest |predicted / measured - 1| over all ranks (goal: within 10%).
Byte counts do not depend on the machine's load, so one run per layout is enough (there is no spread to report;
routing, and with it EP's received tokens, is seeded).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ itself, whose data_pipeline.py would shadow the package
EP2 = "distributed.expert_parallel_size=2"
PP2 = "distributed.pipeline_parallel_size=2"
SCHEDULE = "distributed.pipeline.schedule"
# name: (ranks, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "ddp2": (2, ["distributed=ddp"]),
    "ddp4": (4, ["distributed=ddp"]),
    "zero1_4": (4, ["distributed=zero1"]),
    "zero2_4": (4, ["distributed=zero2"]),
    "zero3_4": (4, ["distributed=zero3"]),
    "zero2_8": (8, ["distributed=zero2"]),
    "fsdp2": (2, ["distributed=fsdp"]),
    "fsdp4": (4, ["distributed=fsdp"]),
    "fsdp8": (8, ["distributed=fsdp"]),
    "hsdp4": (4, ["distributed=hsdp"]),
    "ddp4_ep2": (4, ["distributed=ddp", EP2]),
    "ddp4_ep4": (4, ["distributed=ddp", "distributed.expert_parallel_size=4"]),
    "zero1_4_ep2": (4, ["distributed=zero1", EP2]),
    "zero2_4_ep2": (4, ["distributed=zero2", EP2]),
    "fsdp4_ep2": (4, ["distributed=fsdp", EP2]),
    "fsdp4_ep4": (4, ["distributed=fsdp", "distributed.expert_parallel_size=4"]),
    "hsdp4_ep2": (4, ["distributed=hsdp", EP2]),
    "fsdp8_ep4": (8, ["distributed=fsdp", "distributed.expert_parallel_size=4"]),
    "ddp2_pp2_1f1b": (2, ["distributed=ddp", PP2]),
    "ddp4_pp2_1f1b": (4, ["distributed=ddp", PP2]),
    "ddp4_pp4_gpipe": (4, ["distributed=ddp", "distributed.pipeline_parallel_size=4", f"{SCHEDULE}=gpipe"]),
    "ddp4_pp2_interleaved": (4, ["distributed=ddp", PP2, f"{SCHEDULE}=interleaved_1f1b"]),
    "ddp4_pp2_zbv": (4, ["distributed=ddp", PP2, f"{SCHEDULE}=zbv"]),
    "fsdp4_pp2_1f1b": (4, ["distributed=fsdp", PP2]),
    "fsdp4_pp2_ep2": (4, ["distributed=fsdp", PP2, EP2]),
    "ddp4_pp2_ep2": (4, ["distributed=ddp", PP2, EP2]),
    "ddp4_ckpt_moe": (4, ["distributed=ddp", "trainer.activation_checkpointing=moe"]),
    "ddp4_ckpt_full": (4, ["distributed=ddp", "trainer.activation_checkpointing=full"]),
    "zero2_4_ckpt_full": (4, ["distributed=zero2", "trainer.activation_checkpointing=full"]),
    "fsdp4_ckpt_moe": (4, ["distributed=fsdp", "trainer.activation_checkpointing=moe"]),
    "fsdp4_ep2_ckpt_full": (4, ["distributed=fsdp", EP2, "trainer.activation_checkpointing=full"]),
    "ddp4_pp2_ckpt_full": (4, ["distributed=ddp", PP2, "trainer.activation_checkpointing=full"]),
}  # fmt: skip
# Every run: moe_tiny on the synthetic corpus, 16 rows of 64 tokens per step, micro-batches of 2.
RUN = [
    "model=moe_tiny", "data=synthetic", "data.synthetic.num_tokens=131072", "data.seq_len=64",
    "data.global_batch_size=16", "trainer.micro_batch_size=2", "trainer.max_steps=3", "trainer.log_every=1",
    "trainer.eval_every=0", "trainer.save_final=false", "logging.progress_bar=false", "logging.peak_memory=true",
]  # fmt: skip


def measured_record(ranks: int, layout: list[str], extra: list[str]) -> dict:
    """The metrics record that carries the measured peaks (the measured step's, step 2)."""
    from moe_platform.testing import launched_records

    records = launched_records(ranks, [*RUN, *layout, *extra], prefix="bench_plan_memory_")
    return next(record for record in records if "memory/peak_bytes_per_rank" in record)


def compare(record: dict) -> tuple[int, float, float, float]:
    """(worst measured rank, its measured bytes, its predicted bytes, max |predicted / measured - 1| over ranks)."""
    measured, predicted = record["memory/peak_bytes_per_rank"], record["plan/peak_bytes_per_rank"]
    worst = max(range(len(measured)), key=measured.__getitem__)
    error = max(abs(p / m - 1) for m, p in zip(measured, predicted, strict=True))
    return worst, measured[worst], predicted[worst], error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    parser.add_argument("--per-rank", action="store_true", help="also print every rank's measured and predicted MiB")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (after --)")
    args = parser.parse_args()
    print("peak bytes per rank, one training step (the second), measured vs plan/memory.py; goal within 10%")
    print(f"| {'layout':22s} | ranks | worst rank | measured MiB | predicted MiB | pred/meas | max err |")
    print(f"|{'-' * 24}|-------|------------|--------------|---------------|-----------|---------|")
    for name in args.layouts.split(","):
        ranks, layout = LAYOUTS[name]
        record = measured_record(ranks, layout, args.overrides)
        worst, measured, predicted, error = compare(record)
        print(
            f"| {name:22s} | {ranks:5d} | {worst:10d} | {measured / 2**20:12.2f} | {predicted / 2**20:13.2f} | "
            f"{predicted / measured:9.3f} | {error:7.1%} |",
            flush=True,
        )
        if args.per_rank:
            pairs = zip(record["memory/peak_bytes_per_rank"], record["plan/peak_bytes_per_rank"], strict=True)
            print("    " + "  ".join(f"{m / 2**20:.2f}/{p / 2**20:.2f}" for m, p in pairs), flush=True)


if __name__ == "__main__":
    main()
