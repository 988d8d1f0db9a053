"""Validation data (`validation_split`, `validation_col`) in every mode, on real Spark and real Keras."""

import logging
import math

import keras
import numpy as np
import pyarrow as pa
import pytest
from models import make_mlp
from pyspark.sql import functions as F
from spark_jobs import no_spark_job

import sparkdl
from sparkdl import data
from sparkdl.data.rules import RowCheckError
from sparkdl.keras.held_out import in_batches
from sparkdl.modes.average.rounds import Rounds
from sparkdl.modes.base import Settings
from sparkdl.modes.parameter_server.task import combine_histories

METRICS = {"loss", "accuracy", "val_loss", "val_accuracy"}


def held_out(df, seed, **validation):
    """Exactly the rows fit holds out: the same split, re-applied through data.prepare."""
    training = data.prepare(df, make_mlp(), "features", "label", 2, seed=seed, **validation)
    rows = held_out_rows(training)
    x_val, y_val = rows.take(np.arange(len(rows)))
    assert len(x_val) == training.checked.validation_rows
    return training, x_val, y_val


def held_out_rows(training):
    """The held-out rows of ``training`` as a worker holds them: spilled, read back by row number."""
    table = training.frame.where(F.col(data.VALIDATION)).toArrow().drop_columns([data.VALIDATION])
    keyed = table.append_column(data.ROW_KEY, pa.array(range(table.num_rows), pa.int64()))
    rows, _ = data.read_partition(training.rules, keyed.to_batches()).rows(training.checked.fields)
    return rows


def digits_with_held_out(spark, digits, held_out_rows, rows=200):
    x_train, _, y_train, _ = digits
    return spark.createDataFrame(
        [(r.tolist(), int(l), i < held_out_rows) for i, (r, l) in enumerate(zip(x_train[:rows], y_train[:rows]))],
        "features array<float>, label long, held_out boolean",
    )


@pytest.fixture(scope="module")
def small_df(spark, digits):
    return digits_with_held_out(spark, digits, 40).cache()


@pytest.mark.parametrize("mode, options", [("sync", {}), ("async", {}), ("average", {"sync_every": 7})])
def test_validation_split_in_every_mode(digits_df, mode, options):
    epochs, b, seed = 3, 32, 5
    # Adam(0.01): the model is near its plateau by the last epoch, so that async's stale epoch-end snapshots (a worker
    # may finish well before the other on a loaded machine) stay close to the final model.
    model = make_mlp(hidden=(32,), optimizer=keras.optimizers.Adam(0.01))
    result = sparkdl.fit(
        digits_df,
        model,
        num_workers=2,
        mode=mode,
        epochs=epochs,
        batch_size=b,
        seed=seed,
        validation_split=0.2,
        **options,
    )
    training, x_val, y_val = held_out(digits_df, seed, validation_split=0.2)

    assert set(result.history) == METRICS
    assert all(len(v) == epochs and np.isfinite(v).all() for v in result.history.values())
    num_rows = training.checked.num_rows
    assert result.validation_rows == len(x_val) == training.checked.validation_rows
    assert 0.15 < len(x_val) / (len(x_val) + num_rows) < 0.25
    assert result.steps_per_epoch - math.ceil(num_rows / (2 * b)) in (
        0,
        1,
    )  # training rows only (+1: a larger partition)
    assert result.history["val_loss"][-1] < result.history["val_loss"][0]

    want = result.model.evaluate(x_val, y_val, batch_size=256, verbose=0, return_dict=True)
    got = {"loss": result.history["val_loss"][-1], "accuracy": result.history["val_accuracy"][-1]}
    if mode == "async":  # each worker validated the weights it held at its epoch end, not the final server's
        assert abs(got["accuracy"] - want["accuracy"]) < 0.05, (got, want)
        assert abs(got["loss"] - want["loss"]) < 0.5 * want["loss"], (got, want)
    else:  # the final epoch's metrics are the returned model's, on exactly those rows
        assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6), (got, want)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), (got, want)
    if mode == "average":
        assert sum(result.stats["partition_rows"]) == num_rows
        assert sum(result.stats["partition_validation_rows"]) == len(x_val)


