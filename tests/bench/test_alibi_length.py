"""bench/alibi_length.py in its quick mode: ALiBi (and RoPE, its comparison) trained at L and evaluated at 2L give a
finite loss on the positions past the training length. Nothing about its size is claimed (seed 001: no unlimited
context); the real run's numbers are in the bench's output."""

import importlib.util
import math
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "alibi_length.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("alibi_length", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_alibi_at_twice_the_training_length_stays_finite() -> None:
    threads = torch.get_num_threads()
    try:
        results = load_bench().main(["--quick", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert set(results) == {"alibi", "rope"}
    for name, rows in results.items():
        assert len(rows) == 1, name
        for inside, beyond in rows:
            assert math.isfinite(inside) and math.isfinite(beyond), (name, inside, beyond)
