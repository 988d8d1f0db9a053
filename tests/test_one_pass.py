"""A fit reads its input once: the rows' checks are reduced where the training stage reads them, in no job of their
own, and still stop the fit, naming the column, before any rank's first step."""

import logging
import os

import keras
import numpy as np
import pytest
from models import make_mlp

import sparkdl
from sparkdl.data.rules import RowCheckError


def _counted(spark, df):
    """``df`` computed through a function that counts every row it hands on (an accumulator: every task's count
    reaches the driver), and the accumulator."""
    computed = spark.sparkContext.accumulator(0)

    def count(batches):
        for batch in batches:
            computed.add(batch.num_rows)
            yield batch

    return df.mapInArrow(count, df.schema), computed


@pytest.mark.parametrize("mode, options", [("sync", {}), ("async", {}), ("average", {"sync_every": 4})])
def test_a_fit_computes_each_input_row_once(spark, digits_df, mode, options):
    df, computed = _counted(spark, digits_df)
    rows = digits_df.count()
    sparkdl.fit(df, make_mlp(), num_workers=2, mode=mode, epochs=2, batch_size=64, seed=0, progress=False, **options)
    assert computed.value == rows  # was 2x: a checks job over all rows, then the training stage's read


def test_a_bad_row_stops_the_fit_before_any_rank_trains(spark, tmp_path):
    marker = tmp_path / "trained"
    callback = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: marker.touch())
    model = make_mlp(width=2, hidden=(4,), classes=2)
    clean = [([0.1 * (i % 7), 0.2], i % 2) for i in range(40)]
    df = spark.createDataFrame(clean, "f array<double>, label int")
    sparkdl.fit(df, model, features_col="f", num_workers=2, epochs=1, callbacks=[callback], progress=False)
    assert marker.exists()  # the callback runs in the ranks: it would see a step
    marker.unlink()

    bad = spark.createDataFrame(clean + [([0.1, float("nan")], 0)], "f array<double>, label int")
    with pytest.raises(RowCheckError, match=r"^Column 'f' has 1 rows containing NaN"):
        sparkdl.fit(bad, model, features_col="f", num_workers=2, epochs=1, callbacks=[callback], progress=False)
    assert not marker.exists()


def _ids(spark, digits, rows=200, slices=2):
    """Digits whose first feature is the row's id, in ``slices`` partitions of consecutive ids."""
    x_train, _, y_train, _ = digits
    x = np.concatenate([np.arange(rows, dtype=np.float32)[:, None], x_train[:rows]], 1)
    return spark.createDataFrame(
        spark.sparkContext.parallelize([(r.tolist(), int(label)) for r, label in zip(x, y_train[:rows])], slices),
        "features array<float>, label long",
    )


