"""A fit reads its input once: the rows' checks are reduced where the training stage reads them, in no job of their
own, and still stop the fit, naming the column, before any rank's first step."""

import collections
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
    ],
)
def test_a_persisted_input_of_even_partitions_one_a_worker_is_read_whole_without_a_shuffle(
    spark, digits, tmp_path, caplog, case, deal
):
    """Each worker trains exactly the rows of its input partition where a persisted input has one per worker, holding
    training rows within 10% of each other; other persisted inputs are dealt row by row through a shuffle, and the
    fit's log says why."""
    from pyspark.sql import functions as F

    df = {
        "one a worker": lambda: _ids(spark, digits),
        "three": lambda: _ids(spark, digits, slices=3),
        "uneven": lambda: _ids(spark, digits).where(F.col("features")[0] >= 60),  # partition 0: ids 0..99
        "coalesced": lambda: _ids(spark, digits, slices=4).coalesce(2),
    }[case]().cache()
    where = df.select(F.spark_partition_id().alias("p"), F.col("features")[0].cast("int").alias("id")).collect()
    inputs = {p: sorted(row.id for row in where if row.p == p) for p in range(df.rdd.getNumPartitions())}
    trained, phases = _trained(df, tmp_path, caplog)
    assert f"rows {deal}" in phases, phases
    if case == "one a worker":
        assert trained == inputs
    else:
        assert sorted(trained[0] + trained[1]) == sorted(r.id for r in where) and trained[0] not in inputs.values()
    df.unpersist()


@pytest.mark.parametrize(
    "case, deal",
    [
        ("two files", "not shuffled: its files read as 2 partitions of whole files (0.0"),
        ("eight files, planned as eight partitions", "not shuffled: its files read as 2 partitions of whole files"),
        ("files of uneven sizes", "shuffled: the input is not persisted and its files pack into 2 partitions of"),
        ("files, filtered", "shuffled: the input is not persisted and its rows are not a projection of files"),
        ("one file", "shuffled: the input is not persisted and it has fewer files (1) than the 2 partitions"),
        ("rows made in Python", "shuffled: the input is not persisted and its rows are not a projection of files"),
    ],
)
def test_files_are_read_whole_one_partition_of_files_a_worker_without_a_shuffle(
    spark, digits, tmp_path, tmp_path_factory, caplog, case, deal
):
    """An unpersisted projection of files is read as one partition of whole files a worker, however many partitions
    Spark would plan them as, where their bytes pack evenly (within 10%): each worker trains the rows of whole files.
    Other inputs are dealt row by row through a shuffle, and the fit's log says why."""
    from pyspark.sql import functions as F

    def files(df):
        """``df`` written as Parquet, one file a partition, and read back."""
        table = str(tmp_path_factory.mktemp("table") / "ids")
        df.write.parquet(table)
        return spark.read.parquet(table)

    df = {
        "two files": lambda: files(_ids(spark, digits)),
        "eight files, planned as eight partitions": lambda: files(_ids(spark, digits, slices=8)),
        "files of uneven sizes": lambda: files(_ids(spark, digits).where(F.col("features")[0] >= 60)),
        "files, filtered": lambda: files(_ids(spark, digits)).where(F.col("label") != 3),
        "one file": lambda: files(_ids(spark, digits).coalesce(1)),
        "rows made in Python": lambda: _ids(spark, digits),
    }[case]()
    by_file = collections.defaultdict(set)
    for row in df.select(F.input_file_name().alias("file"), F.col("features")[0].cast("int").alias("id")).collect():
        by_file[row.file].add(row.id)
    try:
        if case.startswith("eight files"):  # Spark plans each file as a partition of its own: more than the workers
            spark.conf.set("spark.sql.files.maxPartitionBytes", max(map(os.path.getsize, _paths(df))))
            assert df.rdd.getNumPartitions() == 8
        trained, phases = _trained(df, tmp_path, caplog)
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
    assert f"rows {deal}" in phases, phases
    every_row = sorted(i for ids in by_file.values() for i in ids)
    assert sorted(trained[0] + trained[1]) == every_row  # each row once
    whole = [
        all(ids <= set(trained[worker]) for ids in by_file.values() if ids & set(trained[worker])) for worker in (0, 1)
    ]
    assert whole == ([True, True] if deal.startswith("not") else [False, False])


def _paths(df) -> list[str]:
    return [path.removeprefix("file:") for path in df.inputFiles()]


def _trained(df, log_dir, caplog, ordered=False) -> tuple[dict[int, list[int]], str]:
    """The ids each worker trained in a one-epoch fit of ``df``, by partition (sorted, or in the order trained), and
    the fit's phase line."""
    from test_step_checkpoints import _in_order, _model

    with caplog.at_level(logging.INFO, logger="sparkdl"):
        sparkdl.fit(df, _model(log_dir), num_workers=2, epochs=1, batch_size=16, seed=0, progress=False)
    trained = {partition: ids if ordered else sorted(ids) for (_, partition), ids in _in_order(log_dir).items()}
    (phases,) = [r.getMessage() for r in caplog.records if "sparkdl: phases" in r.getMessage()]
    return trained, phases


def _vectors(*rows):
    """Rows of a Vector column ``f`` (Spark ML's ``DenseVector``) and an int ``label``."""
    from pyspark.ml.linalg import Vectors

    return [(None if values is None else Vectors.dense(values), label) for values, label in rows]


