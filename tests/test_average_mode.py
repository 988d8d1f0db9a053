"""mode="average": Spark-native periodic model averaging (broadcast state, accumulate deltas), real Spark + Keras."""

import os

import keras
import numpy as np
from frames import digits_frame
from models import make_mlp
from partitions import epoch_order, partitions_as_fit_sees_them

import sparkdl
from sparkdl import data, schedule
from sparkdl.checkpoint import Checkpoint
from sparkdl.keras import serialization
from sparkdl.launch.layout import TaskLayout
from sparkdl.modes.average import mode as average
from sparkdl.modes.average.mode import AveragePlan
from sparkdl.modes.base import Job, Settings
from sparkdl.progress import ProgressMonitor


def _small_df(spark, digits, rows=128):
    x_train, _, y_train, _ = digits
    return digits_frame(spark, x_train[:rows], y_train[:rows]).coalesce(1)


def run_average(training, *, model_bytes, sync_every, **settings):
    """The average mode on its own, as ``fit`` runs it (``settings``: ``Settings.for_data``'s): model, history, stats."""
    settings = Settings.for_data(training, **settings)
    monitor = ProgressMonitor(epochs=settings.epochs, steps_per_epoch=settings.steps_per_epoch, reporting_ranks=1)
    plan = AveragePlan("average", sync_every)
    result = plan.run(
        Job(
            training=training,
            start=Checkpoint(0, model_bytes, {}, "average"),
            settings=settings,
            plan=plan,
            monitor=monitor,
            layout=TaskLayout.data_parallel(settings.num_workers),
        )
    )
    return result.model, result.history, result.stats


def _state(model):
    return [np.asarray(v.numpy()) for v in list(model.weights) + list(model.optimizer.variables)]


