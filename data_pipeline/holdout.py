"""Deterministic train/validation carving of documents.

A document is held out for validation when a 64-bit hash of it, read as a number in [0, 1), is below
``fraction``. The hash depends only on the document, never on row order, shuffling, ``num_proc``,
world size or streaming, so the same documents are held out in every mode and on every rank.

- Text corpora hash the document's UTF-8 bytes: duplicated documents land on the same side, so a
  duplicate can never leak from train into validation.
- The synthetic corpus hashes the document index (its documents are generated, not stored).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

_MANTISSA = 2**53  # the top 53 bits of the hash give an exactly representable float in [0, 1)


def holdout_mask_from_index(doc_index: np.ndarray, fraction: float) -> np.ndarray:
    """Boolean mask, True where document ``doc_index[i]`` belongs to validation (splitmix64 of the index)."""
    z = doc_index.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)) < np.uint64(int(fraction * _MANTISSA))


def holdout_mask_from_bytes(documents: Iterable[bytes | memoryview], fraction: float) -> np.ndarray:
    """Boolean mask, True where the document (its UTF-8 bytes) belongs to validation (blake2b-64)."""
    return holdout_mask_from_keys(holdout_keys_from_bytes(documents), fraction)


def holdout_keys_from_bytes(documents: Iterable[bytes | memoryview]) -> np.ndarray:
    """Each document's 64-bit hash key (blake2b-64 of its UTF-8 bytes, little-endian), as uint64: what a prepared
    corpus stores per document (``shards``), so that its carving needs no text."""
    return np.array(
        [int.from_bytes(hashlib.blake2b(doc, digest_size=8).digest(), "little") for doc in documents], dtype=np.uint64
    )


def holdout_mask_from_keys(keys: np.ndarray, fraction: float) -> np.ndarray:
    """Boolean mask, True where the document of hash key ``keys[i]`` belongs to validation: its top 53 bits, read
    as a number in [0, 1), are below ``fraction``."""
    return (keys >> np.uint64(11)) < np.uint64(int(fraction * _MANTISSA))
