"""Training tasks that read their whole Parquet files themselves, with pyarrow, where Spark would hand them the files'
columns unchanged.

Spark hands a task of ``mapInArrow`` its rows through its row-wise Arrow writer: on a 2-core machine, a worker of
``benchmarks/step_cost.py``'s dense workload received and spilled its 500,000 rows of 100 floats in 2.9 s, and reads
and spills them from the same Parquet files in 1.3 s (pyarrow's read: 0.3-0.4 s). Where a data-parallel fit reads one partition of whole files a worker
(``sparkdl.launch.whole_files``) and every column its workers read is a column of those files, handed on as it is
or, for a number, as a one-value array (what ``sparkdl.data.plan`` makes of a scalar column), each task reads its
partition's files in the order Spark would, a batch of ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows at a
time, and gives each row the key Spark's ``monotonically_increasing_id`` would (its partition and its place there:
``sparkdl.launch.layout``), so a fit resumed mid-epoch finds its rows whichever way they were read. The barrier
stage itself runs over one placeholder row a task.

Only what is exactly the same both ways is read so (:func:`plan_reads`, on the driver, before the stage, which says
why not in the fit's phase line):

- a projection of a Parquet scan with no partition column read, every column the workers read a file column of a
  number, boolean, string or binary type or an array of those, renamed, or its numbers cast where Spark and Arrow
  convert them alike (to a float, or to a wider integer); no value otherwise computed (a Vector, an image's field,
  the checks of an integer column read as floats, ``validation_split``'s hash: Spark computes those);
- files on a filesystem the executors mount (``file:``; ``s3a:``, ``abfss:``, ``hdfs:`` and the like are read through
  Spark, which holds their credentials), whose schema, read on the driver from every file's footer, gives each column
  the type Spark's Arrow conversion gives it.

Spark's metrics of the training stage then count no input rows: the tasks read the files outside Spark
(``benchmarks/passes.py`` says so).
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema

from sparkdl.data import ROW_KEY
from sparkdl.launch.whole_files import PROJECTION_NODES

_PLAIN_TYPES = (T.NumericType, T.BooleanType, T.StringType, T.BinaryType)  # no time zone, precision or calendar
_KEY_SHIFT = 33  # Spark's monotonically_increasing_id: the partition's number in the upper 31 bits


@dataclasses.dataclass(frozen=True)
class FileColumn:
    """A column the tasks hand on, read from a column of the files."""

    name: str  # as the tasks hand it on
    source: str  # the files' column
    wrapped: bool  # each value handed on as a one-value array (``F.array(column)``: a number read as an input)
    # its numbers converted to the type handed on, as Spark's ``Cast`` converts them (:func:`_converts`)
    cast: bool = False


@dataclasses.dataclass(frozen=True)
class ParquetFiles:
    """Each task's Parquet files and how their columns become the rows it hands on (its ``read``)."""

    files: tuple[tuple[str, ...], ...]  # by partition, in the order Spark reads them
    columns: tuple[FileColumn, ...]
    schema: pa.Schema  # the columns as Spark's Arrow conversion hands them on, ``ROW_KEY`` last
    batch_rows: int  # spark.sql.execution.arrow.maxRecordsPerBatch

    def read(self, partition: int) -> Iterator[pa.RecordBatch]:
        """Partition ``partition``'s rows, in batches of the fit's columns and ``ROW_KEY``."""
        place = 0
        sources = list(dict.fromkeys(column.source for column in self.columns))
        for path in self.files[partition]:
            with pq.ParquetFile(path) as file:
                for batch in file.iter_batches(batch_size=self.batch_rows, columns=sources):
                    arrays = [_handed_on(batch.column(c.source), c.wrapped) for c in self.columns]
                    keys = np.arange(place, place + batch.num_rows, dtype=np.int64) + (partition << _KEY_SHIFT)
                    arrays.append(pa.array(keys))
                    # each cast one the driver found Spark's alike (``_converts``), or a rename of list items
                    casts = [array.cast(field.type, safe=False) for array, field in zip(arrays, self.schema)]
                    yield pa.RecordBatch.from_arrays(casts, schema=self.schema)
                    place += batch.num_rows


def _handed_on(array: pa.Array, wrapped: bool) -> pa.Array:
    """A file's column as the frame has it: itself, or each value as a one-value array."""
    if not wrapped:
        return array
    return pa.ListArray.from_arrays(pa.array(np.arange(len(array) + 1, dtype=np.int32)), array)


def plan_reads(frame: DataFrame, files: list[list[str]]) -> ParquetFiles | str:
    """How the tasks read ``frame`` (a projection of files planned as partitions of ``files``, whole) from its
    Parquet files themselves, or why they cannot (for the fit's phase line)."""
    columns = _file_columns(frame._jdf.queryExecution().executedPlan())
    if isinstance(columns, str):
        return columns
    spark = frame.sparkSession
    for field in frame.schema.fields:
        if not _plain(field.dataType):
            return f"its column {field.name!r} holds {field.dataType.simpleString()}"
    for setting in ("spark.sql.files.ignoreCorruptFiles", "spark.sql.files.ignoreMissingFiles"):
        if spark.conf.get(setting, "false") == "true":
            return f"{setting} is set: Spark skips what it cannot read"
    for uri in (uri for partition in files for uri in partition):
        scheme = urllib.parse.urlparse(uri).scheme
        if scheme != "file":
            return f"its files are on {scheme}:, which Spark reads with its own credentials"
    schema = to_arrow_schema(
        frame.schema, prefers_large_types=spark.conf.get("spark.sql.execution.arrow.useLargeVarTypes") == "true"
    )
    paths = [[urllib.parse.unquote(urllib.parse.urlparse(uri).path) for uri in partition] for partition in files]
    for path in (path for partition in paths for path in partition):  # last: a footer read from every file
        why = _differs(path, columns, schema)
        if why is not None:
            return why
    # Spark's own batch size (none where it is not positive, where a whole file is a batch here)
    batch_rows = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch") or 10_000)
    batch_rows = batch_rows if batch_rows > 0 else 1 << 31
    keyed = schema.append(pa.field(ROW_KEY, pa.int64(), nullable=False))
    return ParquetFiles(tuple(tuple(p) for p in paths), columns, keyed, batch_rows)


