"""The global sample sequence and how one rank's micro-batches are cut from it.

Global sequence. Packed samples form one infinite sequence: position p lies in epoch ``p // N``
(N packed samples per epoch). Map-style corpora put sample ``perm_e[p % N]`` at position p, where
``perm_e`` is a permutation drawn from ``SeedSequence([seed, epoch])``; epochs follow each other
without a gap, so a global batch may straddle two epochs and nothing is dropped at an epoch end.
Streaming corpora put the stream's k-th packed window of epoch e at the k-th position of that epoch
(the stream is read in file order through a seeded document shuffle buffer, see ``hf_source``).
Either way the sequence is a pure function of (data, seed): it depends on neither world size,
micro-batch size, nor ``num_proc``, and the state needed to resume is one integer, the number of
global samples consumed.

Slicing (``BatchLayout``). Global step g owns positions ``[g·G, (g+1)·G)``. Rank r of W owns the
contiguous block ``[r·G/W, (r+1)·G/W)`` of it, and its micro-batch j (of a = G/(W·m)) is
``[j·m, (j+1)·m)`` of that block. Concatenating all ranks' micro-batches in (rank, micro) order
gives back the global batch, so the samples in a step are the same for any (W, m, a) with
G = m·a·W.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

from data_pipeline.errors import DataError
from data_pipeline.packing import TokenBuffer, pack_stream


@dataclass(frozen=True)
class BatchLayout:
    """Rank ``rank`` of ``world_size`` takes micro-batches of ``micro_batch_size`` from each global batch."""

    global_batch_size: int
    world_size: int
    rank: int
    micro_batch_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1")
        per_step = self.micro_batch_size * self.world_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size*world_size="
                f"{self.micro_batch_size}*{self.world_size}: change micro_batch_size or global_batch_size"
            )

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per rank per global step."""
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def micro_batch_start(self, step: int, micro: int) -> int:
        """First global position of micro-batch ``micro`` of this rank in global step ``step``."""
        per_rank = self.global_batch_size // self.world_size
        return step * self.global_batch_size + self.rank * per_rank + micro * self.micro_batch_size


class SampleSequence(Protocol):
    """The global sample sequence; ``read`` returns (sample_ids [n], windows [n, seq_len+1])."""

    num_samples: Optional[int]  # per epoch; None while unknown (streaming)

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]: ...


class IndexedSamples:
    """Map-style: random access to packed windows, in a fresh seeded permutation every epoch (or in order)."""

    def __init__(self, tokens: TokenBuffer, width: int, seed: int, shuffle: bool = True):
        self.tokens = tokens
        self.width = width
        self.seed = seed
        self.shuffle = shuffle
        self.num_samples = tokens.num_windows(width)
        self._permutations: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        """Sample ids in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a step straddles at most two epochs
                self._permutations.pop(min(self._permutations))
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            self._permutations[epoch] = rng.permutation(self.num_samples)
        return self._permutations[epoch]

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        positions = np.arange(start, start + count)
        epochs, index = np.divmod(positions, self.num_samples)
        ids = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            ids[in_epoch] = self.permutation(int(epoch))[index[in_epoch]]
        return ids, self.tokens.windows(ids, self.width)


class StreamedSamples:
    """Streaming: windows are read forward; going back (e.g. after ``load_state_dict``) restarts the
    stream at epoch 0 and skips forward, re-reading (and re-tokenizing) what it skips."""

    def __init__(self, open_epoch: Callable[[int], Iterator[np.ndarray]], width: int, where: str):
        self.open_epoch = open_epoch  # epoch -> token batches (documents with EOS) in that epoch's order
        self.width = width
        self.where = where
        self.num_samples: Optional[int] = None  # known once the first epoch has been read to its end
        self._restart()

    def _restart(self) -> None:
        self._blocks = self._all_epochs()
        self._block = np.zeros((0, self.width), dtype=np.uint16)
        self._block_ids = np.zeros(0, dtype=np.int64)
        self._position = 0  # global position of self._block[0]

    def _all_epochs(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        epoch = 0
        while True:
            index = 0
            for block in pack_stream(self.open_epoch(epoch), self.width):
                yield np.arange(index, index + len(block)), block
                index += len(block)
            if index == 0:
                raise DataError(f"{self.where} holds no complete packed sample of seq_len+1={self.width} tokens")
            self.num_samples = index
            epoch += 1

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        if start < self._position:
            self._restart()
        ids, windows = [], []
        while count > 0:
            offset = start - self._position
            if offset >= len(self._block):  # skip or finish this block, fetch the next
                self._position += len(self._block)
                self._block_ids, self._block = next(self._blocks)
                continue
            take = min(count, len(self._block) - offset)
            ids.append(self._block_ids[offset : offset + take])
            windows.append(self._block[offset : offset + take])
            start, count = start + take, count - take
        return np.concatenate(ids), np.concatenate(windows)
