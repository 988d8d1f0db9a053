"""What is checked of each row a fit reads, as per-row values that travel with the row in one struct column.

Every column the fit reads adds its per-row values (null or not, non-finite values, the widths at each
nesting level, the integer range, an image's size and mode) to the checks column ``CHECKS``, and the
statistics that reduce them (a sum, a minimum or a maximum over rows: :class:`~sparkdl.data.rules.Stat`).
The training tasks reduce them as their partitions arrive (``sparkdl.data.row_stats``), so the checks
cost no pass over the data of their own; those of a column that the frame carries alone (its values, its
widths, its range) the tasks measure in their Arrow batches instead of reading them from the checks
column. ``Checks.aggregate`` reduces them all on the driver instead, in one Spark job. The rules that
judge the statistics are ``sparkdl.data.rules``'.
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sparkdl.data.columns import ARRAY, IMAGE, IMAGE_MODES, SCALAR, SourceColumn
from sparkdl.data.rules import (
    CHECKS,
    MAX,
    MIN,
    NON_FINITE,
    NON_FINITE_OR_NULL,
    NULL_NUMBER,
    NULL_ROW,
    SUM,
    VALUES,
    WIDTH,
    Stat,
)

_REDUCE: dict[str, Callable[[Column], Column]] = {SUM: F.sum, MIN: F.min, MAX: F.max}


class Checks:
    """Collects what to check of each column: the per-row values of the checks column and their statistics."""

    def __init__(self) -> None:
        self.columns: list[tuple[SourceColumn, str]] = []
        self.nonnegative: str | None = None
        self._values: dict[str, Column] = {}
        self._stats: list[Stat] = []

    def add_column(self, source: SourceColumn, element: str, column: str, alone: bool) -> None:
        """Checks ``source`` as its values will be read: cast to ``element`` (``float``, ``double``, ``bigint`` or
        ``string``), into the frame's ``column`` (for an array, its values alone). ``alone``: ``column`` holds this
        source's values only (not several columns' joined), so the tasks measure them there, in their Arrow batches,
        where it holds them as they are (a number, a Vector, a flat array).

        A row is bad where its values hold a NaN or an infinity (the largest and smallest value say so) or, for an
        array, a null (a lambda, which Spark evaluates row by row without generated code, at several times the cost
        of reading the row: the tasks measure it themselves wherever the array is alone in its column; it remains
        for ``aggregate`` and for arrays joined into one input)."""
        if any(existing.name == source.name for existing, _ in self.columns):
            return
        i = len(self.columns)
        self.columns.append((source, element))
        name = F.col(source.name)
        # The frame's column holds the source's values as they are: not an image's bytes, nor nested arrays flattened
        # (null where an inner array is)
        measured = column if alone and source.kind != IMAGE and source.depth <= 1 else None
        self._count(f"nulls_{i}", name.isNull(), measured, NULL_NUMBER if source.kind == SCALAR else NULL_ROW)
        if source.kind == IMAGE:
            self._image(source, i)
            return
        values = source.values(element)
        bad = F.lit(False)
        if element not in ("bigint", "string"):
            largest = F.array_max(values)
            bad = F.isnan(largest) | (largest == float("inf")) | (F.array_min(values) == float("-inf"))
        if source.kind == ARRAY:  # a number or a Vector holds no null value but itself
            bad = bad | F.exists(values, lambda x: x.isNull())
        measure = NON_FINITE_OR_NULL if source.kind == ARRAY else NON_FINITE
        self._count(f"bad_{i}", bad, measured, measure)
        self._range(f"width_{i}", F.size(values), f"min_width_{i}", f"max_width_{i}", measured, WIDTH)
        for level, arrays in enumerate(source.levels()):
            sizes = F.transform(arrays, lambda a: F.coalesce(F.size(a), F.lit(-1)))
            self._count(f"inner_nulls_{i}_{level}", F.exists(arrays, lambda a: a.isNull()))
            self._range(f"outer_{i}_{level}", F.size(arrays), f"outer_min_{i}_{level}", f"outer_max_{i}_{level}")
            self._value(f"inner_low_{i}_{level}", F.array_min(sizes), f"inner_min_{i}_{level}", MIN)
            self._value(f"inner_high_{i}_{level}", F.array_max(sizes), f"inner_max_{i}_{level}", MAX)
        if source.integer:
            self._value(f"low_value_{i}", F.array_min(values), f"low_{i}", MIN, measured, VALUES)
            self._value(f"high_value_{i}", F.array_max(values), f"high_{i}", MAX, measured, VALUES)

    def add_nonnegative(self, name: str) -> None:
        """Counts the rows where number column ``name`` is negative (sample weights)."""
        self.nonnegative = name
        self._count("negative", F.col(name) < 0)

    def add_validation(self, mask: Column, column: str | None) -> None:
        """Counts the held-out rows (and, for a ``validation_col``, its nulls)."""
        self._count("validation_rows", mask)
        if column is not None:
            self._count("validation_nulls", F.col(column).isNull())

    @property
    def stats(self) -> tuple[Stat, ...]:
        return tuple(self._stats)

    def column(self) -> Column | None:
        """The checks column: each row's values that the tasks do not measure themselves, as ``CHECKS``; None where
        they measure them all."""
        measured = {stat.value for stat in self._stats if stat.measured is not None}
        kept = [value.alias(name) for name, value in self._values.items() if name not in measured]
        return F.struct(*kept).alias(CHECKS) if kept else None

    def aggregate(self, df: DataFrame) -> dict:
        """The statistics over all of ``df``'s rows, on the driver (one Spark job), with ``rows``: its row count."""
        reduced = [F.count(F.lit(1)).alias("rows")]
        for stat in self._stats:
            reduced.append(_REDUCE[stat.reduction](self._values[stat.value]).alias(stat.name))
        row = df.agg(*reduced).first()
        assert row is not None, "an aggregate without grouping returns one row"
        return row.asDict()

    def _count(self, name: str, condition: Column, measured: str | None = None, measure: str | None = None) -> None:
        """Counts the rows where ``condition`` holds (a null condition counts as false)."""
        self._value(name, F.when(condition, 1).otherwise(0).cast("int"), name, SUM, measured, measure)

    def _range(
        self, value: str, column: Column, low: str, high: str, measured: str | None = None, measure: str | None = None
    ) -> None:
        self._value(value, column, low, MIN, measured, measure)
        self._stats.append(Stat(high, value, MAX, measured, measure))

    def _value(
        self,
        name: str,
        column: Column,
        stat: str,
        reduction: str,
        measured: str | None = None,
        measure: str | None = None,
    ) -> None:
        """The check value ``name`` of each row (``column``), reduced over the rows by ``reduction`` as ``stat``;
        measured by the tasks in the frame's column ``measured`` (``measure``) where that is given."""
        self._values[name] = column
        self._stats.append(Stat(stat, name, reduction, measured if measure else None, measure if measured else None))

    def _image(self, source: SourceColumn, i: int) -> None:
        image = F.col(source.name)
        expected_bytes = image.getField("height") * image.getField("width") * image.getField("nChannels")
        self._count(f"bad_{i}", F.length(image.getField("data")) != expected_bytes)
        self._count(f"modes_{i}", ~image.getField("mode").isin(*IMAGE_MODES))
        for field in ("height", "width", "nChannels"):
            self._range(f"{field}_{i}", image.getField(field), f"min_{field}_{i}", f"max_{field}_{i}")
