"""The GPU check's runs and its one table (bench/gpu_check.sh installs, then calls this).

    1. pytest -m gpu tests/gpu     every CUDA branch against its CPU/fp32 reference (tests/gpu/test_cuda_paths.py)
    2. bench/gpu_mfu.py            the ~1.1B-total MoE and its dense twin in bf16: tokens/s, MFU, peak vs ledger
    3. bench/gpu_experts.py        one MoE layer's grouped_mm against the loop over experts: the speed-up

Each step has its own time limit and the check goes on past a failed one; the table lists every check with
passed / FAILED / skipped and its figures, and the goals (issue 27): all GPU tests pass, MoE MFU ≥ 45% of the
datasheet peak, grouped_mm faster than the loop, measured peak memory within 20% of the ledger. Exit 0 only when
no check failed. `--cpu-smoke` runs the same steps on CPU (MOE_GPU_SMOKE=1, the benches' tiny configurations),
so the check is known to work before GPU time is spent; there the MFU and speed-up goals are not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MFU_GOAL, PEAK_TOLERANCE = 0.45, 0.20


@dataclass
class Check:
    name: str
    status: str  # passed, FAILED, skipped
    figures: str = ""


def run_step(command: list[str], env: dict, timeout: float, log: Path) -> tuple[bool, float]:
    """One step as a subprocess, its output to `log`; (whether it exited 0 within `timeout`, seconds taken)."""
    start = time.monotonic()
    with open(log, "w") as sink:
        try:
            code = subprocess.run(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout)
            ok = code.returncode == 0
        except subprocess.TimeoutExpired:
            sink.write(f"\n{' '.join(command)}: timed out after {timeout:.0f} s\n")
            ok = False
    return ok, time.monotonic() - start


def test_checks(junit: Path) -> list[Check]:
    """Each test case of the junit report: passed, FAILED (with the first line of why) or skipped (with why)."""
    if not junit.is_file():
        return [Check("pytest -m gpu", "FAILED", "no report written (see pytest.log)")]
    checks = []
    for case in ElementTree.parse(junit).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            checks.append(Check(name, "FAILED", (failure.get("message") or "").splitlines()[0][:100]))
        elif skipped is not None:
            checks.append(Check(name, "skipped", (skipped.get("message") or "")[:100]))
        else:
            checks.append(Check(name, "passed", f"{float(case.get('time', 0)):.1f} s"))
    return checks


def mfu_checks(results: list[dict], judge_mfu: bool) -> list[Check]:
    checks = []
    for r in results:
        ratio = r["peak_gib"] / r["predicted_gib"]
        mfu = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU - (no datasheet peak)"
        unit, scale = ("GiB", 1) if r["predicted_gib"] >= 0.1 else ("MiB", 1024)  # the smoke run's models are MiBs
        figures = (f"{r['tokens_per_s']:,.0f} tok/s, {mfu}, peak {r['peak_gib'] * scale:.2f} {unit} vs ledger "
                   f"{r['predicted_gib'] * scale:.2f} {unit} ({ratio - 1:+.0%})")  # fmt: skip
        ok = abs(ratio - 1) <= PEAK_TOLERANCE
        if judge_mfu and r["name"] == "moe":
            ok = ok and r["mfu"] is not None and r["mfu"] >= MFU_GOAL
        checks.append(Check(f"gpu_mfu {r['name']}", "passed" if ok else "FAILED", figures))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="the same steps on CPU, in about a minute")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_check", help="logs and JSON go here")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments (e.g. -k to rerun a few tests)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.cpu_smoke:
        env.update(MOE_GPU_SMOKE="1", CUDA_VISIBLE_DEVICES="")
    py = sys.executable
    tiny = ["--tiny"] if args.cpu_smoke else []
    junit, mfu_json, experts_json = args.out / "gpu_tests.xml", args.out / "mfu.json", args.out / "experts.json"
    for stale in (junit, mfu_json, experts_json):
        stale.unlink(missing_ok=True)
    pytest = [py, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
              *args.pytest_args.split()]  # fmt: skip
    mfu = [py, "bench/gpu_mfu.py", *tiny, *(["--dtype", "fp32"] if args.cpu_smoke else []), "--json", str(mfu_json)]
    experts = [py, "bench/gpu_experts.py", *tiny, "--json", str(experts_json)]
    steps = {"pytest": (pytest, 420), "gpu_mfu": (mfu, 240), "gpu_experts": (experts, 120)}
    took = {}
    for name, (command, limit) in steps.items():
        ok, seconds = run_step(command, env, limit, args.out / f"{name}.log")
        took[name] = (ok, seconds)

    checks = test_checks(junit)
    if mfu_json.is_file():
        checks += mfu_checks(json.loads(mfu_json.read_text()), judge_mfu=not args.cpu_smoke)
    else:
        checks.append(Check("gpu_mfu", "FAILED", f"no results (see {args.out / 'gpu_mfu.log'})"))
    if experts_json.is_file():
        result = json.loads(experts_json.read_text())
        faster = result["speedup"] > 1 or args.cpu_smoke
        checks.append(Check(
            "grouped_mm vs loop", "passed" if faster else "FAILED",
            f"{result['speedup']:.2f}x on {result['device']} ({result['dtype']}; grouped "
            f"{result['median_s']['grouped_mm'] * 1e3:.2f} ms, loop {result['median_s']['loop'] * 1e3:.2f} ms)",
        ))  # fmt: skip
    else:
        checks.append(Check("grouped_mm vs loop", "FAILED", f"no result (see {args.out / 'gpu_experts.log'})"))

    device = "CPU smoke run" if args.cpu_smoke else _device_name()
    print(f"GPU check on {device}: " + ", ".join(f"{n} {s:.0f} s" for n, (_, s) in took.items()))
    width = max(len(c.name) for c in checks)
    for check in checks:
        print(f"  {check.name:<{width}}  {check.status:<7}  {check.figures}")
    failed = [c for c in checks if c.status == "FAILED"]
    print(
        f"{len(checks) - len(failed)} of {len(checks)} checks passed or skipped; {len(failed)} FAILED; "
        f"logs in {args.out}"
    )
    return 1 if failed else 0


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "a machine without CUDA"


if __name__ == "__main__":
    sys.exit(main())
