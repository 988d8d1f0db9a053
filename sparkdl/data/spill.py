"""A partition streamed to local disk as its Arrow batches arrive, read back memory-mapped: memory stays flat.

Each field's rows go, batch by batch, to a file of fixed-size rows in the executor's local
directory (Spark's ``spark.local.dir``, which executors pass to Python as ``SPARK_LOCAL_DIRS``). Once
the partition has arrived, every file is memory-mapped read-only and unlinked at once: the data
stays readable through the mapping, no other process can open it, and the kernel frees it when the
mapping closes or the task's process dies, however it dies. The files are created owner-only
(a 0700 directory, 0600 files).

Reading a batch copies its rows out of the page cache into a small array; the worker's own memory
(anonymous, what it allocates) stays flat whatever the partition's size. The file pages it has read
stay mapped and count in its resident set size, but they are page cache, which the kernel reclaims
whenever memory is short (``tests/test_partition_memory.py`` trains a partition larger than a memory
cgroup's limit). Releasing them eagerly (``madvise(MADV_DONTNEED)``) was measured and rejected: rows
are read in a fresh random order every epoch, and the kernel maps page-cache folios of up to 2 MB
at a time, so one batch maps most of the file again and every release costs throughput (0.8x at 4M
rows) without lowering the peak (docs/benchmarks.md).
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np

from sparkdl.data.fields import Field


def spill_directory() -> str:
    """Where a task writes its partition: the executor's first local directory, else the system's temp directory."""
    local_dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d and os.path.isdir(d)]
    return local_dirs[0] if local_dirs else tempfile.gettempdir()


class SpilledArrays:
    """One set of rows (a partition's training or held-out rows) written field by field, then mapped."""

    def __init__(self, fields: tuple[Field, ...], directory: str):
        self._fields = fields
        self._directory = tempfile.mkdtemp(prefix="sparkdl-partition-", dir=directory)  # 0700
        self._paths = {field.column: os.path.join(self._directory, field.column) for field in fields}
        self._files = {
            column: os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
            for column, path in self._paths.items()
        }
        self._rows = 0

    def append(self, arrays: dict[str, np.ndarray]) -> None:
        for column, array in arrays.items():
            self._files[column].write(np.ascontiguousarray(array).tobytes())
        self._rows += len(next(iter(arrays.values())))

    def finish(self) -> dict[str, np.ndarray]:
        """Maps every file read-only and removes it from the disk; returns one ``(rows, *shape)`` array per field."""
        arrays = {}
        try:
            for field in self._fields:
                self._files[field.column].close()
                dtype = field.numpy_dtype
                if self._rows == 0:
                    arrays[field.column] = np.empty((0, *field.shape), dtype)
                    continue
                with open(self._paths[field.column], "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if hasattr(mmap, "MADV_RANDOM"):  # rows are read in shuffled order: no read-ahead from disk
                    mapped.madvise(mmap.MADV_RANDOM)
                arrays[field.column] = np.frombuffer(mapped, dtype).reshape((self._rows, *field.shape))
        finally:
            self.discard()
        return arrays

    def discard(self) -> None:
        """Removes the files (mapped ones stay readable until the process lets go of them)."""
        for handle in self._files.values():
            handle.close()
        for path in self._paths.values():
            if os.path.exists(path):
                os.unlink(path)
        if os.path.isdir(self._directory):
            os.rmdir(self._directory)