@pytest.mark.parametrize(
    "rows, schema, features, message",
    [
        (
            [([0.5, None], 1), ([0.5, 0.5], 0), ([None, float("nan")], 1)],
            "f array<double>, label int",
            "f",
            "2 rows containing",
        ),
        ([([0.5, float("-inf")], 1), ([0.5, 0.5], 0)], "f array<double>, label int", "f", "1 rows containing NaN"),
        ([([1, None], 1), ([2, 3], 0)], "f array<bigint>, label int", "f", "1 rows containing null values"),
        ([([0.5, 0.5], 1), ([0.5], 0), (None, 1)], "f array<double>, label int", "f", "has 1 null rows"),
        ([([1, -(2**25)], 1), ([2, 3], 0)], "f array<bigint>, label int", "f", "up to 33554432 in magnitude"),
        ([([0.5, 0.5], 1), ([0.5], 0), ([0.1, 0.2], 1)], "f array<double>, label int", "f", "is ragged"),
        (_vectors(([0.5, float("inf")], 1), ([0.5, 0.5], 0)), ["f", "label"], "f", "1 rows containing NaN"),
        (_vectors(([0.5, 0.1], 1), (None, 0), ([0.5, 0.5], 0)), ["f", "label"], "f", "has 1 null rows"),
        ([([0.5, 0.5], None), ([0.5, 0.5], 1)], "f array<double>, label int", "f", "Column 'label' has 1 null rows"),
        ([(0.5, float("nan"), 1), (0.5, 0.5, 0)], "a double, b double, label int", ["a", "b"], "Column 'b' has 1"),
    ],
)
def test_the_driver_s_check_and_the_tasks_judge_a_row_alike(spark, rows, schema, features, message):
    """``data.prepare`` checks on the driver (one Spark job) what a fit's tasks check as they read (a column's values
    alone in the tasks' Arrow batches; several columns joined into one input, in the checks column): the same counts."""
    from sparkdl import data

    df = spark.createDataFrame(rows, schema)
    model = make_mlp(width=2, hidden=(4,), classes=2)
    with pytest.raises(RowCheckError, match=message) as driver:
        data.prepare(df, model, features, "label", 2)
    with pytest.raises(RowCheckError, match=message) as tasks:
        sparkdl.fit(df, model, features_col=features, num_workers=2, progress=False)
    assert str(driver.value) == str(tasks.value)


def _rows_read_through_spark(spark, run) -> int:
    """The input rows Spark's stages read from their sources while ``run()`` ran: Spark's own metrics (its status
    store, what its UI shows)."""
    context = spark.sparkContext._jsc.sc()

    def stages():
        context.listenerBus().waitUntilEmpty()
        store = context.statusStore()  # every stage, without details: Scala's defaults, spelt out
        listed = store.stageList(None, False, False, getattr(store, "stageList$default$4")(), None)
        return {(s.stageId(), s.attemptId()): s.inputRecords() for s in (listed.apply(i) for i in range(listed.size()))}

    before = stages()
    run()
    return sum(rows for stage, rows in stages().items() if stage not in before)


@pytest.mark.parametrize(
    "case, read",
    [
        ("as they are", "by the workers, from Parquet"),
        ("a column computed", "through Spark: Spark computes one of the columns read (array(abs(label)))"),
    ],
)
def test_whole_parquet_files_are_read_by_the_workers_themselves_the_rows_and_keys_as_spark_s(
    spark, digits, tmp_path, tmp_path_factory, caplog, case, read
):
    """Where the workers read whole Parquet files' columns as they are, the tasks read the files themselves: Spark's
    own metrics count no row read by the fit's jobs, and each worker trains the rows of the files Spark would give it,
    in the order a fit reading them through Spark trains them (the same keys, hence the same shuffle). A column
    Spark computes is read through Spark, and the phase line says why."""
    from pyspark.sql import functions as F

    table = str(tmp_path_factory.mktemp("table") / "ids")
    _ids(spark, digits).write.parquet(table)
    files = spark.read.parquet(table)
    through_spark = files.withColumn("label", F.abs("label"))  # the same values (0 to 9), computed
    df = files if case == "as they are" else through_spark
    fitted = []
    rows = _rows_read_through_spark(spark, lambda: fitted.extend(_trained(df, tmp_path, caplog, ordered=True)))
    trained, phases = fitted
    assert f"one a worker, {read}" in phases, phases
    if case == "as they are":  # Spark read a placeholder row a task only (the training stage's, the executors' check's)
        assert rows <= 4
    else:
        assert rows >= files.count()
    caplog.clear()
    again, _ = _trained(through_spark, tmp_path_factory.mktemp("again"), caplog, ordered=True)
    assert trained == again  # each worker's ids, in the order it trained them
    assert sorted(again[0] + again[1]) == list(range(200))


def test_a_mode_whose_rounds_read_persisted_rows_reads_whole_files_through_spark(
    spark, digits, tmp_path_factory, caplog
):
    table = str(tmp_path_factory.mktemp("table") / "ids")
    _ids(spark, digits).write.parquet(table)
    with caplog.at_level(logging.INFO, logger="sparkdl"):
        sparkdl.fit(spark.read.parquet(table), make_mlp(width=65), num_workers=2, mode="average", progress=False)
    (phases,) = [r.getMessage() for r in caplog.records if "sparkdl: phases" in r.getMessage()]
    assert "one a worker, through Spark: the mode reads its rows through Spark" in phases, phases
