"""A partition streamed to local disk as its Arrow batches arrive, read back a batch at a time: memory stays flat.

The rows go, batch by batch, to one file of fixed-size records (every field of a row side by side;
a string field's values are spans of a second file, ``sparkdl.data.texts``) in the executor's local directory (Spark's ``spark.local.dir``, which executors pass to Python as
``SPARK_LOCAL_DIRS``). Once the partition has arrived, the file is opened for reading and unlinked at
once: the data stays readable through the open file, no other process can open it, and the kernel
frees it when the worker lets go of it or its process dies, however it dies. It is created
owner-only (a 0700 directory, a 0600 file), in a scratch directory (``sparkdl.scratch``) that the host's next
sparkdl task removes should the worker be killed while the partition arrives.

Two ways to read the rows back, chosen by the size of the file:

- up to ``MAPPED_BYTES``, the file is memory-mapped and a batch is a gather from the mapping, field
  by field (0.2 µs a row here, as from arrays in memory). The pages it has read stay mapped and count
  in the worker's resident set: rows are read in a fresh random order every epoch and the kernel maps
  page-cache folios of up to 2 MB per fault, so one shuffled batch maps most of the file and
  releasing pages eagerly (``MADV_DONTNEED``) was measured slower and no lower (docs/benchmarks.md);
- beyond it, the file is read with system calls, so that only what is being read is the worker's:
  the rest stays in the page cache, which the kernel reclaims whenever memory is short. A worker's
  resident set stays flat however large its partition, which matters where something counts it:
  YARN's container monitor kills a container whose processes' resident sets exceed its memory, and
  PySpark caps a worker's address space (mappings included) at ``spark.executor.pyspark.memory`` when
  it is set, so the threshold is a quarter of that when it is smaller. An epoch's shuffled steps are
  read a window at a time with sequential reads (``sparkdl.data.windows``); a few steps, or held-out
  rows, with one ``os.pread`` per row (1.3 µs a row here; a batch of consecutive rows is one read).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator
from typing import IO

import numpy as np

from sparkdl import scratch
from sparkdl.data.fields import Field
from sparkdl.data.read_ahead import Chunk
from sparkdl.data.texts import SPAN, TextFile, TextReader, TextValues
from sparkdl.data.windows import read_in_windows, read_into

# A partition's training (or held-out) rows are memory-mapped up to this size, read with system calls beyond it.
MAPPED_BYTES = 256 << 20
SCRATCH_WAIT_SECONDS = 60  # an earlier reading stops within a window of rows: far less than this


def mapped_bytes_limit() -> int:
    """``MAPPED_BYTES``, or a quarter of the worker's address-space cap (``spark.executor.pyspark.memory``) if smaller."""
    cap_mb = int(os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB") or -1)  # what PySpark's worker sets RLIMIT_AS from
    return MAPPED_BYTES if cap_mb <= 0 else min(MAPPED_BYTES, (cap_mb << 20) // 4)


def spill_directory() -> str:
    """Where a task writes its partition: the executor's first local directory, else the system's temp directory."""
    local_dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d and os.path.isdir(d)]
    return local_dirs[0] if local_dirs else tempfile.gettempdir()


class SpilledRows:
    """One set of rows (a partition's training or held-out rows) written as they arrive, then read back by row number."""

    def __init__(self, fields: tuple[Field, ...], directory: str, mapped_bytes: int | None = None):
        # one record per row, fields side by side and unpadded: a row is one read
        by_column = {field.column: field for field in fields}  # a column two fields read is stored once
        self._record = np.dtype(
            [
                (column, np.int64, (*field.shape, SPAN)) if field.is_text else (column, field.numpy_dtype, field.shape)
                for column, field in by_column.items()
            ]
        )
        self._text_columns = tuple(column for column, field in by_column.items() if field.is_text)
        self._mapped_bytes = mapped_bytes_limit() if mapped_bytes is None else mapped_bytes
        self._scratch_directory = directory  # where a FileRows sorts an epoch's rows into windows
        self._directory = scratch.make_directory(directory)  # 0700, removed by the next task should this one die
        self._path = os.path.join(self._directory, "rows")
        self._file = os.fdopen(os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
        self._texts = TextFile(self._directory) if self._text_columns else None
        self._rows = 0

    def append(self, arrays: dict[str, np.ndarray | TextValues]) -> None:
        """Writes one Arrow batch's rows, given as one ``(rows, *shape)`` array (or ``TextValues``) per field."""
        records = np.empty(len(next(iter(arrays.values()))), self._record)
        for column, values in arrays.items():
            if isinstance(values, TextValues):
                assert self._texts is not None, "a record with string fields has a text file"
                records[column] = self._texts.append(values)
            else:
                records[column] = values
        self._file.write(records.data)  # its buffer: tobytes() would copy the batch once more
        self._rows += len(records)

    def finish(self) -> MappedRows | FileRows:
        """Opens the files for reading and removes them from the disk; returns their reader."""
        try:
            self._file.close()
            texts = None
            if self._texts is not None:
                texts = _Texts(self._texts.finish(self._mapped_bytes), self._text_columns)
            if self._rows * self._record.itemsize <= self._mapped_bytes:
                return MappedRows(self._path, self._record, self._rows, texts)
            return FileRows(os.open(self._path, os.O_RDONLY), self._record, self._rows, self._scratch_directory, texts)
        finally:
            self.discard()

    def discard(self) -> None:
        """Removes the files (once opened, they stay readable until the process lets go of them)."""
        self._file.close()
        if self._texts is not None:
            self._texts.discard()
        if os.path.exists(self._path):
            os.unlink(self._path)
        if os.path.isdir(self._directory):
            os.rmdir(self._directory)


class _Texts:
    """The string fields of a set of rows: their columns, whose records hold spans, and the file the spans point in."""

    def __init__(self, reader: TextReader, columns: tuple[str, ...]):
        self.reader, self.columns = reader, columns

    def resolve(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``arrays`` with each string field's spans replaced by its values (``bytes`` objects)."""
        return {name: self.reader.values(a) if name in self.columns else a for name, a in arrays.items()}


#: Rows read and handed to training at once when they fit in memory: few enough to keep a chunk at a few
#: MB for common rows, many enough that a small model's step does not pay a Python hand-off of its own.
CHUNK_ROWS = 8192


class _Reader:
    """What both readers share: string values read by their spans, and the steps of part of an epoch, given the
    rows to read as spans of its order."""

    def __init__(self, texts: _Texts | None):
        self._texts = texts

    def read(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at ``index``, one ``(len(index), *shape)`` array per field."""
        arrays = self._gather(_checked(index, len(self)))
        return self._texts.resolve(arrays) if self._texts is not None else arrays

    def __len__(self) -> int:
        raise NotImplementedError

    def _gather(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The records at ``index`` (checked row numbers), one array per field (a string field's spans)."""
        raise NotImplementedError

    def chunks(self, order: np.ndarray, spans: list[tuple[int, int]]) -> Iterator[Chunk]:
        """The rows at ``order[start:stop]`` for each span: consecutive spans of up to ``CHUNK_ROWS`` rows a chunk
        (read in one gather, handed to training in one piece); a filler span, which repeats a row, a chunk alone."""
        group: list[tuple[int, int]] = []
        for span in spans + [None]:
            if group and (span is None or span[0] != group[-1][1] or span[1] - group[0][0] > CHUNK_ROWS):
                first = group[0][0]
                yield Chunk(self.read(order[first : group[-1][1]]), [(a - first, b - first) for a, b in group])
                group = []
            if span is not None:
                group.append(span)


class MappedRows(_Reader):
    """Rows read from a memory mapping of their file: a batch is a gather."""

    def __init__(self, path: str, record: np.dtype, rows: int, texts: _Texts | None = None):
        super().__init__(texts)
        self._records = np.empty(0, record)
        if rows:
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_RANDOM"):  # rows are read in shuffled order: no read-ahead from disk
                mapped.madvise(mmap.MADV_RANDOM)
            self._records = np.frombuffer(mapped, record)

    def __len__(self) -> int:
        return len(self._records)

    def _gather(self, index: np.ndarray) -> dict[str, np.ndarray]:
        # field by field: twice as fast as gathering whole records and then splitting them
        return {name: self._records[name][index] for name in self._records.dtype.names or ()}


class FileRows(_Reader):
    """Rows read from their open file with system calls: only the rows being read come into memory."""

    def __init__(self, fd: int, record: np.dtype, rows: int, scratch_directory: str, texts: _Texts | None = None):
        super().__init__(texts)
        self._fd, self._record, self._rows = fd, record, rows
        self._scratch_directory = scratch_directory
        self._scratch: IO[bytes] | None = None  # where epochs are sorted into windows (made when first needed)
        self._scratch_lock = threading.Lock()
        weakref.finalize(self, os.close, fd)  # the file's space is freed once no reader holds it

    def __len__(self) -> int:
        return self._rows

    def _gather(self, index: np.ndarray) -> dict[str, np.ndarray]:
        size = self._record.itemsize
        if len(index) and _consecutive(index):
            records = np.empty(len(index), self._record)
            read_into(self._fd, records, int(index[0]) * size)  # consecutive rows: one read
        else:
            pread, fd = os.pread, self._fd
            data = b"".join([pread(fd, size, offset) for offset in (index * size).tolist()])
            if len(data) != len(index) * size:
                raise EOFError("sparkdl's spilled partition is shorter than the rows written to it")
            records = np.frombuffer(data, self._record)
        return {name: np.ascontiguousarray(records[name]) for name in records.dtype.names or ()}

    def chunks(self, order: np.ndarray, spans: list[tuple[int, int]]) -> Iterator[Chunk]:
        """The rows at ``order[start:stop]`` for each span: a window a chunk when the spans are much of a shuffled
        epoch, a span a chunk otherwise."""
        if not _worth_windows(order, spans, self._rows):
            yield from super().chunks(order, spans)
            return
        _checked(order[spans[0][0] : spans[-1][1]], self._rows)
        # one reading at a time fills the scratch file: a reading dropped half-way lets go once its thread stops
        if not self._scratch_lock.acquire(timeout=SCRATCH_WAIT_SECONDS):
            raise RuntimeError(
                f"sparkdl's scratch file for reading rows in windows was still in use after {SCRATCH_WAIT_SECONDS} s "
                "by an earlier reading of the same rows"
            )
        try:
            if self._scratch is None:  # no name, owner-only, closed (and freed) with the reader
                self._scratch = tempfile.TemporaryFile(dir=self._scratch_directory)
            windows = read_in_windows(self._fd, self._record, self._rows, order, spans, self._scratch.fileno())
            if self._texts is None:
                yield from windows
                return
            for window in windows:  # strings a step at a time: a window's records may point at gigabytes of text
                for arrays in window.step_arrays():
                    yield Chunk(self._texts.resolve(arrays), [(0, len(next(iter(arrays.values()))))])
        finally:
            self._scratch_lock.release()


def _worth_windows(order: np.ndarray, spans: list[tuple[int, int]], rows: int) -> bool:
    """Whether spans are read faster in windows: steps that follow each other, at least a quarter of the
    file (one pass over the whole file costs less than reading a quarter of its rows one by one), in
    shuffled order (a step of consecutive rows is one read)."""
    if not spans or any(stop != start for (_, stop), (start, _) in zip(spans, spans[1:])):
        return False
    low, high = spans[0][0], spans[-1][1]
    return 4 * (high - low) >= rows and not _consecutive(order[low:high])


def _consecutive(index: np.ndarray) -> bool:
    """Whether ``index`` (not empty) is a run of consecutive row numbers: rows one read fetches."""
    return bool(index[-1] - index[0] == len(index) - 1 and (np.diff(index) == 1).all())


def _checked(index: np.ndarray, rows: int) -> np.ndarray:
    index = np.asarray(index, np.int64)
    if index.ndim != 1 or (len(index) and (index.min() < 0 or index.max() >= rows)):
        raise IndexError(f"row numbers must be a 1-D array within 0..{rows - 1}")
    return index