def test_held_out_rows_are_evaluated_a_batch_at_a_time_as_keras_cuts_arrays(digits_df):
    training, x_val, y_val = held_out(digits_df, 0, validation_split=0.2)
    batches = in_batches(held_out_rows(training), 16)
    assert len(batches) == math.ceil(len(x_val) / 16) and len(x_val) % 16  # the last batch is shorter
    for i in range(len(batches)):
        x, y = batches[i]
        np.testing.assert_array_equal(x, x_val[i * 16 : (i + 1) * 16])
        np.testing.assert_array_equal(y, y_val[i * 16 : (i + 1) * 16])
    with pytest.raises(IndexError):
        batches[len(batches)]
    model = make_mlp()
    got = model.evaluate(batches, verbose=0, return_dict=True)
    assert got == model.evaluate(x_val, y_val, batch_size=16, verbose=0, return_dict=True)


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_validation_col_rows_are_not_trained_on(small_df, mode):
    b = 16
    options = {"max_staleness": 1} if mode == "ssp" else {}
    result = sparkdl.fit(
        small_df,
        make_mlp(hidden=(16,)),
        num_workers=2,
        mode=mode,
        epochs=2,
        batch_size=b,
        seed=0,
        validation_col="held_out",
        **options,
    )
    assert result.validation_rows == 40
    # 160 training rows over 2 workers: 5 steps of 16 for an even split, 6 for a slightly larger partition;
    # counting the 40 held-out rows would make 7.
    assert result.steps_per_epoch in (math.ceil(160 / (2 * b)), math.ceil(160 / (2 * b)) + 1) and b == 16
    if mode == "ssp":
        assert result.stats["samples"] == 2 * 160  # every training row once per epoch
    assert set(result.history) == METRICS and all(len(v) == 2 for v in result.history.values())


@pytest.mark.parametrize("mode", ["sync", "average"])
def test_a_worker_without_validation_rows(spark, digits, mode):
    """One held-out row: one worker has none. Sync's ring must not deadlock (every rank makes the same
    collective calls) and that worker's stand-in evaluation must weigh nothing."""
    df = digits_with_held_out(spark, digits, 1)
    result = sparkdl.fit(
        df, make_mlp(hidden=(16,)), num_workers=2, mode=mode, epochs=2, batch_size=16, seed=0, validation_col="held_out"
    )
    _, x_val, y_val = held_out(df, 0, validation_col="held_out")
    assert result.validation_rows == len(x_val) == 1
    want = result.model.evaluate(x_val, y_val, verbose=0, return_dict=True)
    assert result.history["val_accuracy"][-1] == pytest.approx(want["accuracy"], abs=1e-6)
    assert result.history["val_loss"][-1] == pytest.approx(want["loss"], rel=1e-4)


def test_a_parameter_server_fit_whose_partitions_hold_no_validation_row_says_so(spark, digits, caplog):
    """Each parameter-server worker judges its own rows: with no row held out anywhere (a validation_col all false),
    the fit trains without val_ metrics and logs why."""
    df = digits_with_held_out(spark, digits, 0, rows=64)
    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        result = sparkdl.fit(
            df, make_mlp(hidden=(8,)), num_workers=2, mode="async", epochs=1, batch_size=16, validation_col="held_out"
        )
    assert result.validation_rows == 0 and not any(name.startswith("val_") for name in result.history)
    assert any("no worker's partition got a validation row" in r.getMessage() for r in caplog.records)


