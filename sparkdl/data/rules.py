"""What the rows a fit reads must satisfy, judged from their reduced statistics wherever those were reduced.

The statistics (``sparkdl.data.checks`` names them: null rows, non-finite values, the smallest and largest
width at each nesting level, integer ranges, row counts) are reduced over rows by the training tasks as
their partitions arrive (``sparkdl.data.row_stats``), or on the driver by one Spark job
(``TrainingPlan.check``). Either way :class:`RowRules` judges them with the same rules and the same
messages: a failed rule is a :class:`RowCheckError` (a ``ValueError``) naming the column and what was expected; a passed one gives
each field's row shape, fitted to the model's input (``sparkdl.data.shapes``), and the row counts.
:class:`RowRules` is small and picklable: it travels to the tasks in their settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sparkdl.data import shapes
from sparkdl.data.columns import IMAGE, IMAGE_MODES, SourceColumn
from sparkdl.data.fields import INPUT, TARGET, WEIGHT, Field, Fields

if TYPE_CHECKING:
    from sparkdl.data.plan import PlannedField

SUM, MIN, MAX = "sum", "min", "max"  # how a statistic reduces its per-row values
EMPTY_INPUT = "The DataFrame passed to sparkdl.fit is empty: expected at least one row per worker."
CHECKS = "_sparkdl_checks"  # the frame's struct column of each row's values to check (``sparkdl.data.checks``)


class RowCheckError(ValueError):
    """The fit's rows break a rule: the message names the column and what was expected. Raised by a task, it reaches
    the driver as itself, with its message alone (``sparkdl.launch.errors``): every rank judges the same statistics
    and raises the same error."""


@dataclasses.dataclass(frozen=True)
class Stat:
    """One reduced statistic: ``reduction`` (SUM, MIN or MAX) over the rows of the per-row value ``value``."""

    name: str  # e.g. "min_width_0"
    value: str  # the per-row value it reduces, e.g. "width_0": a field of the checks column, unless measured
    reduction: str
    # Where the frame's column ``measured`` holds the checked column's values alone, the tasks measure ``value`` in
    # its Arrow batches (``measure``: one of MEASURES) instead of reading it from the checks column: Spark would
    # compute it row by row and convert it to Arrow, at a third of the cost of reading the row.
    measured: str | None = None
    measure: str | None = None


# What the tasks measure of a row's flat array of values (``Stat.measure``):
NULL_ROW = "null row"  # 1 where the row is null
NULL_NUMBER = "null number"  # 1 where the row's one value (a number column's, as an array of one) is null
NON_FINITE = "non-finite"  # 1 where a value is a NaN or an infinity
NON_FINITE_OR_NULL = "non-finite or null"  # 1 where a value is a NaN, an infinity or a null
WIDTH = "width"  # the array's length (none for a null row)
VALUES = "values"  # its values (a MIN or MAX over them)


@dataclasses.dataclass(frozen=True)
class ColumnStats:
    """What the statistics say of one column: one row's shape (uniform over rows) and, for integers, their range."""

    shape: tuple[int, ...]  # () for a number; (values,) for a Vector or flat array; nested sizes; (h, w, c) for images
    low: int | None = None  # smallest and largest value, for integer columns
    high: int | None = None


@dataclasses.dataclass(frozen=True)
class Checked:
    """Rows that passed every rule: how many train, how many are held out, and the fields the workers read."""

    num_rows: int  # rows to train on (held-out validation rows not included)
    validation_rows: int
    fields: Fields


