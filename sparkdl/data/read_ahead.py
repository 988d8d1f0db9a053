"""Reading beside training: a thread prepares the next chunk of rows while Keras trains on the one before.

A reader hands an epoch's rows over in *chunks*: arrays by field holding some consecutive steps, and
each step's span of them (one step of a small partition; a whole window of a large one,
``sparkdl.data.windows``). Reading a window (sorting the file into windows first, once an epoch)
is bulk work that mostly runs outside the GIL, in system calls and numpy copies, so a thread does
it while the training step runs: a worker's reading no longer stops its training, and in sync mode
no longer keeps the other ranks waiting at the next allreduce. The thread keeps at most ``DEPTH``
chunks ready beside the one being built, so memory stays bounded by a few chunks.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import cast

import numpy as np

DEPTH = 1  # chunks ready ahead of the one training reads from
_POLL_SECONDS = 0.5  # how often a blocked side checks that the other is still there


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Consecutive steps' rows: one ``(rows, *shape)`` array per field, and each step's ``(start, stop)`` in them."""

    arrays: dict[str, np.ndarray]
    steps: list[tuple[int, int]]

    def step_arrays(self) -> Iterator[dict[str, np.ndarray]]:
        """Each step's rows, one array per field (views of the chunk's arrays)."""
        for start, stop in self.steps:
            yield {name: array[start:stop] for name, array in self.arrays.items()}


def read_ahead(chunks: Iterable[Chunk], depth: int = DEPTH) -> Iterator[Chunk]:
    """``chunks``, made by a thread that runs up to ``depth`` chunks ahead of the caller.

    An error in the thread is raised here, at the chunk it would have made. Closing the returned
    generator (or dropping it) stops the thread at its next chunk and closes ``chunks``, so a
    reader's ``finally`` (its scratch file's lock, for one) runs in the thread that used it.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    thread = threading.Thread(target=_make, args=(iter(chunks), ready, stop), name="sparkdl-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item = _next_ready(ready, thread)
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield cast(Chunk, item)
    finally:
        stop.set()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


def _make(chunks: Iterator[Chunk], ready: queue.Queue, stop: threading.Event) -> None:
    try:
        for chunk in chunks:
            if not _hand_over(ready, chunk, stop):
                return
        _hand_over(ready, _END, stop)
    except BaseException as error:  # raised to the caller, where training can report it
        _hand_over(ready, _Failed(error), stop)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _hand_over(ready: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Puts ``item`` once there is room; False if the caller stopped reading first."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=_POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def _next_ready(ready: queue.Queue, thread: threading.Thread) -> object:
    while True:
        try:
            return ready.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            if not thread.is_alive() and ready.empty():
                raise RuntimeError("sparkdl's read-ahead thread ended without handing over its rows") from None