def test_split_is_deterministic_per_seed(digits_df):
    _, x_a, _ = held_out(digits_df, 3, validation_split=0.2)
    _, x_b, _ = held_out(digits_df.repartition(3), 3, validation_split=0.2)  # partitioning does not matter
    _, x_c, _ = held_out(digits_df, 4, validation_split=0.2)
    key = lambda x: sorted(map(bytes, x))
    assert key(x_a) == key(x_b)
    assert key(x_a) != key(x_c)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"validation_col": "held_out", "validation_split": 0.2},
            r"`validation_col` and `validation_split` are mutually exclusive",
        ),
        (
            {"validation_split": 0},
            r"Expected `validation_split` to be a float in \(0, 1\). Received: validation_split=0",
        ),
        (
            {"validation_split": 1.0},
            r"Expected `validation_split` to be a float in \(0, 1\). Received: validation_split=1.0",
        ),
        ({"validation_split": -0.5}, r"Expected `validation_split` to be a float in \(0, 1\)"),
        (
            {"validation_split": "0.2"},
            r"Expected `validation_split` to be a float in \(0, 1\). Received: validation_split='0.2'",
        ),
        ({"validation_split": True}, r"Expected `validation_split` to be a float in \(0, 1\)"),
        ({"validation_col": "nope"}, r"Column 'nope' given as `validation_col` is not in the DataFrame"),
        (
            {"validation_col": "label"},
            r"Expected column 'label' \(`validation_col`\) to be boolean.*Received type: bigint",
        ),
        ({"validation_col": ["held_out"]}, r"Expected `validation_col` to be a column name"),
    ],
)
def test_bad_validation_settings_start_no_job(spark, small_df, kwargs, message):
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        sparkdl.fit(small_df, make_mlp(hidden=(4,)), **kwargs)


@pytest.mark.parametrize(
    "rows, kwargs, message",
    [
        ([True, None, False, False], {"validation_col": "v"}, r"Column 'v' \(`validation_col`\) has 1 null rows"),
        (
            [False, False, False],
            {"validation_col": "v"},
            r"The validation set is empty: `validation_col`='v' selected none of the 3 rows",
        ),
        (
            [False, False, False],
            {"validation_split": 1e-9},
            r"The validation set is empty: `validation_split`=1e-09 selected none",
        ),
        (
            [True, True, True],
            {"validation_col": "v"},
            r"No rows left to train on: `validation_col`='v' selected all 3 rows",
        ),
        (
            [True, True, False],
            {"validation_col": "v"},
            r"at least `num_workers`=2 rows.*Received: 1 rows \(after holding out 2",
        ),
    ],
)
def test_bad_validation_data(spark, rows, kwargs, message):
    df = spark.createDataFrame(
        [([0.1 * i, 0.2], i % 2, v) for i, v in enumerate(rows)], "features array<double>, label int, v boolean"
    )
    with pytest.raises(ValueError, match=message) as raised:
        sparkdl.fit(df, make_mlp(width=2, hidden=(4,), classes=2), num_workers=2, **kwargs)
    assert raised.type is RowCheckError  # the rows' checks, raised by every rank before its first step


def test_average_mode_attributes_each_epoch_to_the_next_averaged_model():
    settings = Settings(rules=None, num_workers=2, epochs=3, batch_size=8, steps_per_epoch=18, seed=0, validate=True)
    job = Rounds(settings, token="t", sync_every=7, first_step=0)
    finished = {r: list(job.epochs_finished(r)) for r in range(8)}
    assert finished == {0: [], 1: [], 2: [0], 3: [], 4: [], 5: [1], 6: [], 7: [2]}  # epoch ends 18, 36, 54
    long_rounds = Rounds(settings, token="t", sync_every=40, first_step=0)  # rounds [0,40) [40,54): epochs 0, 1 / 2
    assert [list(long_rounds.epochs_finished(r)) for r in range(2)] == [[0, 1], [2]]


def test_parameter_server_histories_weigh_validation_by_rows():
    fit = {"first_epoch": 0, "initial_step": 0, "steps_per_epoch": 4}  # trained from the fit's first step
    history = combine_histories(
        [
            {**fit, "history": {"loss": [1.0, 0.5], "val_loss": [2.0, 1.0]}, "samples": [64, 64], "validation_rows": 3},
            {**fit, "history": {"loss": [3.0, 1.5], "val_loss": [4.0, 3.0]}, "samples": [64, 64], "validation_rows": 1},
            {**fit, "history": {"loss": [2.0, 1.0]}, "samples": [64, 64], "validation_rows": 0},  # none held out
        ]
    )
    assert history == {"loss": [2.0, 1.0], "val_loss": [2.5, 1.5]}
