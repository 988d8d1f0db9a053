"""The training tasks read whole Parquet files themselves only where they hand on exactly the rows and keys Spark's
read would: the same values (casts included), the same order, the same ``monotonically_increasing_id``."""

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F

from sparkdl.data import ROW_KEY
from sparkdl.launch.layout import TaskLayout, task_input
from sparkdl.launch.parquet_files import ParquetFiles, plan_reads
from sparkdl.launch.whole_files import read_whole


def _table(rows: int, offset: int) -> pa.Table:
    """Values whose conversions could differ: doubles that round to floats (ties too), beyond a float's range,
    NaN and infinity, integers beyond 2**24, nulls."""
    rng = np.random.default_rng(offset)
    doubles = rng.normal(size=(rows, 3)) * 10.0 ** rng.integers(-40, 40, size=(rows, 3))
    doubles[0] = [1e300, float("nan"), -float("inf")]
    doubles[1] = [1 + 2**-24, 1 + 3 * 2**-24, 2**-149 / 2]  # ties to even, and half the smallest subnormal
    longs = rng.integers(-(2**62), 2**62, size=rows)
    longs[2] = 2**24 + 1
    ints = np.arange(offset, offset + rows, dtype=np.int32)
    return pa.table(
        {
            "x": pa.ListArray.from_arrays(pa.array(np.arange(0, 3 * rows + 1, 3, dtype=np.int32)), doubles.ravel()),
            "n": pa.array(longs, mask=np.arange(rows) % 7 == 3),
            "i": pa.array(ints),
            "s": pa.array([f"row {i}" for i in ints]),
            "d": pa.array(doubles[:, 0]),
        }
    )


@pytest.fixture
def files(spark, tmp_path):
    """Two Parquet files of 300 and 310 rows (several row groups each), read by Spark."""
    for index, rows in enumerate((300, 310)):
        pq.write_table(_table(rows, 1000 * index), str(tmp_path / f"part-{index}.parquet"), row_group_size=128)
    return spark.read.parquet(str(tmp_path))


def test_the_tasks_hand_on_spark_s_values_in_spark_s_order_under_its_keys(spark, files):
    frame = files.select(
        F.col("x").cast("array<float>").alias("features"),  # doubles rounded to floats
        F.array(F.col("n").cast("float")).alias("label"),  # a number wrapped, an integer to a float
        F.array(F.col("i").cast("bigint")).alias("ids"),  # a wider integer
        F.col("s"),
        F.col("d").alias("weight"),
        F.array("x").alias("nested"),  # an array wrapped
    )
    whole = read_whole(frame, 2)
    reads = plan_reads(frame, whole.files)
    assert isinstance(reads, ParquetFiles), reads
    spark_s = task_input(whole.frame, TaskLayout(TaskLayout.data_parallel(2).tasks, by_partition=True)).toArrow()
    ours = pa.Table.from_batches([batch for partition in range(2) for batch in reads.read(partition)])
    assert ours.column_names == spark_s.column_names
    assert ours.num_rows == spark_s.num_rows == 610
    for name in ours.column_names:
        read, expected = ours.column(name).combine_chunks(), spark_s.column(name).combine_chunks()
        assert read.type == expected.type, name
        assert read.null_count == expected.null_count, name
        while pa.types.is_list(read.type):
            assert read.offsets.equals(expected.offsets), name
            read, expected = read.values, expected.values  # NaN equal to NaN below
        assert np.array_equal(
            read.to_numpy(zero_copy_only=False),
            expected.to_numpy(zero_copy_only=False),
            equal_nan=read.type != pa.string(),
        ), name
    keys = ours.column(ROW_KEY).to_numpy()  # Spark's monotonically_increasing_id: partition << 33 | place there
    for partition in (0, 1):
        places = keys[keys >> 33 == partition] & ((1 << 33) - 1)
        assert np.array_equal(places, np.arange(len(places))) and len(places) in (300, 310)


@pytest.mark.parametrize(
    "column, why",
    [
        (
            "CAST(x AS ARRAY<INT>) AS f",
            r"its file .* holds 'x' as list<element: double>, and Spark casts it to .*int32>",
        ),
        ("CAST(n AS INT) AS f", "its file .* holds 'n' as int64, and Spark casts it to int32"),
        ("i + 1 AS f", r"Spark computes one of the columns read \(\(i \+ 1\)\)"),
        ("CAST(d AS DECIMAL(10,2)) AS f", "its column 'f' holds decimal.*"),
        ("coalesce(d, 0D) AS f", r"Spark computes one of the columns read \(coalesce\(d, 0\.0D\)\)"),
    ],
)
def test_what_spark_computes_or_converts_otherwise_is_read_through_spark(spark, files, column, why):
    frame = files.selectExpr(column)
    reads = plan_reads(frame, read_whole(frame, 2).files)
    assert isinstance(reads, str) and re.fullmatch(why, reads), reads


def test_files_of_another_format_are_read_through_spark(spark, tmp_path):
    spark.createDataFrame([(i, float(i)) for i in range(20)], "i int, d double").repartition(2).write.json(
        str(tmp_path / "t")
    )
    frame = spark.read.json(str(tmp_path / "t")).select("d")
    assert (
        plan_reads(frame, read_whole(frame, 2).files)
        == "its files are read as JSON, not by Spark's plain Parquet reader"
    )


def test_a_partition_column_and_skipped_files_are_read_through_spark(spark, tmp_path):
    for part in (0, 1):
        (tmp_path / f"day={part}").mkdir()
        pq.write_table(_table(50, part), str(tmp_path / f"day={part}" / "part.parquet"))
    df = spark.read.parquet(str(tmp_path))
    frame = df.select("i", F.col("day").cast("bigint"))
    assert (
        plan_reads(frame, read_whole(frame, 2).files)
        == "its column 'day' is a partition column, named by the files' directories"
    )
    frame = df.select("i")
    assert isinstance(plan_reads(frame, read_whole(frame, 2).files), ParquetFiles)
    spark.conf.set("spark.sql.files.ignoreCorruptFiles", "true")
    try:
        assert plan_reads(frame, read_whole(frame, 2).files) == (
            "spark.sql.files.ignoreCorruptFiles is set: Spark skips what it cannot read"
        )
    finally:
        spark.conf.unset("spark.sql.files.ignoreCorruptFiles")
