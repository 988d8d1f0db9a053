"""From a Spark DataFrame to float32 numpy batches on each worker.

The driver checks the columns (schema first, then one aggregate job for
nulls, non-finite values and ragged widths) so that bad data fails with a
clear message before the training stage starts. Workers receive Arrow record
batches holding two fixed-width ``array<float>`` columns and turn them into
numpy arrays without ever building Python ``Row`` objects.

Validation rows: with ``validation_col`` or ``validation_split`` the prepared
frame carries a third, boolean column (``VALIDATION``) saying which rows are
held out; the same aggregate job counts them, and ``ColumnShapes.split_numpy``
gives a worker its training and held-out rows separately. The random split
(``validation_split_mask``) is a seeded hash of each row's converted features
and label, not ``F.rand``: it selects the same rows whatever the DataFrame's
partitioning or row order (so a recomputed partition, a retried task or the
driver's count can never disagree with the workers), at the price that
identical rows always land on the same side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.mllib.linalg import VectorUDT as MLlibVectorUDT
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

FEATURES = "_sparkdl_features"
LABEL = "_sparkdl_label"
VALIDATION = "_sparkdl_validation"  # boolean; only present when rows are held out for validation

ColumnSpec = str | Sequence[str]

_NUMERIC_TYPES = (T.NumericType, T.BooleanType)


@dataclasses.dataclass(frozen=True)
class ColumnShapes:
    """What a worker needs to turn its Arrow batches into arrays (small and picklable, unlike a DataFrame)."""

    feature_width: int
    label_width: int
    label_is_scalar: bool

    def to_numpy(self, batches: Iterable[pa.RecordBatch]) -> tuple[np.ndarray, np.ndarray]:
        """A partition as ``(x, y)`` float32 arrays; scalar labels come out 1-D, as Keras losses expect."""
        x, y = arrow_to_numpy(batches, self.feature_width, self.label_width)
        return x, (y.reshape(-1) if self.label_is_scalar else y)

    def split_numpy(self, batches: Iterable[pa.RecordBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A partition as ``(x, y, x_val, y_val)``: its training rows and its held-out validation rows.

        Without a ``VALIDATION`` column every row is a training row (``x_val`` has no rows).
        """
        train, held_out = [], []
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if VALIDATION not in batch.schema.names:
                train.append(batch)
                continue
            mask = batch.column(VALIDATION)
            train.append(batch.filter(pc.invert(mask)))
            held_out.append(batch.filter(mask))
        x, y = self.to_numpy(train)
        x_val, y_val = self.to_numpy(held_out)
        return x, y, x_val, y_val


@dataclasses.dataclass(frozen=True)
class TrainingData:
    """A validated DataFrame reduced to the columns the workers read (two, three with held-out rows)."""

    frame: DataFrame  # columns FEATURES and LABEL, both array<float>, and VALIDATION (boolean) when rows are held out
    num_rows: int  # rows to train on (held-out validation rows not included)
    shapes: ColumnShapes
    validation_rows: int = 0  # rows held out for validation (VALIDATION true)


def prepare(
    df: DataFrame,
    features_col: ColumnSpec,
    label_col: str,
    num_workers: int,
    *,
    validation_col: str | None = None,
    validation_split: float | None = None,
    seed: int = 0,
) -> TrainingData:
    """Validates ``df`` and returns the float32 array columns to train on: :func:`plan`, then its ``check``."""
    return plan(
        df, features_col, label_col, validation_col=validation_col, validation_split=validation_split, seed=seed
    ).check(num_workers)


