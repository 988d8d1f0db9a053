"""The checks' statistics reduced over rows as they arrive in a task, and combined across tasks.

A task reduces each Arrow batch's checks column (``sparkdl.data.checks.CHECKS``), and what it measures itself in the
columns that hold one checked column's values alone (``Stat.measured``), into sums, minima and
maxima (:class:`~sparkdl.data.rules.Stat`), the way Spark's ``sum``, ``min`` and ``max`` would: nulls are
skipped, and a minimum over no value is None. Tasks combine theirs as one int64 array each
(:meth:`RowStats.to_array`), which the barrier modes' ranks allgather, so that every rank judges the same
statistics of all rows (``sparkdl.data.rules``) and raises the same error, or none, before its first step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl.data.rules import CHECKS, MIN, NON_FINITE_OR_NULL, NULL_NUMBER, NULL_ROW, SUM, VALUES, WIDTH, Stat

_ROWS = Stat("rows", "", SUM)  # counted from the batches themselves


@dataclasses.dataclass
class RowStats:
    """Statistics over some rows: a value per :class:`Stat`, None where no row gave one."""

    stats: tuple[Stat, ...]
    values: dict[str, int | None]

    @classmethod
    def empty(cls, stats: tuple[Stat, ...]) -> RowStats:
        return cls(stats, {"rows": 0, **{stat.name: 0 if stat.reduction == SUM else None for stat in stats}})

    def add_batch(self, batch: pa.RecordBatch) -> None:
        """Adds one batch's rows: its checks column, and the columns whose values the tasks measure themselves."""
        checks = batch.column(CHECKS) if CHECKS in batch.schema.names else None
        reduced: dict[str, int | None] = {"rows": batch.num_rows}
        for stat in self.stats:
            if stat.measured is not None:
                reduced[stat.name] = _measured(stat, batch.column(stat.measured))
                continue
            assert checks is not None, f"the checks column carries {stat.value}"
            column = checks.field(stat.value)
            if stat.reduction == SUM:
                reduced[stat.name] = pc.sum(column).as_py() or 0
            else:
                reduced[stat.name] = (pc.min if stat.reduction == MIN else pc.max)(column).as_py()
        self.add(reduced)

    def add(self, other: Mapping[str, int | None]) -> None:
        """Adds statistics over other rows (a batch's, another task's)."""
        for stat in (_ROWS, *self.stats):
            mine, theirs = self.values[stat.name], other[stat.name]
            if theirs is None or mine is None:
                self.values[stat.name] = theirs if mine is None else mine
            elif stat.reduction == SUM:
                self.values[stat.name] = mine + theirs
            else:
                self.values[stat.name] = (min if stat.reduction == MIN else max)(mine, theirs)

    def to_array(self) -> np.ndarray:
        """Every value and whether it is known, as one int64 array (:meth:`combined` reads them back)."""
        names = ["rows", *(stat.name for stat in self.stats)]
        known = [self.values[name] is not None for name in names]
        return np.array([self.values[name] or 0 for name in names] + known, np.int64)

    @classmethod
    def combined(cls, stats: tuple[Stat, ...], arrays: Iterable[np.ndarray]) -> RowStats:
        """The statistics of the rows behind each of ``arrays`` (:meth:`to_array`'s) together."""
        names = ["rows", *(stat.name for stat in stats)]
        total = cls.empty(stats)
        for array in arrays:
            values, known = array[: len(names)], array[len(names) :]
            total.add({name: int(v) if k else None for name, v, k in zip(names, values, known)})
        return total


def _measured(stat: Stat, arrays: pa.ListArray) -> int | None:
    """``stat`` over rows of flat ``arrays``, as Spark would reduce the per-row value it names: a count of the rows
    with a bad value, or the smallest or largest width or value (None where there is none)."""
    if stat.measure == NULL_ROW:
        return arrays.null_count
    if stat.measure == WIDTH:
        widths = pc.list_value_length(arrays)  # null for a null row, which the reduction skips
        return _reduced(stat, widths)
    values = pc.list_flatten(arrays)  # the non-null rows' values
    if stat.measure == NULL_NUMBER:  # one value a row
        return values.null_count
    if stat.measure == VALUES:
        return _reduced(stat, values)
    if pa.types.is_floating(values.type):  # is_finite is null for a null value
        bad = pc.fill_null(pc.invert(pc.is_finite(values)), stat.measure == NON_FINITE_OR_NULL)
    elif stat.measure == NON_FINITE_OR_NULL:
        bad = pc.is_null(values)
    else:
        return 0  # integers and strings are never NaN nor infinite
    if not pc.any(bad).as_py():
        return 0
    rows = pc.list_parent_indices(arrays).filter(bad)
    return len(np.unique(rows.to_numpy(zero_copy_only=False)))


def _reduced(stat: Stat, values: pa.Array) -> int | None:
    found = (pc.min if stat.reduction == MIN else pc.max)(values).as_py()
    return None if found is None else int(found)
