"""The one Spark job that checks the rows before training: nulls, non-finite values, shapes, integer ranges.

Every column the fit reads adds its aggregates to one ``df.agg``: one pass over the data,
however many columns (none for a persisted DataFrame whose answer is kept, ``sparkdl.data.checked``).
A failed check is a ``ValueError`` naming the column and what was expected.
"""

from __future__ import annotations

import dataclasses

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sparkdl.data import checked
from sparkdl.data.columns import IMAGE, IMAGE_MODES, SourceColumn


@dataclasses.dataclass(frozen=True)
class ColumnStats:
    """What the job learned of one column: one row's shape (uniform over rows) and, for integers, their range."""

    shape: tuple[int, ...]  # () for a number; (values,) for a Vector or flat array; nested sizes; (h, w, c) for images
    low: int | None = None  # smallest and largest value, for integer columns
    high: int | None = None


class Checks:
    """Collects what to check of each column so that all checks run as one Spark job (its aggregates are built
    only when the job runs: a kept answer needs none)."""

    def __init__(self) -> None:
        self._columns: list[tuple[SourceColumn, str]] = []
        self._nonnegative: str | None = None
        self._mask: Column | None = None
        self._validation_col: str | None = None

    def add_column(self, source: SourceColumn, element: str) -> None:
        """Checks ``source`` as its values will be read: cast to ``element`` (``float``, ``double``, ``bigint`` or
        ``string``)."""
        if not any(existing.name == source.name for existing, _ in self._columns):
            self._columns.append((source, element))

    def add_nonnegative(self, name: str) -> None:
        """Counts the rows where number column ``name`` is negative (sample weights)."""
        self._nonnegative = name

    def add_validation(self, mask: Column, column: str | None) -> None:
        """Counts the held-out rows (and, for a ``validation_col``, its nulls) in the same job."""
        self._mask, self._validation_col = mask, column

    def run(self, df: DataFrame) -> tuple[int, int, dict[str, ColumnStats]]:
        """Runs the job: ``(rows, held-out rows, stats by column name)``; raises on the first failed check."""
        # What the aggregates ask, exactly: they are built from these alone (a mask's lambdas get new names each
        # time, so a question with a lambda in its mask is never asked again: it is only answered anew).
        question = (tuple(self._columns), self._nonnegative, None if self._mask is None else str(self._mask))
        stats = checked.aggregate(df, (*question, self._validation_col), self._aggregates)
        if stats.get("validation_nulls"):
            raise ValueError(
                f"Column {self._validation_col!r} (`validation_col`) has {stats['validation_nulls']} null rows: "
                "expected true (held out for validation) or false (trained on) in every row."
            )
        if stats.get("negative"):
            raise ValueError(
                f"Column {self._nonnegative!r} (`sample_weight_col`) has {stats['negative']} negative weights: "
                "expected weights >= 0."
            )
        found = {}
        for i, (source, element) in enumerate(self._columns):
            if stats["rows"]:
                found[source.name] = _column_stats(source, element, i, stats)
        return stats["rows"], stats.get("validation_rows") or 0, found

    def _aggregates(self) -> list[Column]:
        aggs = [F.count(F.lit(1)).alias("rows")]
        for i, (source, element) in enumerate(self._columns):
            aggs += self._column(source, element, i)
        if self._nonnegative is not None:
            aggs.append(F.sum(F.when(F.col(self._nonnegative) < 0, 1).otherwise(0)).alias("negative"))
        if self._mask is not None:
            aggs.append(F.sum(F.when(self._mask, 1).otherwise(0)).alias("validation_rows"))
        if self._validation_col is not None:
            aggs.append(F.sum(F.when(F.col(self._validation_col).isNull(), 1).otherwise(0)).alias("validation_nulls"))
        return aggs

    @classmethod
    def _column(cls, source: SourceColumn, element: str, i: int) -> list[Column]:
        name = F.col(source.name)
        aggs = [F.sum(F.when(name.isNull(), 1).otherwise(0)).alias(f"nulls_{i}")]
        if source.kind == IMAGE:
            return aggs + cls._image(source, i)
        values = source.values(element)
        bad = F.exists(values, lambda x: x.isNull())
        if element not in ("bigint", "string"):
            bad = F.exists(values, lambda x: x.isNull() | F.isnan(x) | (F.abs(x) == float("inf")))
        aggs += [
            F.sum(F.when(bad, 1).otherwise(0)).alias(f"bad_{i}"),
            F.min(F.size(values)).alias(f"min_width_{i}"),
            F.max(F.size(values)).alias(f"max_width_{i}"),
        ]
        for level, arrays in enumerate(source.levels()):
            sizes = F.transform(arrays, lambda a: F.coalesce(F.size(a), F.lit(-1)))
            aggs += [
                F.sum(F.when(F.exists(arrays, lambda a: a.isNull()), 1).otherwise(0)).alias(f"inner_nulls_{i}_{level}"),
                F.min(F.size(arrays)).alias(f"outer_min_{i}_{level}"),
                F.max(F.size(arrays)).alias(f"outer_max_{i}_{level}"),
                F.min(F.array_min(sizes)).alias(f"inner_min_{i}_{level}"),
                F.max(F.array_max(sizes)).alias(f"inner_max_{i}_{level}"),
            ]
        if source.integer:
            aggs += [F.min(F.array_min(values)).alias(f"low_{i}"), F.max(F.array_max(values)).alias(f"high_{i}")]
        return aggs

    @staticmethod
    def _image(source: SourceColumn, i: int) -> list[Column]:
        image = F.col(source.name)
        expected_bytes = image.getField("height") * image.getField("width") * image.getField("nChannels")
        aggs = [
            F.sum(F.when(F.length(image.getField("data")) != expected_bytes, 1).otherwise(0)).alias(f"bad_{i}"),
            F.sum(F.when(~image.getField("mode").isin(*IMAGE_MODES), 1).otherwise(0)).alias(f"modes_{i}"),
        ]
        for field in ("height", "width", "nChannels"):
            aggs += [
                F.min(image.getField(field)).alias(f"min_{field}_{i}"),
                F.max(image.getField(field)).alias(f"max_{field}_{i}"),
            ]
        return aggs


