"""Two kinds of randomness, two seeds.

  * Initial weights must be identical on every rank: data-parallel replicas start from one model. They are drawn
    after `seed_initial_weights(seed)`, the same call on every rank.
  * Noise (dropout masks, router jitter) must differ per rank: with one seed everywhere every rank draws the same
    mask for different tokens, which correlates the replicas' noise instead of averaging it. After the model is
    built, `seed_noise_streams(seed, rank)` gives each rank its own stream, derived from (seed, rank) by NumPy's
    SeedSequence so streams of neighbouring seeds and ranks do not overlap.
Accelerate checkpoints every rank's generator state (random_states_{rank}.pkl), so a resumed run continues each
rank's own stream.
"""

import numpy as np
from accelerate.utils import set_seed


def seed_initial_weights(seed: int) -> None:
    """Python, NumPy and torch (CPU and every GPU) generators at `seed`: the same weights on every rank."""
    set_seed(seed)


def noise_seed(seed: int, rank: int) -> int:
    """A 32-bit seed of its own for each (seed, rank)."""
    return int(np.random.SeedSequence(entropy=seed, spawn_key=(rank,)).generate_state(1)[0])


def seed_noise_streams(seed: int, rank: int) -> None:
    """Every generator at this rank's noise seed: dropout and router jitter differ between ranks."""
    set_seed(noise_seed(seed, rank))
