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


class Rows:
    """Some rows of a partition, one array per field; ``take`` gives the batches Keras trains on."""

    def __init__(self, fields: Fields, rows: MappedRows | FileRows):
        self.fields = fields
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
        return read_ahead(chunk for part in parts for chunk in self._rows.chunks(part.order, part.spans))

    def batches(self, parts: Iterable[EpochSteps]) -> Iterator[tuple]:
        """Each step's rows of the schedule's ``parts`` (:func:`sparkdl.schedule.epoch_steps`), as :meth:`take`
        gives them, read by a thread ahead of training (:func:`sparkdl.data.read_ahead.read_ahead`)."""
        for chunk in self.chunks(parts):
            for arrays in chunk.step_arrays():
                yield self.fields.keras_batch(arrays)


def read_partition(fields: Fields, batches: Iterable[pa.RecordBatch]) -> tuple[Rows, Rows]:
    """A partition's Arrow batches as ``(training rows, held-out validation rows)``, spilled to local disk.

    Without a ``VALIDATION`` column every row is a training row. One Arrow batch is in memory at a time.
    """
    directory = spill_directory()
    train = SpilledRows(fields.all, directory)
    held_out = SpilledRows(fields.all, directory)
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if VALIDATION not in batch.schema.names:
                train.append(fields.arrays(batch))
                continue
            mask = batch.column(VALIDATION)
            train.append(fields.arrays(batch.filter(pc.invert(mask))))
            held_out.append(fields.arrays(batch.filter(mask)))
    except BaseException:
        train.discard()
        held_out.discard()
        raise
    return Rows(fields, train.finish()), Rows(fields, held_out.finish())


def row_counts(batches: Iterable[pa.RecordBatch]) -> tuple[int, int]:
    """A partition's ``(training rows, held-out validation rows)``, without converting any values."""
    train = held_out = 0
    for batch in batches:
        validation = (pc.sum(batch.column(VALIDATION)).as_py() or 0) if VALIDATION in batch.schema.names else 0
        train += batch.num_rows - validation
        held_out += validation
    return train, held_out
