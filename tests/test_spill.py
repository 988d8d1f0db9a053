"""A worker's spilled partition: both ways of reading it back give the rows written, and the one for large
partitions keeps the worker's resident set flat. Real files and real system calls; no Spark needed."""

import gc
import os

import keras
import numpy as np
import pytest

from sparkdl.data.fields import INPUT, TARGET, Field
from sparkdl.data.spill import MAPPED_BYTES, FileRows, MappedRows, SpilledRows, mapped_bytes_limit

FIELDS = (
    Field(INPUT, "pixels", "pixels", ("pixels",), (8, 8, 1), "float32"),
    Field(INPUT, "ids", "ids", ("ids",), (), "int64"),
    Field(TARGET, "label", "label", ("label",), (2,), "float64"),
    Field(TARGET, "again", "ids", ("ids",), (), "int64"),  # a second field reading the same column
)


def _written(tmp_path, rows, mapped_bytes, batch=97):
    rng = np.random.default_rng(0)
    expected = {
        "pixels": rng.normal(size=(rows, 8, 8, 1)).astype("float32"),
        "ids": rng.integers(2**53 - 10**6, 2**53, size=rows),
        "label": rng.normal(size=(rows, 2)),
    }
    spilled = SpilledRows(FIELDS, str(tmp_path), mapped_bytes)
    for start in range(0, rows, batch):  # as Arrow batches arrive: several appends
        spilled.append({column: array[start : start + batch] for column, array in expected.items()})
    return spilled.finish(), expected


@pytest.mark.parametrize("mapped_bytes", [MAPPED_BYTES, 0], ids=["mapped", "read by rows"])
def test_rows_come_back_exactly_in_the_order_asked_and_the_file_is_gone(tmp_path, mapped_bytes):
    reader, expected = _written(tmp_path, 1000, mapped_bytes)
    assert os.listdir(tmp_path) == []  # unlinked (and its directory removed) as soon as it was opened
    assert isinstance(reader, MappedRows if mapped_bytes else FileRows) and len(reader) == 1000
    rng = np.random.default_rng(1)
    for index in (
        rng.permutation(1000)[:128],  # a shuffled batch
        np.arange(200, 328),  # a batch without shuffling: one read
        np.arange(1000),  # every row (validation data)
        np.array([5, 6, 7, 3, 999, 0, 1]),
        np.array([4, 4, 4]),  # a filler row repeated
        np.arange(0),
    ):
        got = reader.read(index)
        assert sorted(got) == sorted(expected)
        for column, array in got.items():
            assert array.dtype == expected[column].dtype and array.flags.c_contiguous
            np.testing.assert_array_equal(array, expected[column][index])


@pytest.mark.parametrize("mapped_bytes", [MAPPED_BYTES, 0], ids=["mapped", "read by rows"])
def test_no_rows_read_back_as_empty_arrays_of_each_fields_shape(tmp_path, mapped_bytes):
    reader, _ = _written(tmp_path, 0, mapped_bytes)
    got = reader.read(np.arange(0))
    assert len(reader) == 0 and got["pixels"].shape == (0, 8, 8, 1) and got["ids"].dtype == np.int64


@pytest.mark.parametrize("mapped_bytes", [MAPPED_BYTES, 0], ids=["mapped", "read by rows"])
def test_row_numbers_outside_the_partition_are_an_error(tmp_path, mapped_bytes):
    reader, _ = _written(tmp_path, 10, mapped_bytes)
    for bad in (np.array([10]), np.array([-1]), np.zeros((2, 2), int)):
        with pytest.raises(IndexError, match="within 0..9"):
            reader.read(bad)


def test_a_dropped_reader_closes_its_file(tmp_path):
    reader, _ = _written(tmp_path, 10, 0)
    fd = reader._fd
    os.fstat(fd)
    del reader
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)


def _resident_file_mb():
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["RssFile"].split()[0]) / 1024


@pytest.mark.parametrize("mapped_bytes", [MAPPED_BYTES, 0], ids=["mapped", "read by rows"])
def test_reading_every_row_in_shuffled_batches_maps_the_file_only_when_mapped(tmp_path, mapped_bytes):
    """The resident set grows by the file when mapped (the reason large partitions are read by rows) and not otherwise."""
    rows = 160_000  # 64 float32 values, an int64 and two float64 a row: 44 MB
    reader, _ = _written(tmp_path, rows, mapped_bytes, batch=20_000)
    before = _resident_file_mb()
    for index in np.array_split(np.random.default_rng(2).permutation(rows), rows // 512):
        reader.read(index)
    grown = _resident_file_mb() - before
    if mapped_bytes:
        assert grown > 30, grown
    else:
        assert grown < 4, grown


def test_spark_executor_pyspark_memory_lowers_the_mapped_size(monkeypatch):
    monkeypatch.delenv("PYSPARK_EXECUTOR_MEMORY_MB", raising=False)
    assert mapped_bytes_limit() == MAPPED_BYTES
    monkeypatch.setenv("PYSPARK_EXECUTOR_MEMORY_MB", "512")  # set by Spark from spark.executor.pyspark.memory
    assert mapped_bytes_limit() == 128 << 20
    monkeypatch.setenv("PYSPARK_EXECUTOR_MEMORY_MB", "4096")
    assert mapped_bytes_limit() == MAPPED_BYTES


def test_a_read_partition_holds_none_of_the_arrow_batches_it_read(spark, tmp_path):
    """Arrow reads each batch of a stream into one buffer, so a view of its key column would hold the whole batch:
    once read, a partition keeps its keys (and its rows on disk), none of the batches' memory."""
    import pyarrow as pa
    from pyspark.sql import functions as F

    from sparkdl import data
    from sparkdl._compat import collect_arrow

    x = np.random.default_rng(0).random((20_000, 100), dtype=np.float32)
    df = spark.createDataFrame([(row.tolist(), 1.0) for row in x], "features array<float>, label float")
    model = keras.Sequential([keras.Input((100,)), keras.layers.Dense(1)])
    training = data.plan(df, model, "features", "label").training()
    table = collect_arrow(training.frame.withColumn(data.ROW_KEY, F.monotonically_increasing_id()))
    stream = tmp_path / "batches.arrow"
    with pa.ipc.new_stream(str(stream), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2_000):
            writer.write_batch(batch)
    del table
    before = pa.total_allocated_bytes()
    with pa.ipc.open_stream(pa.OSFile(str(stream))) as reader:
        partition = data.read_partition(training.rules, reader)
    rows, _ = partition.rows(training.rules.fields(partition.stats.values))
    assert len(rows) == 20_000 and len(rows.keys) == 20_000
    assert pa.total_allocated_bytes() - before < 1 << 20  # the batches were 8 MB
