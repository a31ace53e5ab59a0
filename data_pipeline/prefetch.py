"""Prefetch: the next micro-batches are built in a background thread while the current step trains.

Building a batch is reading windows (memory-mapped shards, Arrow buffers or a stream) and a few numpy gathers;
most of it releases the GIL, so one thread hides it behind the step. The order cannot change: the thread runs the
same generator the loader would run itself, and the loader counts a micro-batch as consumed when the training loop
takes it, not when the thread has built it (loader.TrainLoader.samples_consumed), so a checkpoint never counts a
batch that was only prefetched.

An error in the thread (bad data met while streaming) is raised in the training loop at the batch it belongs to.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")
_POLL_S = 0.1  # how often a blocked thread looks whether its consumer has gone


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()


class Prefetched(Iterator[T]):
    """`items`, produced up to `depth` ahead by a daemon thread; `close()` (or dropping it) stops the thread."""

    def __init__(self, items: Iterator[T], depth: int):
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(items,), name="moe-data-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                if not self._put(item):
                    return
        except BaseException as err:  # handed to the consumer, raised where the batch was expected
            self._put(_Failed(err))
            return
        self._put(_DONE)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> T:
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)  # later calls end too
            raise StopIteration
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()

    def __del__(self) -> None:
        self.close()
