"""Parameter-server (async, hogwild, ssp) and model-averaging modes through sparkdl.fit on real Spark."""

import threading

import keras
import numpy as np
import pytest
from frames import digits_frame
from models import CrashOnFirstAttempt, make_mlp
from partitions import partitions_as_fit_sees_them, training_stream

import sparkdl
from sparkdl import data


def test_async_one_worker_push_every_step_equals_sequential_training(spark, digits):
    """The server applies each pushed gradient with the model's own optimizer: with one worker that is
    exactly plain sequential training."""
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:96], y_train[:96]).coalesce(1)
    b, epochs, seed = 16, 2, 3
    model = make_mlp(hidden=(32,), optimizer=keras.optimizers.Adam(0.01), seed=2)
    reference = make_mlp(hidden=(32,), optimizer=keras.optimizers.Adam(0.01), seed=2)

    result = sparkdl.fit(df, model, num_workers=1, mode="async", push_every=1, epochs=epochs, batch_size=b, seed=seed)

    parts = partitions_as_fit_sees_them(data.prepare(df, reference, "features", "label", 1), 1)
    x_seen, y_seen, _ = training_stream(parts, steps=result.steps_per_epoch, epochs=epochs, seed=seed)
    reference.fit(x_seen, y_seen, batch_size=b, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(result.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(result.model.get_weights()[0], model.get_weights()[0], atol=1e-3)
    assert result.stats["pushes"] == epochs * result.steps_per_epoch
    assert result.stats["pulls"] == result.stats["pushes"] + 1
    assert result.stats["versions"] == [epochs * result.steps_per_epoch]


# Exact updates with plain SGD, whose step is proportional to the gradient (Adam's is not: it would hide a
# gradient summed instead of averaged, a wrong division by the worker count, or a push applied twice). Every
# case trains on full passes over the rows, so that which row lands in which batch cannot matter:
@pytest.mark.parametrize(
    "mode, options, workers, batch_size, learning_rate_factor",
    [
        # one worker, one batch of all 64 rows per push: plain gradient descent
        ("async", {"push_every": 1}, 1, 64, 1.0),
        # one worker, two batches of 32 at the same pulled weights, averaged into one push: the batch of 64
        ("async", {"push_every": 2}, 1, 32, 1.0),
        # hogwild and ssp with one worker: nothing races, so they are async's plain gradient descent too (two
        # shards, each with its own optimizer, step as one)
        ("hogwild", {"push_every": 2, "num_servers": 2}, 1, 32, 1.0),
        ("ssp", {"max_staleness": 0, "num_servers": 2}, 1, 64, 1.0),
        # two workers, one local step each from the same broadcast weights, then the driver averages the weights:
        # the step of the mean over all 64 rows
        ("average", {"sync_every": 1}, 2, 32, 1.0),
    ],
)
def test_plain_sgd_updates_are_exact(spark, digits, mode, options, workers, batch_size, learning_rate_factor):
    x_train, _, y_train, _ = digits
    x, y = x_train[:64], y_train[:64].astype(np.int64)
    df = digits_frame(spark, x, y)
    epochs, learning_rate = 3, 0.5
    model = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(learning_rate), seed=4)
    reference = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(learning_rate * learning_rate_factor), seed=4)

    result = sparkdl.fit(
        df, model, num_workers=workers, mode=mode, epochs=epochs, batch_size=batch_size, seed=1, **options
    )

    assert result.steps_per_epoch == 64 // (workers * batch_size)
    reference.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0)  # 3 steps on all rows at once
    for got, want, start in zip(result.model.get_weights(), reference.get_weights(), model.get_weights()):
        assert not np.allclose(want, start, atol=1e-3)  # the steps are large enough to tell a wrong scale
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_two_async_workers_each_push_is_applied_once_at_full_scale(spark, digits):
    """Two workers push once each (the mean gradient of their 32 rows) and the server applies each push as one
    full optimizer step. Whether the second worker pulled before or after the first push is a race: the result
    must be exactly one of the three histories it allows (a summed, halved or doubled push matches none)."""
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:64], y_train[:64])
    learning_rate = 0.5
    model = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(learning_rate), seed=4)
    start = model.get_weights()

    result = sparkdl.fit(df, model, num_workers=2, mode="async", epochs=1, batch_size=32, seed=1)

    assert result.steps_per_epoch == 1 and result.stats["pushes"] == 2
    (xa, ya), (xb, yb) = partitions_as_fit_sees_them(data.prepare(df, model, "features", "label", 2), 2)
    stepper = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(learning_rate), seed=4)

    def update(weights, x, y):  # one SGD step's change, taken at `weights` on the batch (x, y)
        stepper.set_weights(weights)
        stepper.train_on_batch(x, y.astype(np.int64))
        return [after - before for after, before in zip(stepper.get_weights(), weights)]

    def plus(weights, change):
        return [w + c for w, c in zip(weights, change)]

    a_first, b_first = plus(start, update(start, xa, ya)), plus(start, update(start, xb, yb))
    histories = {
        "both pulled the initial weights": plus(a_first, update(start, xb, yb)),
        "the second worker pulled after the first push": plus(a_first, update(a_first, xb, yb)),
        "the first worker pulled after the second push": plus(b_first, update(b_first, xa, ya)),
    }
    names = list(histories)
    for i, one in enumerate(names):  # the three are told apart by far more than the tolerance below
        for other in names[i + 1 :]:
            assert not all(np.allclose(u, v, atol=1e-4) for u, v in zip(histories[one], histories[other]))
    matched = [
        name
        for name, want in histories.items()
        if all(np.allclose(got, w, rtol=1e-4, atol=1e-5) for got, w in zip(result.model.get_weights(), want))
    ]
    assert len(matched) == 1, "the server's weights match no history of two full-scale pushes"


