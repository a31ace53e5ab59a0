"""bench/alibi_length.py in its quick mode: ALiBi (and RoPE, its comparison) trained at L and evaluated at 2L give a
finite loss on the positions past the training length. Nothing about its size is claimed (seed 001: no unlimited
context); the real run's numbers are in the bench's output."""

import math

import torch


def test_alibi_at_twice_the_training_length_stays_finite(load_bench) -> None:
    threads = torch.get_num_threads()
    try:
        results = load_bench("alibi_length").main(["--quick", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert set(results) == {"alibi", "rope"}
    for name, rows in results.items():
        assert len(rows) == 1, name
        for inside, beyond in rows:
            assert math.isfinite(inside) and math.isfinite(beyond), (name, inside, beyond)
