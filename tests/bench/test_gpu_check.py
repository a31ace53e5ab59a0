"""bench/gpu_check.sh --cpu-smoke: the prepared GPU check runs its every step on CPU (the GPU tests with
MOE_GPU_SMOKE=1, the benches' tiny configurations) and prints one table in which every check passed, so the script
is known to work before any GPU time is spent."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_cpu_smoke_run_passes_every_check_and_prints_the_table(tmp_path: Path) -> None:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)}
    env["OMP_NUM_THREADS"] = "1"  # beside make test's other worker: two intra-op threads would spin on a shared core
    result = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu-smoke", "--out", str(tmp_path)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("GPU check on CPU smoke run: pytest ")
    rows = {line.split()[0]: line for line in lines[1:-1]}
    tests = [name for name in rows if name.startswith("test_cuda_paths::")]
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/gpu"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    cases = [line.split("/")[-1].replace(".py", "") for line in collected.splitlines() if "::" in line]
    assert sorted(tests) == sorted(cases) and cases, (tests, cases)  # every case of tests/gpu is in the table
    for name in tests:
        expected = "skipped" if "compiled" in name else "passed"  # inductor on CPU is another test's
        assert rows[name].split()[1] == expected, rows[name]
    benches = {"gpu_mfu moe": "passed", "gpu_mfu dense": "passed", "grouped_mm vs loop": "passed"}
    assert {name: next(line[len(f"  {name}") :].split()[0] for line in lines if line.startswith(f"  {name} "))
            for name in benches} == benches  # fmt: skip
    assert re.fullmatch(r"\d+ of \d+ checks passed or skipped; 0 FAILED; logs in .*", lines[-1]), lines[-1]


def test_a_missing_wheel_directory_is_refused_in_one_sentence(tmp_path: Path) -> None:
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--wheels", str(tmp_path / "none")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gpu_check.sh: --wheels {tmp_path / 'none'} is not a directory: build it with bench/gpu_wheels.sh"
    )