@dataclasses.dataclass(frozen=True)
class RowRules:
    """Everything needed to judge the statistics of a fit's rows, on the driver or in a task."""

    planned: tuple[PlannedField, ...]  # inputs, then targets, then the weight
    columns: tuple[tuple[SourceColumn, str], ...]  # each source column once, with the type its values are read as
    stats: tuple[Stat, ...]  # what the checks column's values reduce to (``sparkdl.data.checks``)
    nonnegative: str | None  # the sample weight column
    validation_col: str | None
    holds_out: bool  # rows are held out for validation
    validation_source: str  # how the held-out rows were chosen, as the messages name it

    def fields(self, stats: Mapping[str, Any]) -> Fields:
        """The fields of rows with these statistics (at least one row), each fitted to its input; raises
        :class:`RowCheckError` on the first failed column rule (nulls, non-finite values, ragged rows, integer ranges,
        a shape the model's input cannot take)."""
        if stats.get("validation_nulls"):
            raise RowCheckError(
                f"Column {self.validation_col!r} (`validation_col`) has {stats['validation_nulls']} null rows: "
                "expected true (held out for validation) or false (trained on) in every row."
            )
        if stats.get("negative"):
            raise RowCheckError(
                f"Column {self.nonnegative!r} (`sample_weight_col`) has {stats['negative']} negative weights: "
                "expected weights >= 0."
            )
        found = {
            source.name: _column_stats(source, element, i, stats) for i, (source, element) in enumerate(self.columns)
        }
        fields = [_field(p, i, found) for i, p in enumerate(self.planned)]
        return Fields(
            inputs=tuple(f for f in fields if f.role == INPUT),
            targets=tuple(f for f in fields if f.role == TARGET),
            weight=next((f for f in fields if f.role == WEIGHT), None),
            named_inputs=sum(p.role == INPUT for p in self.planned) > 1,
            named_targets=sum(p.role == TARGET for p in self.planned) > 1,
        )

    def judge(self, stats: Mapping[str, Any], num_workers: int) -> Checked:
        """All the fit's rows judged: the counts (a row per worker at least, held-out rows where asked), then
        :meth:`fields`."""
        total, held_out = int(stats["rows"]), int(stats.get("validation_rows") or 0)
        num_rows = _check_counts(total, held_out, num_workers, self.holds_out, self.validation_source)
        return Checked(num_rows, held_out, self.fields(stats))


def column_of(role: str, index: int) -> str:
    """The frame's column of the ``index``-th planned field (inputs, then targets, then the weight)."""
    return {INPUT: f"_sparkdl_input_{index}", TARGET: f"_sparkdl_target_{index}", WEIGHT: "_sparkdl_weight"}[role]


def _check_counts(total: int, held_out: int, num_workers: int, holds_out: bool, source: str) -> int:
    if total == 0:
        raise RowCheckError(EMPTY_INPUT)
    num_rows = total - held_out
    if holds_out:
        if held_out == 0:
            raise RowCheckError(
                f"The validation set is empty: {source} selected none of the {total} rows. "
                "Hold out more rows, or leave validation out."
            )
        if num_rows == 0:
            raise RowCheckError(f"No rows left to train on: {source} selected all {total} rows for validation.")
    if num_rows < num_workers:
        kept = f" (after holding out {held_out} for validation)" if holds_out else ""
        raise RowCheckError(
            f"Expected at least `num_workers`={num_workers} rows so that every worker gets data. "
            f"Received: {num_rows} rows{kept}. Use fewer workers or more data."
        )
    return num_rows


def _field(planned: PlannedField, index: int, found: dict[str, ColumnStats]) -> Field:
    stats = [found[s.name] for s in planned.sources]
    if len(planned.sources) > 1:
        column_shape: tuple[int, ...] = (len(planned.sources),)
    else:
        column_shape = stats[0].shape
    nested = len(column_shape) > 1
    if planned.port is not None:
        try:
            for source, s in zip(planned.sources, stats):
                if source.integer and s.low is not None and s.high is not None:
                    shapes.check_range(f"Column {source.name!r} (`{planned.setting}`)", s.low, s.high, planned.port)
            shape = shapes.fit_shape(planned.what, column_shape, planned.port, nested=nested)
        except ValueError as refused:
            raise RowCheckError(str(refused)) from None
    else:
        shape = column_shape
    return Field(
        planned.role,
        planned.key,
        column_of(planned.role, index),
        tuple(s.name for s in planned.sources),
        shape,
        planned.dtype,
        image=planned.sources[0].kind == IMAGE,
    )


