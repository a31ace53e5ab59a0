"""Errors for bad input data: always say which file or row, and what to change."""

from __future__ import annotations


class DataConfigError(ValueError):
    """A data config that cannot work (a field out of range, fields that contradict each other); one sentence
    naming the field and the fix. Separate from DataError so callers can tell a user's mistake from a bug."""


class DataError(ValueError):
    """The input data cannot be turned into token batches; the message names the file/row and a fix."""


class BadRowError(DataError):
    """A single row is unusable; raised inside tokenization, where only the dataset row index is known.

    The caller maps ``row`` back to a file and row within it (see ``hf_source``) and re-raises a
    ``DataError`` naming both. ``args`` holds exactly the constructor arguments so the error pickles
    across ``datasets.map(num_proc=...)`` worker processes.
    """

    def __init__(self, row: int, problem: str):
        super().__init__(row, problem)
        self.row = row
        self.problem = problem

    def __str__(self) -> str:
        return f"row {self.row}: {self.problem}"
