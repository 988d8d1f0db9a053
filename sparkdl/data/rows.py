"""A worker's partition as arrays by field: its training rows and its held-out validation rows.

The rows are streamed to local disk as they arrive and read back a batch (or a window of batches) at
a time (``sparkdl.data.spill``), by a thread ahead of training (``sparkdl.data.read_ahead``), so a
worker's memory does not grow with its partition.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl.data.fields import Fields
from sparkdl.data.read_ahead import Chunk, read_ahead
from sparkdl.data.spill import FileRows, MappedRows, SpilledRows, spill_directory
from sparkdl.schedule import EpochSteps

VALIDATION = "_sparkdl_validation"  # boolean; only present when rows are held out for validation
ROW_KEY = "__sparkdl_row"  # bigint: the row's key, the same on every run over the same input (``launch.layout``)


class Rows:
    """Some rows of a partition, one array per field; ``take`` gives the batches Keras trains on."""

    def __init__(self, fields: Fields, rows: MappedRows | FileRows, keys: np.ndarray):
        if len(keys) != len(rows):
            raise ValueError(f"Expected a key per row. Received: {len(keys)} keys for {len(rows)} rows")
        self.fields = fields
        self.keys = keys  # each row's ``ROW_KEY`` (int64), by row number: what orders an epoch (``schedule``)
        self._rows = rows
        self._count = len(rows)

    def __len__(self) -> int:
        return self._count

    def read(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at ``index``, one array per field (a string field's as ``bytes`` objects)."""
        return self._rows.read(index)

    def take(self, index: np.ndarray) -> tuple:
        """The rows at ``index`` as ``(x, y)`` or ``(x, y, sample_weight)`` (copies, in memory)."""
        return self.fields.keras_batch(self._rows.read(index))

    def chunks(self, parts: Iterable[EpochSteps]) -> Iterator[Chunk]:
        """The schedule's ``parts`` (:func:`sparkdl.schedule.epoch_steps`) as chunks of consecutive steps' rows,
        read by a thread ahead of training (:func:`sparkdl.data.read_ahead.read_ahead`)."""
        return read_ahead(chunk for part in parts for chunk in self._rows.chunks(_order(part), part.spans))

    def batches(self, parts: Iterable[EpochSteps]) -> Iterator[tuple]:
        """Each step's rows of the schedule's ``parts`` (:func:`sparkdl.schedule.epoch_steps`), as :meth:`take`
        gives them, read by a thread ahead of training (:func:`sparkdl.data.read_ahead.read_ahead`)."""
        for chunk in self.chunks(parts):
            for arrays in chunk.step_arrays():
                yield self.fields.keras_batch(arrays)


def _order(part: EpochSteps) -> np.ndarray:
    if part.order is None:
        raise ValueError("Expected the steps of rows with keys (an EpochSteps with an order). Received: none")
    return part.order


def read_partition(fields: Fields, batches: Iterable[pa.RecordBatch]) -> tuple[Rows, Rows]:
    """A partition's Arrow batches as ``(training rows, held-out validation rows)``, spilled to local disk (their
    keys in memory: 8 bytes a row).

    Without a ``VALIDATION`` column every row is a training row. The ``ROW_KEY`` column (added where
    ``launch.layout`` deals the rows) is required. One Arrow batch is in memory at a time.
    """
    directory = spill_directory()
    parts = (_KeyedRows(fields, directory), _KeyedRows(fields, directory))
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if VALIDATION not in batch.schema.names:
                parts[0].append(batch)
                continue
            mask = batch.column(VALIDATION)
            parts[0].append(batch.filter(pc.invert(mask)))
            parts[1].append(batch.filter(mask))
    except BaseException:
        for part in parts:
            part.rows.discard()
        raise
    return parts[0].finish(), parts[1].finish()


class _KeyedRows:
    """Rows being spilled, and their keys."""

    def __init__(self, fields: Fields, directory: str):
        self.fields = fields
        self.rows = SpilledRows(fields.all, directory)
        self.keys: list[np.ndarray] = []

    def append(self, batch: pa.RecordBatch) -> None:
        if ROW_KEY not in batch.schema.names:
            raise ValueError(f"Expected the rows' keys in column {ROW_KEY!r}. Received columns: {batch.schema.names}")
        self.rows.append(self.fields.arrays(batch))
        self.keys.append(batch.column(ROW_KEY).to_numpy(zero_copy_only=False).astype(np.int64, copy=False))

    def finish(self) -> Rows:
        keys = np.concatenate(self.keys) if self.keys else np.empty(0, np.int64)
        return Rows(self.fields, self.rows.finish(), keys)


def training_keys(batches: Iterable[pa.RecordBatch]) -> tuple[np.ndarray, int]:
    """A partition's training rows' keys (``ROW_KEY``) and its held-out validation row count, without converting any
    other values."""
    keys, held_out = [], 0
    for batch in batches:
        if VALIDATION in batch.schema.names:
            mask = batch.column(VALIDATION)
            held_out += pc.sum(mask).as_py() or 0
            batch = batch.filter(pc.invert(mask))
        keys.append(batch.column(ROW_KEY).to_numpy(zero_copy_only=False).astype(np.int64, copy=False))
    return (np.concatenate(keys) if keys else np.empty(0, np.int64)), held_out
