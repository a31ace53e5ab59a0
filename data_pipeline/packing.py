"""Packing: documents (each ending in EOS) are concatenated and cut into windows of seq_len + 1 tokens.

Window i is tokens ``[i·w, (i+1)·w)`` of the concatenation, ``w = seq_len + 1``; the model reads
``input_ids = window[:-1]`` and ``labels = window[1:]``. Windows do not overlap, so the first token
of each window is never a label. The tail that does not fill a window (fewer than w tokens, at the
very end of the corpus, or of each epoch when streaming) is dropped and counted: for every corpus,
``num_windows · w + remainder == total tokens``. By default attention crosses document boundaries
(inside a window the model sees the previous document and the EOS that closes it); with
``data.document_mask`` the loader marks each token's document (``loader``) and the model keeps
attention inside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class TokenBuffer:
    """A token concatenation held as consecutive chunks (e.g. zero-copy views of memory-mapped Arrow
    record batches) with random access to packed windows, so a corpus is never copied into one array."""

    def __init__(self, chunks: list[np.ndarray]):
        self.chunks = [c for c in chunks if len(c) > 0]
        self.starts = np.concatenate([[0], np.cumsum([len(c) for c in self.chunks], dtype=np.int64)])
        self.num_tokens = int(self.starts[-1])

    def num_windows(self, width: int) -> int:
        return self.num_tokens // width

    def remainder(self, width: int) -> int:
        """Tokens dropped at the end because they do not fill a window."""
        return self.num_tokens - self.num_windows(width) * width

    def windows(self, ids: np.ndarray, width: int) -> np.ndarray:
        """Windows ``ids`` (shape [n]) as an array of shape [n, width]."""
        if len(self.chunks) == 1:  # one contiguous array: a single vectorized gather
            return self.chunks[0][ids[:, None] * width + np.arange(width)]
        dtype = self.chunks[0].dtype if self.chunks else np.uint16
        out = np.empty((len(ids), width), dtype=dtype)
        for row, window_id in enumerate(ids):
            out[row] = self._span(int(window_id) * width, width)
        return out

    def _span(self, start: int, length: int) -> np.ndarray:
        chunk = int(np.searchsorted(self.starts, start, side="right")) - 1
        offset = start - int(self.starts[chunk])
        if offset + length <= len(self.chunks[chunk]):
            return self.chunks[chunk][offset : offset + length]
        pieces, need = [], length
        while need > 0:
            piece = self.chunks[chunk][offset : offset + need]
            pieces.append(piece)
            need -= len(piece)
            chunk, offset = chunk + 1, 0
        return np.concatenate(pieces)


def pack_stream(token_batches: Iterable[np.ndarray], width: int) -> Iterator[np.ndarray]:
    """Cut a stream of token arrays (whole documents with EOS, in order) into blocks of windows [n, width].

    Yields the same windows as ``TokenBuffer`` would over the concatenation; the final remainder is dropped.
    """
    carry = np.zeros(0, dtype=np.uint16)
    for batch in token_batches:
        tokens = np.concatenate([carry, batch]) if len(carry) else batch
        n = len(tokens) // width
        if n:
            yield tokens[: n * width].reshape(n, width)
        carry = tokens[n * width :]