def plan(
    df: DataFrame,
    features_col: ColumnSpec,
    label_col: str,
    *,
    validation_col: str | None = None,
    validation_split: float | None = None,
    seed: int = 0,
) -> TrainingPlan:
    """Checks the columns against ``df``'s schema, on the driver and without a Spark job; ``check()`` checks the rows.

    ``validation_col`` (a boolean column) or ``validation_split`` (a fraction, selected by
    ``validation_split_mask`` with ``seed``) holds rows out for validation: the frame then has a
    ``VALIDATION`` column, ``num_rows`` counts the training rows only and ``validation_rows`` the
    others. Raises ``ValueError`` naming the offending column and what was expected.
    """
    feature_parts = _feature_columns(df, features_col)
    label_expr, label_is_scalar = _float_array(df, label_col, "label_col")
    features_expr = feature_parts[0][1] if len(feature_parts) == 1 else F.concat(*(expr for _, expr in feature_parts))
    if validation_col is not None and validation_split is not None:
        raise ValueError(
            "`validation_col` and `validation_split` are mutually exclusive: pass one of them. "
            f"Received: validation_col={validation_col!r}, validation_split={validation_split!r}"
        )
    mask = None
    if validation_col is not None:
        mask = _boolean_column(df, validation_col)
    elif validation_split is not None:
        mask = validation_split_mask(features_expr, label_expr, validation_split, seed)
    source = (
        f"`validation_col`={validation_col!r}"
        if validation_col is not None
        else f"`validation_split`={validation_split!r}"
    )
    return TrainingPlan(
        df, feature_parts, features_expr, label_col, label_expr, label_is_scalar, mask, validation_col, source
    )


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
    """Columns that passed the schema checks, and the expressions that turn them into the training columns."""

    df: DataFrame
    feature_parts: list  # (column name, float array expression) per features column
    features_expr: Column
    label_col: str
    label_expr: Column
    label_is_scalar: bool
    mask: Column | None  # true for the rows held out for validation
    validation_col: str | None
    validation_source: str  # how the held-out rows were chosen, as the error messages name it

    def check(self, num_workers: int) -> TrainingData:
        """Checks the rows (one aggregate Spark job) and returns the columns to train on."""
        checks = _Checks()
        for name, expr in self.feature_parts:
            checks.add_column(name, expr)
        checks.add_column(self.label_col, self.label_expr)
        if self.mask is not None:
            checks.add_validation(self.mask, self.validation_col)
        stats = checks.run(self.df)

        total = stats["rows"]
        if total == 0:
            raise ValueError("The DataFrame passed to sparkdl.fit is empty: expected at least one row per worker.")
        held_out = stats.get("validation_rows") or 0
        num_rows = total - held_out
        if self.mask is not None:
            if held_out == 0:
                raise ValueError(
                    f"The validation set is empty: {self.validation_source} selected none of the "
                    f"{total} rows. Hold out more rows, or leave validation out."
                )
            if num_rows == 0:
                raise ValueError(
                    f"No rows left to train on: {self.validation_source} selected all {total} rows for validation."
                )
        if num_rows < num_workers:
            kept = f" (after holding out {held_out} for validation)" if self.mask is not None else ""
            raise ValueError(
                f"Expected at least `num_workers`={num_workers} rows so that every worker gets data. "
                f"Received: {num_rows} rows{kept}. Use fewer workers or more data."
            )
        widths = checks.widths(stats)
        feature_width = sum(widths[name] for name, _ in self.feature_parts)
        columns = [self.features_expr.alias(FEATURES), self.label_expr.alias(LABEL)]
        if self.mask is not None:
            columns.append(self.mask.alias(VALIDATION))
        return TrainingData(
            self.df.select(*columns),
            num_rows,
            ColumnShapes(feature_width, widths[self.label_col], self.label_is_scalar),
            held_out,
        )


def validation_split_mask(features: Column, label: Column, fraction: float, seed: int) -> Column:
    """True for the rows a ``validation_split`` of ``fraction`` holds out: a seeded random selection.

    Each row's converted features and label (the ``array<float>`` expressions), hashed with
    ``seed``, give a number uniform in [0, 1); rows below ``fraction`` are held out. The choice
    depends on the row's values only, never on partitioning or order, so it is the same in the
    driver's count, in every (retried) task and when recomputed later; identical rows share it.
    """
    hashed = F.xxhash64(F.lit(int(seed)), features, label)
    uniform = F.shiftrightunsigned(hashed, 11).cast("double") / float(1 << 53)
    return uniform < F.lit(float(fraction))


