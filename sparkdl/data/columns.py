"""What a DataFrame column holds, read from its schema alone: a number or string, a Vector, (nested) arrays, or an image.

Each kind turns into one flat Arrow list per row of a chosen element type (``values``): the
workers reshape it to the model's input shape. Integers stay integers (``bigint``) so that ids
travel exactly; floats become ``float`` or ``double``; strings stay strings (their UTF-8 bytes, for
string inputs). An image (Spark's ``image`` source struct) travels as its raw ``data`` bytes and is
decoded on the workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

SCALAR, VECTOR, ARRAY, IMAGE = "scalar", "vector", "array", "image"

# The fields of Spark's image source (``spark.read.format("image")``), and the OpenCV modes of 8-bit
# images it writes: CV_8UC1, CV_8UC3 (BGR), CV_8UC4 (BGRA).
IMAGE_FIELDS = {"origin", "height", "width", "nChannels", "mode", "data"}
IMAGE_MODES = {0: 1, 16: 3, 24: 4}
# Spark's Vector types (pyspark.ml's, and pyspark.mllib's before it), known by their JVM classes: importing
# pyspark.ml to compare with its classes would load all of Spark ML, pandas and SciPy (most of a second) with
# sparkdl, in the driver and in every executor's Python. A DataFrame with a Vector column has loaded them.
VECTOR_UDTS = {"org.apache.spark.ml.linalg.VectorUDT", "org.apache.spark.mllib.linalg.VectorUDT"}


@dataclasses.dataclass(frozen=True)
class SourceColumn:
    """One column of the user's DataFrame, as sparkdl reads it."""

    name: str
    kind: str  # SCALAR, VECTOR, ARRAY or IMAGE
    depth: int  # array nesting: 0 for a number, 1 for a Vector or array, 2 for array<array<...>>, ...
    integer: bool  # holds whole numbers exactly (integral or boolean types)
    type_name: str  # the Spark type, for messages
    size: int | None = None  # a Vector's size, where its ML attributes give it (VectorAssembler writes them)
    text: bool = False  # holds strings (a string column, or (nested) arrays of strings)

    @property
    def holds(self) -> str:
        """What its values are, for messages: ``strings``, ``integers`` or ``floats``."""
        return "strings" if self.text else "integers" if self.integer else "floats"

    def values(self, element: str) -> Column:
        """The row's values as one flat ``array<element>`` (row-major); for an image, its bytes."""
        column = F.col(self.name)
        if self.kind == IMAGE:
            return column.getField("data")
        if self.kind == VECTOR:
            from pyspark.ml.functions import vector_to_array  # Spark ML, loaded only where a Vector is read

            # null for a null row, which the checks count: vector_to_array refuses a null
            return F.when(column.isNotNull(), vector_to_array(column, "float64" if element == "double" else "float32"))
        if self.kind == SCALAR:
            return F.array(column.cast(element))
        for _ in range(self.depth - 1):
            column = F.flatten(column)
        return column.cast(f"array<{element}>")

    def nested(self, element: str) -> Column:
        """The row's values keeping their nesting (``transform`` checks each batch's shape itself); an image whole."""
        if self.kind == ARRAY and self.depth > 1:
            return F.col(self.name).cast("array<" * self.depth + element + ">" * self.depth)
        return F.col(self.name) if self.kind == IMAGE else self.values(element)

    def levels(self) -> list[Column]:
        """For nested arrays, the arrays of every level below the top (``array<array<...>>``), outermost first."""
        column, found = F.col(self.name), []
        for _ in range(self.depth - 1):
            found.append(column)
            column = F.flatten(column)
        return found


def inspect(df: DataFrame, name: str, setting: str) -> SourceColumn:
    """The column ``name`` of ``df``, checked against the schema; ``setting`` names the argument for errors."""
    if not isinstance(name, str) or name not in df.columns:
        raise ValueError(
            f"Column {name!r} given as `{setting}` is not in the DataFrame. Available columns: {df.columns}"
        )
    data_type = df.schema[name].dataType
    type_name = data_type.simpleString()
    if isinstance(data_type, T.UserDefinedType) and data_type.scalaUDT() in VECTOR_UDTS:
        return SourceColumn(name, VECTOR, 1, False, type_name, _vector_size(df.schema[name]))
    if isinstance(data_type, T.StructType) and {f.name for f in data_type.fields} >= IMAGE_FIELDS:
        return SourceColumn(name, IMAGE, 3, True, type_name)
    depth, element = 0, data_type
    while isinstance(element, T.ArrayType):
        depth, element = depth + 1, element.elementType
    if isinstance(element, (T.NumericType, T.BooleanType)):
        integer = isinstance(element, (T.IntegralType, T.BooleanType))
        return SourceColumn(name, ARRAY if depth else SCALAR, depth, integer, type_name)
    if isinstance(element, (T.StringType, T.CharType, T.VarcharType)):
        return SourceColumn(name, ARRAY if depth else SCALAR, depth, False, type_name, text=True)
    raise ValueError(
        f"Expected column {name!r} (`{setting}`) to be numeric, a string, an ML Vector, a (nested) array of numbers "
        f"or strings, or an image (Spark's image source). Received type: {type_name}"
    )


def _vector_size(field: T.StructField) -> int | None:
    """A Vector column's size from its ML attributes (``ml_attr.num_attrs`` in the column's metadata, which
    Spark ML's VectorAssembler, OneHotEncoder and the like write), or None where the schema does not say."""
    size = (field.metadata or {}).get("ml_attr", {}).get("num_attrs")
    return size if isinstance(size, int) and size >= 0 else None


def features_array(df: DataFrame, features_col: str | Sequence[str]) -> tuple[Column, list[str]]:
    """``features_col`` (a column, or a list of number columns) as one flat ``array<float>``, with the names it reads.

    Checks the schema only (no Spark job) and raises ``ValueError`` naming the column.
    """
    if isinstance(features_col, str):
        return _numeric(inspect(df, features_col, "features_col")).values("float"), [features_col]
    names = list(features_col) if isinstance(features_col, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(
            "Expected `features_col` to be a column name or a non-empty list of column names. "
            f"Received: {features_col!r}"
        )
    sources = [_numeric(inspect(df, name, "features_col")) for name in names]
    for source in sources:
        if source.kind != SCALAR:
            raise ValueError(
                f"Expected every column in the `features_col` list to be numeric; column {source.name!r} is "
                f"{source.type_name}. Pass a vector or array column on its own instead."
            )
    return F.concat(*(s.values("float") for s in sources)), names


def _numeric(source: SourceColumn) -> SourceColumn:
    if source.text:
        raise ValueError(
            f"Column {source.name!r} (`features_col`) holds strings ({source.type_name}), but the features here are "
            "numbers (array<float>). Index or encode it first (pyspark.ml.feature.StringIndexer, OneHotEncoder), or "
            "give it to a model with a string input (keras.Input(shape=(1,), dtype='string')) through sparkdl.fit."
        )
    return source


def features_column(df: DataFrame, features_col: str | Sequence[str]) -> Column:
    """The features as one ``array<float>`` column: ``features_col`` flattened, row-major.

    ``features_col`` is a Vector, (nested) number array or number column, or a list of number
    columns (their values in list order). The schema is checked at once (no Spark job); a missing
    or unsupported column is a ``ValueError`` naming it. For example, the width of the features
    and the number of classes, in one job::

        row = df.agg(F.max(F.size(sparkdl.features_column(df, ["x1", "x2"]))), F.max("label")).first()
    """
    return features_array(df, features_col)[0]
