"""What each rank holds under every strategy at 4 ranks, measured by the trainer, against the ledger's figure.

    .venv/bin/python bench/memory_per_rank.py                       # moe_tiny, fp32, every layout below
    .venv/bin/python bench/memory_per_rank.py --layouts fsdp,fsdp_ep2 -- trainer.precision=bf16

Each layout is one real `moe-train` run of two steps on 4 gloo ranks (torchrun on 127.0.0.1). Its first metrics
record carries, per rank, the bytes of parameters, master weights, gradients and AdamW state the rank really holds
(monitor/footprint.py: local shards of DTensors, DeepSpeed's partitions, the base optimizer's state), beside the
ledger's figure for that rank (moe.ledger). Printed: per layout and figure, the measured bytes of the rank holding
the most, the ledger's, and their ratio (goal: within 10%). Byte counts do not depend on the machine's load, so one
run per layout is enough: there is no spread to report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ itself, whose data_pipeline.py would shadow the package
RANKS = 4
LAYOUTS = {
    "ddp": ["distributed=ddp"],
    "zero1": ["distributed=zero1"],
    "zero2": ["distributed=zero2"],
    "zero3": ["distributed=zero3"],
    "fsdp": ["distributed=fsdp"],
    "hsdp": ["distributed=hsdp"],
    "ddp_ep2": ["distributed=ddp", "distributed.expert_parallel_size=2"],
    "zero2_ep2": ["distributed=zero2", "distributed.expert_parallel_size=2"],
    "fsdp_ep2": ["distributed=fsdp", "distributed.expert_parallel_size=2"],
    "fsdp_ep4": ["distributed=fsdp", "distributed.expert_parallel_size=4"],
    "hsdp_ep2": ["distributed=hsdp", "distributed.expert_parallel_size=2"],
}
FIGURES = ("param_bytes", "master_bytes", "grad_bytes", "optimizer_state_bytes")


def first_record(layout: list[str], extra: list[str]) -> dict:
    from moe_platform.testing import launched_records

    run = [
        *layout, "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0", "trainer.save_final=false",
        "logging.progress_bar=false", "logging.peak_memory=false", "data.global_batch_size=16",
        "trainer.micro_batch_size=2", "data.seq_len=64", *extra,
    ]  # fmt: skip
    return launched_records(RANKS, run, prefix="bench_memory_")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (after --)")
    args = parser.parse_args()
    print(f"bytes per rank at {RANKS} ranks (the rank holding the most), measured / ledger; goal within 10%")
    print(f"{'layout':10s} " + " ".join(f"{name:>34s}" for name in FIGURES))
    for name in args.layouts.split(","):
        record = first_record(LAYOUTS[name], args.overrides)
        cells = []
        for figure in FIGURES:
            measured = max(record[f"memory/{figure}_per_rank"])
            ledger = record[f"ledger/{figure}_per_rank"]
            ratio = f"{measured / ledger:.3f}" if ledger else ("—" if not measured else "inf")
            cells.append(f"{measured / 2**20:9.3f} / {ledger / 2**20:9.3f} MiB {ratio:>6s}")
        print(f"{name:10s} " + " ".join(f"{cell:>34s}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