def _boolean_column(df: DataFrame, name: str) -> Column:
    if not isinstance(name, str) or name not in df.columns:
        raise ValueError(
            f"Column {name!r} given as `validation_col` is not in the DataFrame. Available columns: {df.columns}"
        )
    data_type = df.schema[name].dataType
    if not isinstance(data_type, T.BooleanType):
        raise ValueError(
            f"Expected column {name!r} (`validation_col`) to be boolean (true: hold the row out for "
            f"validation). Received type: {data_type.simpleString()}"
        )
    return F.col(name)


def features_array(df: DataFrame, features_col: ColumnSpec) -> tuple[Column, list[str]]:
    """``features_col`` as one ``array<float>`` expression, with the names of the columns it reads.

    Accepts what ``fit`` accepts (a Vector, ``array<numeric>`` or numeric column, or a list of numeric
    columns, whose values then appear in list order, one per column). Checks the schema only (no Spark
    job) and raises ``ValueError`` naming the column.
    """
    parts = _feature_columns(df, features_col)
    expr = parts[0][1] if len(parts) == 1 else F.concat(*(e for _, e in parts))
    return expr, [name for name, _ in parts]


def features_column(df: DataFrame, features_col: ColumnSpec) -> Column:
    """The features as ``sparkdl.fit`` reads them: ``features_col`` as one ``array<float>`` column.

    ``features_col`` is what ``fit`` takes: a Vector, ``array<numeric>`` or numeric column, or a list
    of numeric columns (their values in list order). The schema is checked at once (no Spark job);
    a missing or unsupported column is a ``ValueError`` naming it. For example, the width of the
    features and the number of classes, in one job::

        row = df.agg(F.max(F.size(sparkdl.features_column(df, ["x1", "x2"]))), F.max("label")).first()
    """
    return features_array(df, features_col)[0]


