"""Strings beside a partition's fixed-size records: their UTF-8 bytes in a file of their own, each value a span of it.

A worker spills its partition as fixed-size records (``sparkdl.data.spill``), and strings have no fixed size.
So a string field's place in a record holds, for each of its values, a span ``(start, length)`` of the *text
file*, where the values' bytes are written back to back as Arrow hands them over (no Python object per value
while the partition streams in). Reading rows turns their spans back into values: ``bytes`` objects holding
exactly the UTF-8 bytes Spark had (nothing is decoded or re-encoded), which Keras receives as a ``tf.string``
tensor. The text file is as private as the rows' file: owner-only in the partition's 0700 directory,
unlinked once opened for reading; it is memory-mapped up to the same size as the rows' file, and read with
one ``pread`` per value beyond that, so that a worker's memory holds only the strings being read.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import weakref

import numpy as np
import pyarrow as pa

SPAN = 2  # a value's (start, length) in the text file: two int64 in its record


def binary_parts(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A string or binary column's value boundaries (int64, one more than its values, from 0) and bytes, without a
    copy of the bytes."""
    if len(column) == 0:
        return np.zeros(1, np.int64), np.empty(0, np.uint8)
    large = pa.types.is_large_binary(column.type) or pa.types.is_large_string(column.type)
    offsets = np.frombuffer(column.buffers()[1], np.int64 if large else np.int32)
    offsets = offsets[column.offset : column.offset + len(column) + 1].astype(np.int64)
    start, stop = int(offsets[0]), int(offsets[-1])
    data = column.buffers()[2]
    values = np.frombuffer(data, np.uint8)[start:stop] if data is not None else np.empty(0, np.uint8)
    return offsets - start, values


@dataclasses.dataclass(frozen=True)
class TextValues:
    """One Arrow batch's strings of a field, row-major, as Arrow holds them: value boundaries and UTF-8 bytes."""

    offsets: np.ndarray  # int64, one more than the values; value k is data[offsets[k]:offsets[k + 1]]
    data: np.ndarray  # uint8
    shape: tuple[int, ...]  # (rows, *one row's shape)

    @classmethod
    def from_arrow(cls, values: pa.Array, shape: tuple[int, ...]) -> TextValues:
        """``values``: the batch's strings, flat (a string array, every row's values one after the other)."""
        offsets, data = binary_parts(values)
        return cls(offsets, data, shape)

    def __len__(self) -> int:
        """The rows (the first dimension of ``shape``)."""
        return self.shape[0]


class TextFile:
    """Where one set of rows' strings are written as they arrive; ``finish`` gives their reader."""

    def __init__(self, directory: str):
        self._path = os.path.join(directory, "texts")
        self._file = os.fdopen(os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
        self._size = 0

    def append(self, values: TextValues) -> np.ndarray:
        """Writes the values' bytes; returns their spans, an int64 array of shape ``(*values.shape, SPAN)``."""
        self._file.write(values.data.data)  # a 1-D slice of a buffer: contiguous
        spans = np.stack([values.offsets[:-1] + self._size, np.diff(values.offsets)], axis=-1)
        self._size += len(values.data)
        return spans.reshape(*values.shape, SPAN)

    def finish(self, mapped_bytes: int) -> TextReader:
        """Opens the file for reading and removes it from the disk; returns its reader."""
        try:
            self._file.close()
            return TextReader(os.open(self._path, os.O_RDONLY), self._size, mapped_bytes)
        finally:
            self.discard()

    def discard(self) -> None:
        """Removes the file (once opened, it stays readable until the process lets go of it)."""
        self._file.close()
        if os.path.exists(self._path):
            os.unlink(self._path)


class TextReader:
    """The strings of a text file, read back by their spans."""

    def __init__(self, fd: int, size: int, mapped_bytes: int):
        self._fd, self._size = fd, size
        self._mapped: mmap.mmap | None = None
        if 0 < size <= mapped_bytes:
            self._mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_RANDOM"):  # values are read in shuffled order: no read-ahead from disk
                self._mapped.madvise(mmap.MADV_RANDOM)
        weakref.finalize(self, os.close, fd)  # the file's space is freed once no reader holds it

    def values(self, spans: np.ndarray) -> np.ndarray:
        """The strings at ``spans`` (an array of shape ``(..., SPAN)``) as ``bytes`` objects, of shape ``spans.shape[:-1]``."""
        flat = spans.reshape(-1, SPAN).tolist()
        if self._mapped is not None:
            mapped = self._mapped
            items = [mapped[start : start + length] for start, length in flat]
        else:
            pread, fd = os.pread, self._fd
            items = [pread(fd, length, start) if length else b"" for start, length in flat]
            if any(len(item) != length for item, (_, length) in zip(items, flat)):
                raise EOFError("sparkdl's spilled strings are shorter than the strings written to them")
        found = np.empty(len(items), object)
        found[:] = items
        return found.reshape(spans.shape[:-1])
