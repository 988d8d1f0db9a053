"""Bad input fails on the driver with a message naming the column or setting, before training starts."""

import keras
import pytest
from models import make_mlp
from pyspark.sql import functions as F
from spark_jobs import no_spark_job

import sparkdl
from sparkdl.data.rules import RowCheckError
from sparkdl.ml import KerasEstimator


@pytest.fixture(scope="module")
def frame(spark):
    return spark.createDataFrame(
        [([0.1, 0.2], 1.0, "a", 0), ([0.3, 0.4], 0.0, "b", 1), ([0.5, 0.6], 1.0, "c", 1)],
        "features array<double>, x double, text string, label int",
    )


def small_model(width=2):
    return make_mlp(width=width, hidden=(4,), classes=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"features_col": "nope"}, r"Column 'nope' given as `features_col` is not in the DataFrame"),
        ({"label_col": "missing"}, r"Column 'missing' given as `label_col` is not in the DataFrame"),
        (
            {"features_col": "text"},
            r"Column 'text' \(`features_col`\) holds strings \(string\), but the model's input .* takes numbers",
        ),
        ({"features_col": ["x", "text"]}, r"`features_col` list to be all numbers or all strings"),
        (
            {"features_col": ["x", "features"]},
            r"every column in the `features_col` list to hold one number or string per row; column 'features' is "
            r"array<double>",
        ),
        ({"features_col": []}, r"Expected `features_col` to be a column name or a non-empty list"),
        ({"label_col": "text"}, r"Column 'text' \(`label_col`\) holds strings \(string\): expected numbers as labels"),
        ({"num_workers": 3}, r"num_workers=3, but the cluster runs 2 tasks at once"),
        ({"num_workers": 0}, r"Expected `num_workers` to be a positive integer. Received: num_workers=0"),
        ({"batch_size": 0}, r"Expected `batch_size` to be a positive integer"),
        ({"epochs": 1.5}, r"Expected `epochs` to be a positive integer"),
        (
            {"mode": "bogus"},
            r"Expected `mode` to be one of \['sync', 'sharded', 'async', 'hogwild', 'ssp', 'sync_ps', 'average', "
            r"'pipeline', 'gossip'\]. Received: mode='bogus'",
        ),
        ({"timeout": 0}, r"Expected `timeout` to be a positive number of seconds"),
        ({"seed": -1}, r"Expected `seed` to be a non-negative integer"),
        ({"min_workers": 3}, r"Expected `min_workers` to be an int from 1 to num_workers=2. Received: min_workers=3"),
        (
            {"min_workers": 1},  # sync without checkpoint_dir
            r"go on with fewer workers with min_workers=1 < num_workers=2. Received: mode='sync', where it goes on "
            r"with fewer workers from its newest step checkpoint, and has no checkpoint_dir",
        ),
        (
            {"min_workers": 1, "mode": "sync_ps"},
            r"Received: mode='sync_ps', where every round of sync_ps takes every worker's push of its step",
        ),
        (
            {"min_workers": 1, "mode": "async", "server_placement": "executors"},
            r"Received: mode='async', where with server_placement='executors' its workers and servers are one barrier "
            r"stage",
        ),
        (
            {"min_workers": 1, "mode": "pipeline", "num_stages": 2, "checkpoint_dir": "unused"},
            r"Expected min_workers=1 to leave a number of workers from 1 to 1 that mode='pipeline' can go on with. "
            r"Received: none of them runs \(Expected `num_workers` to be a multiple of num_stages=2",
        ),
        (
            {"min_workers": 1, "mode": "average", "checkpoint_dir": "unused"},
            r"Received: mode='average', where it resumes a step checkpoint on the workers it was taken on only",
        ),
    ],
)
def test_schema_and_setting_errors_start_no_job(spark, frame, kwargs, message):
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        sparkdl.fit(frame, small_model(), **{"features_col": "features", "label_col": "label", **kwargs})


def test_uncompiled_model(spark, frame):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    with no_spark_job(spark), pytest.raises(ValueError, match=r"Expected a compiled model: call model.compile"):
        sparkdl.fit(frame, model)


def test_not_a_keras_model(spark, frame):
    with no_spark_job(spark), pytest.raises(ValueError, match=r"Expected `model` to be a keras.Model.*Received: str"):
        sparkdl.fit(frame, "model.keras")


