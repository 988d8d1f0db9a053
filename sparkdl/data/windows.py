"""An epoch's shuffled rows read from their file with sequential reads and writes only, a window at a time.

Reading one row of a file is one system call: about 1 µs a row here, and batching the calls (Linux
AIO, one call for a whole batch) measured the same, since the kernel's work per read is the cost.
Instead, the epoch's order is cut into *windows* of consecutive positions (``WINDOW_BYTES`` of rows
each, whole steps). One sequential pass over the file sends every row to its window's region of a
scratch file; a window is then read back in one read (its rows in file order) and put in the
epoch's order in memory, field by field, from where its steps are slices. That is a handful of
bulk copies a row instead of a system call (docs/benchmarks.md has the figures). Memory holds a
window and a block of the file, whatever the file's size. The caller's scratch file is emptied once
its last window is read, so that its pages are dropped from the page cache instead of being written
to disk (left dirty, an epoch's scratch pages were written back while training ran, competing with
it for the disk and for the kernel's dirty-page budget).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from sparkdl.data.read_ahead import Chunk

WINDOW_BYTES = 32 << 20  # rows put in order in memory at a time
BLOCK_BYTES = 16 << 20  # rows of the file sorted into windows at a time


def read_in_windows(
    fd: int, record: np.dtype, rows: int, order: np.ndarray, spans: list[tuple[int, int]], scratch: int
) -> Iterator[Chunk]:
    """The records at ``order[start:stop]`` for each span, a window's spans to a chunk.

    ``fd`` holds ``rows`` records; ``scratch`` is an open file these reads fill and empty again, one
    reading at a time. The spans must follow each other (each starts where the one before stopped) and
    ``order`` must not repeat a row within them, as an epoch's steps (``sparkdl.schedule.epoch_steps``) do.
    """
    windows = _windows(spans, max(1, WINDOW_BYTES // record.itemsize))
    first = spans[0][0]
    _sort_into_windows(fd, record, rows, order, windows, first, scratch)
    for window in windows:
        low, high = window[0][0], window[-1][1]
        in_order = _window_in_order(scratch, record, order[low:high], (low - first) * record.itemsize)
        if window is windows[-1]:
            os.ftruncate(scratch, 0)
        yield Chunk(in_order, [(start - low, stop - low) for start, stop in window])


def _windows(spans: list[tuple[int, int]], window_rows: int) -> list[list[tuple[int, int]]]:
    """The spans grouped into windows of whole spans, each of at least ``window_rows`` rows but the last."""
    windows: list[list[tuple[int, int]]] = [[]]
    for span in spans:
        if windows[-1] and windows[-1][-1][1] - windows[-1][0][0] >= window_rows:
            windows.append([])
        windows[-1].append(span)
    return windows


def _sort_into_windows(
    fd: int,
    record: np.dtype,
    rows: int,
    order: np.ndarray,
    windows: list[list[tuple[int, int]]],
    first: int,
    scratch: int,
) -> None:
    """One pass over the file: each row goes to its window's region of ``scratch``, in file order within it."""
    window_of = np.full(rows, -1, np.int32)  # -1: a row no span reads
    region_start = []
    for number, window in enumerate(windows):
        low, high = window[0][0], window[-1][1]
        window_of[order[low:high]] = number
        region_start.append(low - first)
    written = np.array(region_start, np.int64)  # rows written to each region so far
    block_rows = max(1, BLOCK_BYTES // record.itemsize)
    block = np.empty(block_rows, record)
    for start in range(0, rows, block_rows):
        part = block[: min(block_rows, rows - start)]
        read_into(fd, part, start * record.itemsize)
        destination = window_of[start : start + len(part)]
        by_window = np.argsort(destination, kind="stable")  # file order within each window
        skipped = int(np.count_nonzero(destination < 0))
        counts = np.bincount(destination[destination >= 0], minlength=len(windows))
        sorted_rows = part[by_window[skipped:]]
        offset = 0
        for target in np.flatnonzero(counts):
            count = int(counts[target])
            piece = sorted_rows[offset : offset + count].view(np.uint8).data
            _write_at(scratch, piece, int(written[target]) * record.itemsize)
            written[target] += count
            offset += count


def _window_in_order(scratch: int, record: np.dtype, window_order: np.ndarray, offset: int) -> dict[str, np.ndarray]:
    """A window's rows, read back from its region (in file order), as arrays by field in ``window_order``."""
    region = np.empty(len(window_order), record)
    read_into(scratch, region, offset)
    positions = np.argsort(window_order)  # the region's k-th row is window_order[positions[k]]
    in_order = {}
    for name in record.names or ():
        field = np.empty_like(region[name])  # fresh arrays: Keras may still hold the previous window's batches
        field[positions] = region[name]
        in_order[name] = field
    return in_order


def read_into(fd: int, array: np.ndarray, offset: int) -> None:
    """Fills ``array`` (C-contiguous) with the file's bytes from ``offset``."""
    view = array.view(np.uint8).data
    done = 0
    while done < len(view):  # a read may return less than asked (one over 2 GB does)
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise EOFError("sparkdl's spilled partition is shorter than the rows written to it")
        done += got


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