def test_sgd_every_step_equals_sync_mode(spark, digits):
    """Averaging the deltas of one plain-SGD step is averaging the gradients: sync mode's weights."""
    rows, b, epochs, seed = 32, 8, 2, 7  # 2 steps an epoch: each one round of Spark jobs
    df = _small_df(spark, digits, rows)
    make = lambda: make_mlp(hidden=(32,), optimizer=keras.optimizers.SGD(0.1), seed=1)

    synced = sparkdl.fit(df, make(), num_workers=2, mode="sync", epochs=epochs, batch_size=b, seed=seed)
    training = data.prepare(df, make(), "features", "label", 2)
    trained, history, stats = run_average(
        training,
        model_bytes=serialization.model_to_bytes(make()),
        num_workers=2,
        epochs=epochs,
        batch_size=b,
        sync_every=1,
        seed=seed,
        shuffle=True,
        custom_objects=None,
    )
    averaged = trained

    steps = synced.steps_per_epoch
    assert steps == rows // (2 * b)
    assert stats["rounds"] == epochs * steps and stats["contributions"] == 2 * epochs * steps
    assert int(averaged.optimizer.iterations.numpy()) == epochs * steps
    initial = make().get_weights()
    moved = max(float(np.max(np.abs(w - w0))) for w, w0 in zip(synced.model.get_weights(), initial))
    assert moved > 1e-2  # training did something, so equality below is not vacuous
    for got, want in zip(averaged.get_weights(), synced.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert set(history) == set(synced.history) == {"loss", "accuracy"}
    np.testing.assert_allclose(history["loss"], synced.history["loss"], rtol=1e-4)
    np.testing.assert_allclose(history["accuracy"], synced.history["accuracy"], atol=1e-6)


def test_digits_adam_reaches_95_percent(digits_df, digits):
    _, x_test, _, y_test = digits
    epochs, b, sync_every = 12, 16, 23  # 24 rounds, the last one 11 steps
    model = make_mlp()
    training = data.prepare(digits_df, model, "features", "label", 2)
    trained, history, stats = run_average(
        training,
        model_bytes=serialization.model_to_bytes(model),
        num_workers=2,
        epochs=epochs,
        batch_size=b,
        sync_every=sync_every,
        seed=0,
        shuffle=True,
        custom_objects=None,
    )

    accuracy = float(np.mean(trained.predict(x_test, verbose=0).argmax(axis=1) == y_test))
    assert accuracy >= 0.95, accuracy
    steps = schedule.steps_per_epoch(stats["partition_rows"], b)
    assert steps == stats["steps_per_epoch"] == 45
    assert stats["rounds"] == -(-epochs * steps // sync_every)
    assert stats["samples"] == epochs * len(digits[0])  # every row once per epoch
    assert stats["steps"] == epochs * steps * 2
    assert stats["contributions"] == stats["rounds"] * 2
    n_values = sum(w.size for w in _state(trained))
    assert stats["delta_bytes"] == stats["contributions"] * (4 * (n_values - 1) + 8)  # float32s + int64 iteration
    assert len(stats["partition_rows"]) == 2 and sum(stats["partition_rows"]) == len(digits[0])
    assert set(history) == {"loss", "accuracy"} and all(len(v) == epochs for v in history.values())
    assert history["loss"][-1] < history["loss"][0] / 4
    assert history["accuracy"][-1] > 0.97
    assert int(trained.optimizer.iterations.numpy()) == epochs * steps  # Adam's count carried across rounds


def test_rounds_longer_than_an_epoch_match_local_simulation(spark, digits):
    """sync_every=10 over 8-step epochs (24 steps: rounds of 10, 10, 4), Adam state averaged too."""
    df = _small_df(spark, digits)
    b, epochs, seed, sync_every = 8, 3, 3, 10
    make = lambda: make_mlp(hidden=(16,), optimizer=keras.optimizers.Adam(0.01), seed=2)
    training = data.prepare(df, make(), "features", "label", 2)
    trained, history, stats = run_average(
        training,
        model_bytes=serialization.model_to_bytes(make()),
        num_workers=2,
        epochs=epochs,
        batch_size=b,
        sync_every=sync_every,
        seed=seed,
        shuffle=True,
        custom_objects=None,
    )
    steps = 128 // (2 * b)
    assert stats["rounds"] == 3 and stats["steps"] == 2 * epochs * steps and stats["samples"] == 2 * epochs * steps * b

    # The same schedule in this process: two local models, averaged after every round.
    parts = partitions_as_fit_sees_them(training, 2)
    local = make()
    local.optimizer.build(local.trainable_variables)
    variables = list(local.weights) + list(local.optimizer.variables)
    state = [np.array(v.numpy()) for v in variables]
    sums = {}
    for start in range(0, epochs * steps, sync_every):
        new_states = []
        for part in parts:
            px, py = part
            for v, s in zip(variables, state):
                v.assign(s)
            for g in range(start, min(start + sync_every, epochs * steps)):
                epoch, step = divmod(g, steps)
                order = epoch_order(part.keys, seed=seed, epoch=epoch)  # the rule, written out
                index = order[step * len(px) // steps : (step + 1) * len(px) // steps]
                logs = local.train_on_batch(px[index], py[index], return_dict=True)
                sums.setdefault(epoch, []).append(logs["loss"])
            new_states.append([np.array(v.numpy()) for v in variables])
        state = [
            (s + (a.astype(np.float64) - s + b_.astype(np.float64) - s) / 2).astype(s.dtype)
            if s.dtype.kind == "f"
            else s + (a - s + b_ - s) // 2
            for s, a, b_ in zip(state, *new_states)
        ]
    assert len(state) == len(_state(trained))
    for got, want in zip(_state(trained), state):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert int(trained.optimizer.iterations.numpy()) == epochs * steps
    assert all(len(v) == epochs for v in history.values())
    np.testing.assert_allclose(history["loss"], [np.mean(sums[e]) for e in range(epochs)], rtol=1e-4)


def test_failed_attempts_are_not_double_counted(spark, digits, monkeypatch, tmp_path):
    """A task that adds its delta and then fails is retried by Spark; only the successful attempt counts."""
    from pyspark import TaskContext

    master = spark.sparkContext.master
    assert master.startswith("local[") and master.count(",") == 1, f"needs task retries, local[N,F]: {master}"
    df = _small_df(spark, digits, rows=64)
    training = data.prepare(df, make_mlp(hidden=(8,)), "features", "label", 2)
    settings = dict(num_workers=2, epochs=1, batch_size=8, sync_every=2, seed=0, shuffle=True, custom_objects=None)
    model_bytes = serialization.model_to_bytes(make_mlp(hidden=(8,), optimizer=keras.optimizers.SGD(0.1)))
    clean, _, clean_stats = run_average(training, model_bytes=model_bytes, **settings)
    marker = str(tmp_path / "failed-once")

    def fail_after_adding(batches, job, round_index, *args):
        import sparkdl.modes.average.task as on_worker  # the worker's module holds the real task

        rows = list(on_worker.round_task(batches, job, round_index, *args))  # its delta is added by now
        context = TaskContext.get()
        if round_index == 1 and context.partitionId() == 0 and context.attemptNumber() == 0:
            open(marker, "w").close()
            raise RuntimeError("injected failure after the delta was added")
        return iter(rows)

    monkeypatch.setattr(average, "round_task", fail_after_adding)  # pickled by value into the round's closure
    retried, _, retried_stats = run_average(training, model_bytes=model_bytes, **settings)

    assert os.path.exists(marker)  # the first attempt did fail after adding its delta; Spark retried it
    # 64 rows, 2 workers x batch 8: 4 steps in rounds of 2 = 2 rounds x 2 tasks.
    assert clean_stats["contributions"] == retried_stats["contributions"] == 4
    assert retried_stats["samples"] == clean_stats["samples"] == 4 * 2 * 8
    for a, b in zip(clean.get_weights(), retried.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
