"""What each speed/memory option of `moe-train` costs or saves, measured side by side on the same run.

Every row is the real `moe-train` (single process, CPU) on the same model, data and steps, with one option changed
from the baseline (no activation checkpointing, eager blocks, AdamW "auto" = fused on CPU, plain causal attention):

    activation_checkpointing=moe|full   recompute MoE layers / whole blocks in backward (moe/checkpointing.py)
    compile=true                        torch.compile of each block (its first windows, which compile, are skipped)
    optim.implementation=foreach|for_loop   the other AdamW kernels
    data.document_mask=true             block-diagonal causal attention inside packed windows

Time per step comes from the trainer's own metrics.jsonl: tokens/s of the log windows after the first `--skip`
(which hold start-up and compilation); eval and checkpoints are off. Peak memory is the run's own end-of-run
"peak memory" line where the trainer prints one. The rounds are interleaved (round r runs every row once), so load
from other processes hits every row alike; the table prints the median over rounds and the spread (min-max) of
each row's step time relative to the baseline's in the same round.

    .venv/bin/python bench/trainer_options.py                   # moe_tiny, seq 256, 3 rounds
    .venv/bin/python bench/trainer_options.py --rounds 1 --steps 6 --log-every 2 --skip 1 --no-compile   # quick
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_platform.testing import BIN, subprocess_env  # noqa: E402

ROWS = {
    "baseline": [],
    "activation_checkpointing=moe": ["trainer.activation_checkpointing=moe"],
    "activation_checkpointing=full": ["trainer.activation_checkpointing=full"],
    "compile=true": ["trainer.compile=true"],
    "adamw foreach": ["optim.implementation=foreach"],
    "adamw for_loop": ["optim.implementation=for_loop"],
    "document_mask=true": ["data.document_mask=true"],
}
PEAK = re.compile(r"peak memory[^\n]*?measured\s+([\d.,]+)\s*(KB|MB|GB|KiB|MiB|GiB)", re.IGNORECASE)
UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def run_row(overrides: list[str], args: argparse.Namespace, run_dir: Path) -> tuple[float, float | None]:
    """(seconds per step after the skipped windows, measured peak bytes or None) of one `moe-train` run."""
    command = [
        str(BIN / "moe-train"), f"model={args.model}", f"data.seq_len={args.seq_len}",
        f"data.global_batch_size={args.global_batch}", f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.max_steps={args.steps}", f"trainer.log_every={args.log_every}", "trainer.eval_every=0",
        "trainer.save_final=false", "logging.progress_bar=false", f"hydra.run.dir={run_dir}", *overrides,
    ]  # fmt: skip
    env = {**subprocess_env(), "OMP_NUM_THREADS": str(args.threads)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][args.skip :]
    if not rates:
        raise SystemExit(f"no log window left after skipping {args.skip}: raise --steps")
    tokens_per_step = args.global_batch * args.seq_len
    # Each window has the same number of steps, so the mean step time is the mean of per-window step times.
    seconds_per_step = statistics.mean(tokens_per_step / rate for rate in rates)
    match = PEAK.search(result.stdout + result.stderr)
    peak = float(match.group(1).replace(",", "")) * UNITS[match.group(2)] if match else None
    return seconds_per_step, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="moe_tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--skip", type=int, default=2, help="log windows to skip (start-up, compilation)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compile row (minutes on CPU)")
    args = parser.parse_args()

    rows = {name: o for name, o in ROWS.items() if not (args.no_compile and name == "compile=true")}
    times: dict[str, list[float]] = {name: [] for name in rows}
    peaks: dict[str, list[float]] = {name: [] for name in rows}
    with tempfile.TemporaryDirectory(prefix="trainer_options_") as tmp:
        for round_idx in range(args.rounds):
            for name, overrides in rows.items():
                seconds, peak = run_row(overrides, args, Path(tmp) / f"round{round_idx}_row{list(rows).index(name)}")
                times[name].append(seconds)
                if peak is not None:
                    peaks[name].append(peak)
                print(f"  round {round_idx + 1}: {name:<32s} {1e3 * seconds:8.1f} ms/step", flush=True)

    print(
        f"\nmodel={args.model} seq_len={args.seq_len} global batch {args.global_batch} (micro {args.micro_batch}), "
        f"{args.steps} steps, windows of {args.log_every} after skipping {args.skip}, {args.threads} threads, "
        f"{args.rounds} rounds"
    )
    print(f"  {'option':<32s} {'ms/step':>9s} {'vs baseline (median, min-max)':>32s} {'peak memory':>14s}")
    for name in rows:
        ratios = [t / b for t, b in zip(times[name], times["baseline"], strict=True)]
        peak = f"{statistics.median(peaks[name]) / 2**20:,.0f} MiB" if peaks[name] else "-"
        print(
            f"  {name:<32s} {1e3 * statistics.median(times[name]):9.1f} "
            f"{statistics.median(ratios):14.3f} ({min(ratios):.3f}-{max(ratios):.3f}) {peak:>14s}"
        )


if __name__ == "__main__":
    main()