def _column_stats(source: SourceColumn, element: str, i: int, stats: dict) -> ColumnStats:
    name = source.name
    if stats[f"nulls_{i}"]:
        raise ValueError(
            f"Column {name!r} has {stats[f'nulls_{i}']} null rows: expected no nulls. "
            "Drop or impute them first (e.g. df.dropna(subset=[...]))."
        )
    if source.kind == IMAGE:
        return _image_stats(source, i, stats)
    for level in range(source.depth - 1):
        if stats[f"inner_nulls_{i}_{level}"]:
            raise ValueError(
                f"Column {name!r} has {stats[f'inner_nulls_{i}_{level}']} rows with a null array at nesting level "
                f"{level + 2}: expected a full array of values at every level. Drop or repair those rows first."
            )
    if stats[f"bad_{i}"]:
        if source.text:
            raise ValueError(
                f"Column {name!r} has {stats[f'bad_{i}']} rows containing null strings: expected a string in every "
                "place. Drop those rows or fill the nulls first (e.g. with ''), whichever the model should see."
            )
        what = (
            "null values"
            if element == "bigint"
            else "NaN, infinite or null values (after conversion to " + element + ")"
        )
        raise ValueError(f"Column {name!r} has {stats[f'bad_{i}']} rows containing {what}: expected finite numbers.")
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


def _uniform(name: str, low: int, high: int, level: int) -> int:
    where = "" if level == 1 else f" at nesting level {level}"
    if low != high:
        raise ValueError(
            f"Column {name!r} is ragged{where}: rows have between {low} and {high} values; "
            "expected the same number of values in every row."
        )
    if low <= 0:
        raise ValueError(f"Column {name!r} holds empty arrays{where}: expected at least one value per row.")
    return int(low)


def _image_stats(source: SourceColumn, i: int, stats: dict) -> ColumnStats:
    name = source.name
    if stats[f"modes_{i}"]:
        raise ValueError(
            f"Column {name!r} has {stats[f'modes_{i}']} images of a mode other than 8-bit gray, BGR or BGRA "
            f"(OpenCV modes {sorted(IMAGE_MODES)}): expected 8-bit images."
        )
    if stats[f"bad_{i}"]:
        raise ValueError(
            f"Column {name!r} has {stats[f'bad_{i}']} images whose data is not height x width x nChannels bytes "
            "(images the source could not decode?): drop them first, e.g. with the image source's dropInvalid=True."
        )
    shape = []
    for field in ("height", "width", "nChannels"):
        low, high = stats[f"min_{field}_{i}"], stats[f"max_{field}_{i}"]
        if low != high:
            raise ValueError(
                f"Column {name!r} holds images of different {field}s ({low} to {high}): expected one size for "
                "every image. Resize them first."
            )
        shape.append(int(low))
    return ColumnStats(tuple(shape), 0, 255)