@pytest.mark.parametrize(
    "case, deal",
    [
        ("one a worker", "not shuffled: 2 input partitions, one a worker"),
        ("three", "shuffled: 3 input partitions for 2 workers"),
        ("uneven", "shuffled: the input's 2 partitions hold 40 to 100 training rows"),
        ("coalesced", "shuffled: the input's partitions are made from others (a coalesce, a union) without a shuffle"),
        ("not persisted", "shuffled: the input is not persisted and its rows are not a projection of files"),
        ("files, one a worker", "not shuffled: 2 input partitions, one a worker (bytes of files within 10%)"),
        ("files of uneven sizes", "shuffled: the input's 2 partitions hold"),
        ("files, filtered", "shuffled: the input is not persisted and its rows are not a projection of files"),
        ("a file in two partitions", "shuffled: the input is not persisted and a file is split between partitions"),
    ],
)
def test_an_input_of_even_partitions_one_a_worker_is_read_whole_without_a_shuffle(
    spark, digits, tmp_path, tmp_path_factory, caplog, case, deal
):
    """Each worker trains exactly the rows of its input partition where the input has one per worker, known to be
    within 10% of each other before it is read (persisted: its training rows; whole files: their bytes); other inputs
    are dealt row by row through a shuffle, and the fit's log says why."""
    from pyspark.sql import functions as F
    from test_step_checkpoints import _in_order, _model

    def files(df):
        """``df`` written as Parquet, one file a partition, and read back (not persisted)."""
        table = str(tmp_path_factory.mktemp("table") / "ids")
        df.write.parquet(table)
        return spark.read.parquet(table)

    df = {
        "one a worker": lambda: _ids(spark, digits),
        "three": lambda: _ids(spark, digits, slices=3),
        "uneven": lambda: _ids(spark, digits).where(F.col("features")[0] >= 60),  # partition 0: ids 0..99
        "coalesced": lambda: _ids(spark, digits, slices=4).coalesce(2),
        "not persisted": lambda: _ids(spark, digits),
        "files, one a worker": lambda: files(_ids(spark, digits)),
        "files of uneven sizes": lambda: files(_ids(spark, digits).where(F.col("features")[0] >= 60)),
        "files, filtered": lambda: files(_ids(spark, digits)).where(F.col("label") != 3),
        "a file in two partitions": lambda: files(_ids(spark, digits).coalesce(1)),
    }[case]()
    if case == "a file in two partitions":  # read as two halves of its bytes (a half may hold none of its rows)
        size = sum(os.path.getsize(path.removeprefix("file:")) for path in df.inputFiles())
        spark.conf.set("spark.sql.files.maxPartitionBytes", size // 2 + 1)
        spark.conf.set("spark.sql.files.openCostInBytes", 0)
        spark.conf.set("spark.sql.files.minPartitionNum", 1)
    if case in ("one a worker", "three", "uneven", "coalesced"):
        df = df.cache()
    where = df.select(F.spark_partition_id().alias("p"), F.col("features")[0].cast("int").alias("id")).collect()
    inputs = {p: sorted(row.id for row in where if row.p == p) for p in range(df.rdd.getNumPartitions())}
    try:
        with caplog.at_level(logging.INFO, logger="sparkdl"):
            sparkdl.fit(df, _model(tmp_path), num_workers=2, epochs=1, batch_size=16, seed=0, progress=False)
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
        spark.conf.unset("spark.sql.files.openCostInBytes")
        spark.conf.unset("spark.sql.files.minPartitionNum")
    trained = {partition: sorted(ids) for (_, partition), ids in _in_order(tmp_path).items()}
    (phases,) = [r.getMessage() for r in caplog.records if "sparkdl: phases" in r.getMessage()]
    assert f"rows {deal}" in phases, phases
    if "one a worker" in case:
        assert len(inputs) == 2 and trained == inputs
    else:
        assert sorted(trained[0] + trained[1]) == sorted(r.id for r in where) and trained[0] not in inputs.values()
    df.unpersist()


@pytest.mark.parametrize(
    "rows, schema, message",
    [
        (
            [([0.5, None], 1), ([0.5, 0.5], 0), ([None, float("nan")], 1)],
            "f array<double>, label int",
            "2 rows containing",
        ),
        ([([0.5, float("-inf")], 1), ([0.5, 0.5], 0)], "f array<double>, label int", "1 rows containing NaN"),
        ([([1, None], 1), ([2, 3], 0)], "f array<bigint>, label int", "1 rows containing null values"),
    ],
)
def test_the_driver_s_check_and_the_tasks_judge_a_row_alike(spark, rows, schema, message):
    """``data.prepare`` checks on the driver (one Spark job) what a fit's tasks check as they read: the same counts."""
    from sparkdl import data

    df = spark.createDataFrame(rows, schema)
    model = make_mlp(width=2, hidden=(4,), classes=2)
    with pytest.raises(RowCheckError, match=message) as driver:
        data.prepare(df, model, "f", "label", 2)
    with pytest.raises(RowCheckError, match=message) as tasks:
        sparkdl.fit(df, model, features_col="f", num_workers=2, progress=False)
    assert str(driver.value) == str(tasks.value)
