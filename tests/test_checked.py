"""The checks job's answer is kept with a persisted DataFrame: a later fit asking the same runs no job, and still
refuses bad rows; an unpersisted one is checked every time."""

import pytest
from models import make_mlp
from pyspark.sql import functions as F
from spark_jobs import newest_job_id, no_spark_job

import sparkdl
from sparkdl import data
from sparkdl.data import checked


def _jobs_in(spark, call) -> int:
    before = newest_job_id(spark)
    call()
    return newest_job_id(spark) - before - 1


def test_a_persisted_frame_answers_each_question_once(spark):
    df = spark.createDataFrame([(1.0,), (2.0,), (4.0,)], "x double").cache()
    total = [F.sum("x").alias("total")]
    assert _jobs_in(spark, lambda: checked.aggregate(df, ("total",), lambda: total)) > 0
    with no_spark_job(spark):
        assert checked.aggregate(df, ("total",), lambda: total) == {"total": 7.0}
    assert _jobs_in(spark, lambda: checked.aggregate(df, ("largest",), lambda: [F.max("x").alias("largest")])) > 0
    df.unpersist()
    assert (
        _jobs_in(spark, lambda: checked.aggregate(df, ("total",), lambda: total)) > 0
    )  # not persisted: asked every time
    df.cache()
    assert (
        _jobs_in(spark, lambda: checked.aggregate(df, ("total",), lambda: total)) > 0
    )  # forgotten when it was seen unpersisted


def test_a_frame_that_is_not_persisted_is_checked_at_every_fit(spark):
    df = spark.createDataFrame([(1.0,), (2.0,)], "x double")
    total = [F.sum("x").alias("total")]
    for _ in range(2):
        assert _jobs_in(spark, lambda: checked.aggregate(df, ("total",), lambda: total)) > 0


def test_bad_rows_of_a_persisted_frame_are_refused_at_every_fit_the_second_time_without_a_job(spark):
    rows = [([0.5] * 64, 1), ([float("nan")] + [0.5] * 63, 0)] * 4
    df = spark.createDataFrame(rows, "features array<float>, label long").cache()
    message = r"Column 'features' has 4 rows containing NaN"
    with pytest.raises(ValueError, match=message) as first:
        sparkdl.fit(df, make_mlp(), num_workers=2, progress=False)
    with no_spark_job(spark), pytest.raises(ValueError, match=message) as again:
        sparkdl.fit(df, make_mlp(), num_workers=2, progress=False)
    assert first.type is again.type is ValueError  # the driver's check both times
    df.unpersist()


def test_a_fit_keeps_its_answer_for_the_next_fit_on_the_same_persisted_frame(spark, digits_df):
    result = sparkdl.fit(digits_df, make_mlp(), num_workers=2, epochs=1, batch_size=64, seed=0, progress=False)
    with no_spark_job(spark):  # what the next fit's checks phase does
        training = data.prepare(digits_df, make_mlp(), "features", "label", 2, seed=0)
    assert training.num_rows == digits_df.count() and result.validation_rows == training.validation_rows == 0