def test_not_a_dataframe():
    with pytest.raises(ValueError, match=r"Expected `df` to be a pyspark.sql.DataFrame. Received: list"):
        sparkdl.fit([[1.0, 2.0]], small_model())


def test_a_streaming_dataframe_is_refused_before_any_job_by_fit_and_the_estimator(spark):
    ticks = spark.readStream.format("rate").option("rowsPerSecond", 10).load()
    stream = ticks.select(
        F.array(F.col("value").cast("double"), F.lit(1.0)).alias("features"), (F.col("value") % 2).alias("label")
    )
    message = r"Expected `df` to be a batch DataFrame.*streaming.*foreachBatch.*KerasModel.transform"
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        sparkdl.fit(stream, small_model())
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        KerasEstimator(model=small_model(), numWorkers=2).fit(stream)


@pytest.mark.parametrize(
    "rows, schema, features, message",
    [
        ([([0.1, 0.2], 1), (None, 0)], "f array<double>, label int", "f", r"Column 'f' has 1 null rows"),
        (
            [([0.1, 0.2], 1), ([0.1, None], 0)],
            "f array<double>, label int",
            "f",
            r"Column 'f' has 1 rows containing NaN, infinite or null",
        ),
        (
            [([0.1, float("nan")], 1), ([0.1, 0.2], 0)],
            "f array<double>, label int",
            "f",
            r"Column 'f' has 1 rows containing NaN",
        ),
        (
            [([0.1, float("inf")], 1), ([0.1, 0.2], 0)],
            "f array<double>, label int",
            "f",
            r"Column 'f' has 1 rows containing NaN, infinite",
        ),
        (
            [([0.1, 1e300], 1), ([0.1, 0.2], 0)],
            "f array<double>, label int",
            "f",
            r"Column 'f' has 1 rows containing NaN, infinite",
        ),
        (
            [([0.1, 0.2], 1), ([0.1, 0.2, 0.3], 0)],
            "f array<double>, label int",
            "f",
            r"Column 'f' is ragged: rows have between 2 and 3 values",
        ),
        ([([], 1), ([], 0)], "f array<double>, label int", "f", r"Column 'f' holds empty arrays"),
        ([([0.1, 0.2], None), ([0.1, 0.2], 0)], "f array<double>, label int", "f", r"Column 'label' has 1 null rows"),
        (
            [([0.1, 0.2], float("nan")), ([0.1, 0.2], 0.0)],
            "f array<double>, label double",
            "f",
            r"Column 'label' has 1 rows containing NaN",
        ),
        (
            [(0.1, float("nan"), 1), (0.2, 0.3, 0)],
            "a double, b double, label int",
            ["a", "b"],
            r"Column 'b' has 1 rows containing NaN",
        ),
        ([(0.1, None, 1), (0.2, 0.3, 0)], "a double, b double, label int", ["a", "b"], r"Column 'b' has 1 null rows"),
        ([], "f array<double>, label int", "f", r"The DataFrame passed to sparkdl.fit is empty"),
        (
            [([0.1, 0.2], 1)],
            "f array<double>, label int",
            "f",
            r"Expected at least `num_workers`=2 rows.*Received: 1 rows",
        ),
    ],
)
def test_bad_data_is_reported_before_training(spark, rows, schema, features, message):
    df = spark.createDataFrame(rows, schema)
    with pytest.raises(ValueError, match=message) as raised:
        sparkdl.fit(df, small_model(), features_col=features, label_col="label", num_workers=2)
    assert raised.type is RowCheckError  # the rows' checks, raised by every rank before its first step


@pytest.mark.parametrize("package", ["pyspark.ml.linalg", "pyspark.mllib.linalg"])
def test_vector_column_with_nan(spark, package):
    import importlib

    Vectors = importlib.import_module(package).Vectors  # Spark ML's Vector, and the RDD-era MLlib one
    df = spark.createDataFrame(
        [(Vectors.dense([0.1, float("nan")]), 1), (Vectors.sparse(2, [0], [1.0]), 0)], ["vec", "label"]
    )
    with pytest.raises(ValueError, match=r"Column 'vec' has 1 rows containing NaN") as raised:
        sparkdl.fit(df, small_model(), features_col="vec", num_workers=2)
    assert raised.type is RowCheckError