def test_the_parameter_server_reaches_95_percent_on_digits(digits_df, digits):
    """The parameter-server family's accuracy test (average's is in tests/test_average_mode.py, sync's in
    tests/test_sync_training.py); what each variant counts is checked on fewer rows below."""
    _, x_test, _, y_test = digits
    result = sparkdl.fit(digits_df, make_mlp(), num_workers=2, mode="async", epochs=15, batch_size=16, seed=0)
    accuracy = float(np.mean(result.model.predict(x_test, verbose=0).argmax(axis=1) == y_test))
    assert accuracy >= 0.95, accuracy
    assert len(result.history["loss"]) == 15 and result.history["loss"][-1] < result.history["loss"][0]


@pytest.mark.parametrize(
    "mode, options",
    [
        ("async", {}),
        ("hogwild", {"num_servers": 2}),
        ("ssp", {"max_staleness": 2}),
        ("async", {"push_every": 2, "num_servers": 3}),
        ("average", {"sync_every": 10}),
    ],
)
def test_every_mode_trains_every_row_once_per_epoch_and_counts_its_pushes(spark, digits, mode, options):
    x_train, _, y_train, _ = digits
    rows, epochs = 320, 2
    df = digits_frame(spark, x_train[:rows], y_train[:rows])
    result = sparkdl.fit(df, make_mlp(), num_workers=2, mode=mode, epochs=epochs, batch_size=16, seed=0, **options)
    assert len(result.history["loss"]) == epochs and np.isfinite(result.history["loss"]).all()
    assert result.stats["samples"] == epochs * rows  # every row once per epoch
    if mode == "ssp":
        # Instrumented on the server: no pull was ever granted to a worker more than s pushes ahead.
        assert result.stats["max_staleness"] <= 2
    if mode != "average":
        # Gradients accumulate across epoch boundaries; the remainder is pushed at the end.
        pushes = -(-epochs * result.steps_per_epoch // options.get("push_every", 1)) * 2
        assert result.stats["pushes"] == pushes
        assert result.stats["versions"] == [pushes] * options.get("num_servers", 1)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ps-")], "server threads left running"


def test_worker_killed_mid_training_is_retried_and_the_job_completes(spark, digits_df, digits):
    """Partition 0's Python worker dies hard in its first attempt, in its 30th step; Spark retries the task, which
    rejoins the still-running server (its earlier pushes are kept) at the step after the last one the server applied,
    and the job finishes as well trained as without the fault."""
    _, x_test, _, y_test = digits
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            CrashOnFirstAttempt(partition=0, at_call=30),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    result = sparkdl.fit(
        digits_df,
        model,
        num_workers=2,
        mode="async",
        epochs=10,
        batch_size=16,
        seed=0,
        custom_objects={"CrashOnFirstAttempt": CrashOnFirstAttempt},
    )

    planned = 10 * result.steps_per_epoch * 2
    assert result.stats["resumed_at"]["workers"] == [29, 0]  # the retry's first step: the lost attempt applied 0..28
    assert result.stats["pushes"] == planned - 29  # the successful attempts' counters
    assert result.stats["versions"][0] == planned  # every step applied once: the lost attempt's 29, the others
    accuracy = float(np.mean(result.model.predict(x_test, verbose=0).argmax(axis=1) == y_test))
    assert accuracy >= 0.95, accuracy


def test_server_is_stopped_when_fit_raises_and_next_fit_works(spark, digits):
    x_train, _, y_train, _ = digits
    # Labels 1..10 for a 10-class softmax: the workers' loss fails on label 10.
    shifted = spark.createDataFrame(
        [(r.tolist(), int(l) + 1) for r, l in zip(x_train[:200], y_train[:200])], "features array<float>, label long"
    )
    with pytest.raises(Exception, match="label value of 10"):
        sparkdl.fit(shifted, make_mlp(hidden=(8,)), num_workers=2, mode="async", epochs=1, batch_size=16, timeout=60)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ps-")], "server threads left running"
    result = sparkdl.fit(
        shifted.where("label < 10"), make_mlp(hidden=(8,)), num_workers=2, mode="async", epochs=1, batch_size=16
    )
    assert len(result.history["loss"]) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "async", "features_col": "nope"}, r"Column 'nope' given as `features_col` is not in the DataFrame"),
        ({"mode": "ssp"}, r"mode='ssp' needs `max_staleness`"),
        ({"mode": "async", "max_staleness": 2}, r"`max_staleness` applies to mode='ssp' only.*mode='async'"),
        ({"mode": "sync", "push_every": 2}, r"`push_every` applies to mode='async' or 'hogwild' or 'ssp' only"),
        (
            {"mode": "average", "num_servers": 2},
            r"`num_servers` applies to mode='async' or 'hogwild' or 'ssp' or 'sync_ps' only",
        ),
        ({"mode": "async", "sync_every": 5}, r"`sync_every` applies to mode='average' only"),
        ({"mode": "hogwild", "push_every": 0}, r"Expected `push_every` to be a positive integer"),
        ({"mode": "ssp", "max_staleness": -1}, r"Expected `max_staleness` to be a non-negative integer"),
        ({"mode": "async", "num_servers": 7}, r"Expected `num_servers` <= the model's 6 trainable variables"),
        ({"mode": "average", "num_workers": 3}, r"num_workers=3, but the cluster runs 2 tasks at once"),
    ],
)
def test_bad_settings_in_every_mode(digits_df, kwargs, message):
    with pytest.raises(ValueError, match=message):
        sparkdl.fit(digits_df, make_mlp(), **{"epochs": 1, **kwargs})


def test_nulls_are_reported_in_async_mode_too(spark):
    df = spark.createDataFrame([([0.1, 0.2], 1), (None, 0)], "features array<double>, label int")
    with pytest.raises(ValueError, match=r"Column 'features' has 1 null rows"):
        sparkdl.fit(df, make_mlp(width=2, hidden=(4,), classes=2), mode="async")