def _column_stats(source: SourceColumn, element: str, i: int, stats: Mapping[str, Any]) -> ColumnStats:
    name = source.name
    if stats[f"nulls_{i}"]:
        raise RowCheckError(
            f"Column {name!r} has {stats[f'nulls_{i}']} null rows: expected no nulls. "
            "Drop or impute them first (e.g. df.dropna(subset=[...]))."
        )
    if source.kind == IMAGE:
        return _image_stats(source, i, stats)
    for level in range(source.depth - 1):
        if stats[f"inner_nulls_{i}_{level}"]:
            raise RowCheckError(
                f"Column {name!r} has {stats[f'inner_nulls_{i}_{level}']} rows with a null array at nesting level "
                f"{level + 2}: expected a full array of values at every level. Drop or repair those rows first."
            )
    if stats[f"bad_{i}"]:
        if source.text:
            raise RowCheckError(
                f"Column {name!r} has {stats[f'bad_{i}']} rows containing null strings: expected a string in every "
                "place. Drop those rows or fill the nulls first (e.g. with ''), whichever the model should see."
            )
        what = (
            "null values"
            if element == "bigint"
            else "NaN, infinite or null values (after conversion to " + element + ")"
        )
        raise RowCheckError(f"Column {name!r} has {stats[f'bad_{i}']} rows containing {what}: expected finite numbers.")
    shape = []
    for level in range(source.depth - 1):
        if level == 0:
            shape.append(_uniform(name, stats[f"outer_min_{i}_0"], stats[f"outer_max_{i}_0"], level + 1))
        shape.append(_uniform(name, stats[f"inner_min_{i}_{level}"], stats[f"inner_max_{i}_{level}"], level + 2))
    if source.depth == 1:
        shape.append(_uniform(name, stats[f"min_width_{i}"], stats[f"max_width_{i}"], 1))
    if source.integer:
        return ColumnStats(tuple(shape), int(stats[f"low_{i}"]), int(stats[f"high_{i}"]))
    return ColumnStats(tuple(shape))


def _uniform(name: str, low: int | None, high: int | None, level: int) -> int:
    where = "" if level == 1 else f" at nesting level {level}"
    if low != high:
        raise RowCheckError(
            f"Column {name!r} is ragged{where}: rows have between {low} and {high} values; "
            "expected the same number of values in every row."
        )
    if low is None or low <= 0:
        raise RowCheckError(f"Column {name!r} holds empty arrays{where}: expected at least one value per row.")
    return int(low)


def _image_stats(source: SourceColumn, i: int, stats: Mapping[str, Any]) -> ColumnStats:
    name = source.name
    if stats[f"modes_{i}"]:
        raise RowCheckError(
            f"Column {name!r} has {stats[f'modes_{i}']} images of a mode other than 8-bit gray, BGR or BGRA "
            f"(OpenCV modes {sorted(IMAGE_MODES)}): expected 8-bit images."
        )
    if stats[f"bad_{i}"]:
        raise RowCheckError(
            f"Column {name!r} has {stats[f'bad_{i}']} images whose data is not height x width x nChannels bytes "
            "(images the source could not decode?): drop them first, e.g. with the image source's dropInvalid=True."
        )
    shape = []
    for field in ("height", "width", "nChannels"):
        low, high = stats[f"min_{field}_{i}"], stats[f"max_{field}_{i}"]
        if low != high:
            raise RowCheckError(
                f"Column {name!r} holds images of different {field}s ({low} to {high}): expected one size for "
                "every image. Resize them first."
            )
        shape.append(int(low))
    return ColumnStats(tuple(shape), 0, 255)