def _file_columns(plan) -> tuple[FileColumn, ...] | str:
    """The columns of a physical plan that projects a Parquet scan, each a column of its files, or why not."""
    node, projected = plan, None
    while node.getClass().getSimpleName() in PROJECTION_NODES:
        if node.getClass().getSimpleName() == "ProjectExec":
            if projected is not None:
                return "it is projected twice"
            projected = node.projectList()
        node = node.children().apply(0)
    if node.getClass().getSimpleName() != "FileSourceScanExec":
        return "its rows are not a projection of files"
    relation = node.relation()
    if relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat":
        return f"its files are read as {relation.fileFormat().toString()}, not by Spark's plain Parquet reader"
    partition_columns = set(relation.partitionSchema().fieldNames())
    expressions = projected if projected is not None else node.output()
    columns = []
    for i in range(expressions.size()):
        column = _file_column(expressions.apply(i))
        if isinstance(column, str):
            return column
        if column.source in partition_columns:
            return f"its column {column.source!r} is a partition column, named by the files' directories"
        columns.append(column)
    return tuple(columns)


def _file_column(expression) -> FileColumn | str:
    """What ``expression`` reads from the files, or why it computes a value."""
    kind = expression.getClass().getSimpleName()
    if kind == "AttributeReference":
        return FileColumn(expression.name(), expression.name(), False)
    if kind == "Alias":
        child = expression.child()
        wrapped = child.getClass().getSimpleName() == "CreateArray" and child.children().size() == 1
        source = _source(child.children().apply(0) if wrapped else child)
        if source is not None:
            return FileColumn(expression.name(), source[0], wrapped, source[1])
        expression = child
    return f"Spark computes one of the columns read ({expression.sql()})"


def _source(expression) -> tuple[str, bool] | None:
    """The files' column ``expression`` reads, and whether it casts its values (``Cast`` of a column), or None."""
    kind = expression.getClass().getSimpleName()
    if kind == "Cast" and expression.child().getClass().getSimpleName() == "AttributeReference":
        return expression.child().name(), True
    return (expression.name(), False) if kind == "AttributeReference" else None


def _differs(path: str, columns: tuple[FileColumn, ...], schema: pa.Schema) -> str | None:
    """Why a file's columns are not what the tasks hand on (a column missing, of another type), or None."""
    try:
        found = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        return f"the driver cannot read the footer of {path}: {exc}"
    for column in columns:
        if column.source not in found.names:
            return f"its file {path} has no column {column.source!r}"
        read = found.field(column.source).type
        expected = schema.field(column.name).type
        if not _same_values(pa.list_(read) if column.wrapped else read, expected, column.cast):
            verb = "casts it to" if column.cast else "hands it on as"
            return f"its file {path} holds {column.source!r} as {read}, and Spark {verb} {expected}"
    return None


def _same_values(read: pa.DataType, expected: pa.DataType, cast: bool) -> bool:
    """Whether values of type ``read`` become those of ``expected`` alike in Spark and in Arrow (list items' names and
    nullability aside): the same type, or with ``cast`` a conversion both make alike (:func:`_converts`)."""
    if pa.types.is_list(read) or pa.types.is_large_list(read):
        return type(read) is type(expected) and _same_values(read.value_type, expected.value_type, cast)
    return read == expected or (cast and _converts(read, expected))


def _converts(read: pa.DataType, expected: pa.DataType) -> bool:
    """Whether Spark's ``Cast`` and Arrow's unchecked cast give the same values from ``read`` to ``expected``: a
    number to a float (both round to nearest, as the JVM's and the CPU's conversions do; out of a float32's range,
    infinity, which the rows' checks refuse), or a signed integer to a wider one (exact). Others (a float to an integer,
    an integer narrowed: Spark truncates, or wraps, or fails under ANSI mode) are Spark's to compute."""
    if pa.types.is_floating(expected) and expected != pa.float16():
        return pa.types.is_signed_integer(read) or (pa.types.is_floating(read) and read != pa.float16())
    return (
        pa.types.is_signed_integer(read)
        and pa.types.is_signed_integer(expected)
        and read.bit_width <= expected.bit_width
    )


def _plain(data_type: T.DataType) -> bool:
    """Whether Spark's and pyarrow's reading of ``data_type`` are alike: plain values, or arrays of them."""
    while isinstance(data_type, T.ArrayType):
        data_type = data_type.elementType
    return isinstance(data_type, _PLAIN_TYPES) and not isinstance(data_type, T.DecimalType)
