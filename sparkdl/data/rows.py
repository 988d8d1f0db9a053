"""A worker's partition as arrays by field: its training rows, its held-out validation rows and their checks.

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
from sparkdl.data.row_stats import RowStats
from sparkdl.data.rules import RowCheckError, RowRules
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


def read_partition(rules: RowRules, batches: Iterable[pa.RecordBatch], *, spill: bool = True) -> Partition:
    """A partition's Arrow batches, spilled to local disk as they arrive (their keys in memory: 8 bytes a row), and
    the statistics of their checks column (``sparkdl.data.checks.CHECKS``); with ``spill=False`` only counted.

    Each batch is judged on its own (``RowRules.fields``) before it is spilled with the fields its statistics give;
    from the first batch the rules refuse, or whose fields differ from the first's, the rest is only counted: the
    statistics of all rows then name the error, wherever they are judged. The ``ROW_KEY`` column (added where
    ``launch.layout`` deals the rows) is required. One Arrow batch is in memory at a time.
    """
    partition = Partition(rules, spill_directory() if spill else None)
    try:
        for batch in batches:
            if batch.num_rows:
                partition.add(batch)
    except BaseException:
        partition.discard()
        raise
    partition.finish()
    return partition


class Partition:
    """A partition as it arrived: the statistics of its checks, its rows' keys, and its rows, spilled with the fields
    they were read with (none where a batch was refused, no row arrived or nothing is spilled)."""

    def __init__(self, rules: RowRules, directory: str | None):
        self.stats = RowStats.empty(rules.stats)
        self._rules = rules
        self._directory = directory  # None: count, spill nothing
        self._keys: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])  # training rows', held-out rows', by batch
        self.keys = np.empty(0, np.int64)  # its training rows' keys (``ROW_KEY``), once it has arrived
        self._held_out_keys = np.empty(0, np.int64)
        self._fields: Fields | None = None
        self._spilled: tuple[SpilledRows, SpilledRows] | None = None
        self._read: tuple[MappedRows | FileRows, MappedRows | FileRows] | None = None
        self._refused = False

    @property
    def held_out_rows(self) -> int:
        """Its held-out rows, once it has arrived."""
        return len(self._held_out_keys)

    def add(self, batch: pa.RecordBatch) -> None:
        if ROW_KEY not in batch.schema.names:
            raise ValueError(f"Expected the rows' keys in column {ROW_KEY!r}. Received columns: {batch.schema.names}")
        own = RowStats.empty(self._rules.stats)
        own.add_batch(batch)
        self.stats.add(own.values)
        parts = [batch]
        if VALIDATION in batch.schema.names:
            mask = batch.column(VALIDATION)
            parts = [batch.filter(pc.invert(mask)), batch.filter(mask)]
        for keys, part in zip(self._keys, parts):
            # a copy: a view would hold the whole batch's buffer, which Arrow reads from the stream as one
            keys.append(part.column(ROW_KEY).to_numpy(zero_copy_only=False).astype(np.int64, copy=True))
        if self._refused or self._directory is None:
            return
        try:
            fields = self._rules.fields(own.values)
        except RowCheckError:
            fields = None
        if fields is None or (self._fields is not None and fields != self._fields):
            self._refused = True  # the statistics of all rows say why
            self.discard()
            return
        if self._spilled is None:
            self._fields = fields
            self._spilled = (SpilledRows(fields.all, self._directory), SpilledRows(fields.all, self._directory))
        for spilled, part in zip(self._spilled, parts):
            spilled.append(fields.arrays(part))

    def finish(self) -> None:
        self.keys, self._held_out_keys = _joined(self._keys[0]), _joined(self._keys[1])
        if self._spilled is not None:
            self._read = (self._spilled[0].finish(), self._spilled[1].finish())
            self._spilled = None

    def discard(self) -> None:
        for spilled in self._spilled or ():
            spilled.discard()
        self._spilled = None

    def rows(self, fields: Fields) -> tuple[Rows, Rows]:
        """``(training rows, held-out validation rows)``, once the statistics of the fit's rows passed the rules and
        gave ``fields``."""
        if self._directory is None or self._refused or (self._fields is not None and self._fields != fields):
            raise ValueError(
                f"Expected this partition's rows read as {fields}: they were not (their values changed while they "
                "were read, a nondeterministic DataFrame?)."
            )
        if self._read is None:  # no row arrived
            self._read = tuple(SpilledRows(fields.all, self._directory).finish() for _ in range(2))  # type: ignore[assignment]
        assert self._read is not None
        training, held_out = self._read
        return Rows(fields, training, self.keys), Rows(fields, held_out, self._held_out_keys)

    def own_rows(self) -> tuple[Rows, Rows]:
        """:meth:`rows`, once this partition's own statistics passed the rules: for a worker that judges its own rows
        (no lockstep), or whose rows the driver judged already."""
        return self.rows(self._rules.fields(self.stats.values))


def _joined(keys: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(keys) if keys else np.empty(0, np.int64)