def _feature_columns(df: DataFrame, features_col: ColumnSpec) -> list[tuple[str, Column]]:
    if isinstance(features_col, str):
        return [(features_col, _float_array(df, features_col, "features_col")[0])]
    names = list(features_col) if isinstance(features_col, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(
            "Expected `features_col` to be a column name or a non-empty list of column names. "
            f"Received: {features_col!r}"
        )
    parts = []
    for name in names:
        expr, is_scalar = _float_array(df, name, "features_col")
        if not is_scalar:
            raise ValueError(
                f"Expected every column in the `features_col` list to be numeric; column {name!r} is "
                f"{df.schema[name].dataType.simpleString()}. Pass a vector or array column on its own instead."
            )
        parts.append((name, expr))
    return parts


def _float_array(df: DataFrame, name: str, setting: str) -> tuple[Column, bool]:
    """The column as an ``array<float>`` expression, and whether it was a scalar."""
    if name not in df.columns:
        raise ValueError(
            f"Column {name!r} given as `{setting}` is not in the DataFrame. Available columns: {df.columns}"
        )
    data_type = df.schema[name].dataType
    column = F.col(name)
    if isinstance(data_type, (VectorUDT, MLlibVectorUDT)):
        return vector_to_array(column, "float32"), False
    if isinstance(data_type, T.ArrayType) and isinstance(data_type.elementType, _NUMERIC_TYPES):
        return column.cast("array<float>"), False
    if isinstance(data_type, _NUMERIC_TYPES):
        return F.array(column.cast("float")), True
    raise ValueError(
        f"Expected column {name!r} (`{setting}`) to be numeric, an ML Vector or an array of numbers. "
        f"Received type: {data_type.simpleString()}"
    )


class _Checks:
    """Collects per-column aggregates so that all checks run as one Spark job."""

    def __init__(self) -> None:
        self._aggs: list[Column] = [F.count(F.lit(1)).alias("rows")]
        self._columns: list[str] = []
        self._validation_col: str | None = None

    def add_column(self, name: str, expr: Column) -> None:
        i = len(self._columns)
        self._columns.append(name)
        bad_value = F.exists(expr, lambda x: x.isNull() | F.isnan(x) | (F.abs(x) == float("inf")))
        self._aggs += [
            F.sum(F.when(F.col(name).isNull(), 1).otherwise(0)).alias(f"nulls_{i}"),
            F.sum(F.when(bad_value, 1).otherwise(0)).alias(f"bad_{i}"),
            F.min(F.size(expr)).alias(f"min_width_{i}"),
            F.max(F.size(expr)).alias(f"max_width_{i}"),
        ]

    def add_validation(self, mask: Column, column: str | None) -> None:
        """Counts the held-out rows (and, for a ``validation_col``, its nulls) in the same job."""
        self._validation_col = column
        self._aggs.append(F.sum(F.when(mask, 1).otherwise(0)).alias("validation_rows"))
        if column is not None:
            self._aggs.append(F.sum(F.when(F.col(column).isNull(), 1).otherwise(0)).alias("validation_nulls"))

    def run(self, df: DataFrame) -> dict:
        row = df.agg(*self._aggs).first()
        assert row is not None, "an aggregate without grouping returns one row"
        stats = row.asDict()
        if stats.get("validation_nulls"):
            raise ValueError(
                f"Column {self._validation_col!r} (`validation_col`) has {stats['validation_nulls']} null rows: "
                "expected true (held out for validation) or false (trained on) in every row."
            )
        for i, name in enumerate(self._columns):
            if stats[f"nulls_{i}"]:
                raise ValueError(
                    f"Column {name!r} has {stats[f'nulls_{i}']} null rows: expected no nulls. "
                    "Drop or impute them first (e.g. df.dropna(subset=[...]))."
                )
            if stats[f"bad_{i}"]:
                raise ValueError(
                    f"Column {name!r} has {stats[f'bad_{i}']} rows containing NaN, infinite or null values "
                    "(after conversion to float32): expected finite numbers."
                )
            low, high = stats[f"min_width_{i}"], stats[f"max_width_{i}"]
            if stats["rows"] and low != high:
                raise ValueError(
                    f"Column {name!r} is ragged: rows have between {low} and {high} values; "
                    "expected the same number of values in every row."
                )
            if stats["rows"] and low == 0:
                raise ValueError(f"Column {name!r} holds empty vectors: expected at least one value per row.")
        return stats

    def widths(self, stats: dict) -> dict[str, int]:
        return {name: stats[f"min_width_{i}"] for i, name in enumerate(self._columns)}


def row_counts(batches: Iterable[pa.RecordBatch]) -> tuple[int, int]:
    """A partition's ``(training rows, held-out validation rows)``, without converting any values."""
    train = held_out = 0
    for batch in batches:
        validation = (pc.sum(batch.column(VALIDATION)).as_py() or 0) if VALIDATION in batch.schema.names else 0
        train += batch.num_rows - validation
        held_out += validation
    return train, held_out


def arrow_to_numpy(
    batches: Iterable[pa.RecordBatch], feature_width: int, label_width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates a partition's record batches into ``(x, y)`` float32 arrays."""
    xs, ys = [], []
    for batch in batches:
        if batch.num_rows == 0:
            continue
        xs.append(_fixed_width(batch.column(FEATURES), feature_width))
        ys.append(_fixed_width(batch.column(LABEL), label_width))
    if not xs:
        return np.empty((0, feature_width), np.float32), np.empty((0, label_width), np.float32)
    return np.concatenate(xs), np.concatenate(ys)


def _fixed_width(column: pa.Array, width: int) -> np.ndarray:
    values = column.flatten().to_numpy(zero_copy_only=False)
    return values.astype(np.float32, copy=False).reshape(-1, width)
