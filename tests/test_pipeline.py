"""mode="pipeline" through sparkdl.fit: stages in barrier tasks train the weights one process would, each task holds
only its stage, the stages work at once (read from the events their tasks record), checkpoints hold the whole model,
and what cannot work is refused on the driver."""

import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from frames import digits_frame
from models import make_mlp
from partitions import partitions_as_fit_sees_them, training_stream
from pyspark.sql import functions as F
from spark_jobs import no_spark_job

import sparkdl
from sparkdl import data

ROOT = Path(__file__).resolve().parent.parent


def _sgd_mlp():
    return make_mlp(hidden=(32, 16), optimizer=keras.optimizers.SGD(0.1, momentum=0.9), seed=1)


def _optimizer_state(model):
    return [v.numpy() for v in model.optimizer.variables]  # in the model's variables' order (names differ per copy)


@pytest.fixture(scope="module")
def small_df(spark, digits):
    x_train, _, y_train, _ = digits
    return digits_frame(spark, x_train[:480], y_train[:480]).cache()


def _one_process(df, *, epochs, seed, validation_split=None, batch_size=32):
    """Keras alone training ``_sgd_mlp()`` on the batches a pipeline of one replica trains on (its shard's rows in
    the order the fit reads them, each epoch's permutation: ``partitions.training_stream``), evaluating the
    held-out rows after each epoch: the model and its history, as ``fit`` reports one."""
    model = _sgd_mlp()
    training = data.prepare(df, model, "features", "label", 1, validation_split=validation_split, seed=seed)
    parts = partitions_as_fit_sees_them(training, 1)
    steps = -(-len(parts[0][1]) // batch_size)
    x, y, sizes = training_stream(parts, steps=steps, epochs=epochs, seed=seed)
    columns = [field.column for field in training.checked.fields.all]
    held_out = training.frame.filter(F.col(data.VALIDATION)).select(*columns).collect() if validation_split else []
    history: dict[str, list[float]] = {}
    position = 0
    for epoch in range(epochs):
        logs = []
        for size in sizes[epoch * steps : (epoch + 1) * steps]:
            batch = slice(position, position + size)
            logs.append((size, model.train_on_batch(x[batch], y[batch], return_dict=True)))
            position += size
        for name in logs[0][1]:  # the epoch's value: the steps' weighed by their rows
            history.setdefault(name, []).append(sum(n * values[name] for n, values in logs) / sum(n for n, _ in logs))
        if held_out:
            xv, yv = np.array([row[0] for row in held_out], np.float32), np.array([row[1] for row in held_out])
            for name, value in model.evaluate(xv, yv, batch_size=len(yv), verbose=0, return_dict=True).items():
                history.setdefault(f"val_{name}", []).append(value)
    return model, history


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_train_the_weights_and_optimizer_state_of_one_process(small_df, schedule):
    """Two stage tasks (one replica) against Keras in this process training the whole model on the same batches:
    SGD with momentum, 4 micro-batches, held-out rows; the weights, the momentum and the metrics agree to float
    rounding, in either schedule, and each stage task held only its own layers."""
    piped = sparkdl.fit(
        small_df,
        _sgd_mlp(),
        mode="pipeline",
        num_stages=2,
        micro_batches=4,
        schedule=schedule,
        num_workers=2,
        epochs=2,
        batch_size=32,
        seed=3,
        progress=False,
        validation_split=0.2,
    )
    alone, history = _one_process(small_df, epochs=2, seed=3, validation_split=0.2)

    for got, want in zip(piped.model.get_weights(), alone.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    got, want = _optimizer_state(piped.model), _optimizer_state(alone)
    assert len(got) == len(want) and int(piped.model.optimizer.iterations.numpy()) == 2 * piped.steps_per_epoch
    for got_state, want_state in zip(got, want):
        np.testing.assert_allclose(got_state, want_state, rtol=1e-5, atol=1e-6)
    assert sorted(piped.history) == sorted(history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for name, values in history.items():
        np.testing.assert_allclose(piped.history[name], values, rtol=1e-4, err_msg=name)

    stats = piped.stats["pipeline"]
    whole = sum(w.nbytes for w in piped.model.get_weights())
    held = [stage["weight_bytes"] for stage in stats["stages"]]
    assert sum(held) == whole and all(0 < part < whole for part in held)  # measured in each stage's own task
    assert [s["parameters"] for s in stats["stages"]] == [64 * 32 + 32, 32 * 16 + 16 + 16 * 10 + 10]
    assert stats["micro_batches"] == 4 and stats["gpipe_bound"] == pytest.approx(1 / 5)
    assert stats["schedule"] == schedule
    assert all(0.0 <= s["idle_fraction"] <= 1.0 for s in stats["stages"])
    assert "timeline" not in stats  # recorded with profile=True only


@keras.utils.register_keras_serializable(package="sparkdl_tests")
class TakesTime(keras.layers.Layer):
    """Identity whose every training call sleeps ``seconds`` in its forward pass and again in its backward pass:
    a stage whose micro-batches last without using the CPU, so that the machine's other work cannot shorten them."""

    def __init__(self, seconds=0.02, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def _sleep(self, x):
        import time

        time.sleep(self.seconds)
        return x

    def _after_sleep(self, x):
        return tf.ensure_shape(tf.numpy_function(self._sleep, [x], x.dtype, stateful=True), x.shape)

    def call(self, x, training=None):
        if not training:
            return x

        @tf.custom_gradient
        def identity(x):
            return self._after_sleep(x), self._after_sleep

        return identity(x)

    def get_config(self):
        return {**super().get_config(), "seconds": self.seconds}


def _two_slow_halves():
    """Dense layers of 2080, 1056 and 330 parameters; cut at ``slow_b``, each stage holds a ``TakesTime``."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu", name="a"),
            TakesTime(name="slow_a"),
            keras.layers.Dense(32, activation="relu", name="b"),
            TakesTime(name="slow_b"),
            keras.layers.Dense(10, activation="softmax", name="out"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


def test_the_stages_overlap_in_the_events_their_tasks_record(small_df):
    """profile=True: each stage task marks when each micro-batch's forward and backward pass start and end, on its
    own clock (``time.monotonic``: one clock for every process of this host). In most steps of the second epoch,
    stage 1 starts micro-batch 0's forward before stage 0 has ended its last micro-batch's forward, and stage 0
    starts the last micro-batch's backward before stage 1 has ended its backward of micro-batch 0: the stages
    work at once, which a stage waiting for its neighbour's whole batch would never do. ``cut_points`` picks
    the cut (the balanced one would be after layer ``a``)."""
    micro_batches, steps = 4, 8
    result = sparkdl.fit(
        small_df.limit(32 * steps),
        _two_slow_halves(),
        mode="pipeline",
        num_stages=2,
        cut_points=["slow_b"],
        micro_batches=micro_batches,
        num_workers=2,
        batch_size=32,
        epochs=2,
        seed=0,
        progress=False,
        profile=True,
        custom_objects={"TakesTime": TakesTime},
    )
    stats = result.stats["pipeline"]
    assert [s["parameters"] for s in stats["stages"]] == [64 * 32 + 32 + 32 * 32 + 32, 32 * 10 + 10]
    assert result.steps_per_epoch == steps
    timeline = stats["timeline"]
    assert sorted({event["step"] for event in timeline}) == list(range(steps, 2 * steps))  # the last 8 steps
    last, forward_overlaps, backward_overlaps = micro_batches - 1, 0, 0
    for step in range(steps, 2 * steps):
        events = [e for e in timeline if e["step"] == step]
        at = {(e["stage"], e["micro_batch"], e["event"]): e["time"] for e in events}
        assert len(at) == len(events) == 2 * micro_batches * 4
        for stage in (0, 1):  # GPipe's order on each stage: every forward, then every backward, last first
            seen = [
                (e["event"], e["micro_batch"]) for e in sorted(events, key=lambda e: e["time"]) if e["stage"] == stage
            ]
            forward = [(f"forward_{edge}", m) for m in range(micro_batches) for edge in ("start", "end")]
            backward = [(f"backward_{edge}", m) for m in reversed(range(micro_batches)) for edge in ("start", "end")]
            assert seen == forward + backward, (step, stage, seen)
        for m in range(micro_batches):  # one clock: nothing starts on a stage before its input left the other
            assert at[1, m, "forward_start"] > at[0, m, "forward_end"]
            assert at[0, m, "backward_start"] > at[1, m, "backward_end"]
        forward_overlaps += at[1, 0, "forward_start"] < at[0, last, "forward_end"]
        backward_overlaps += at[0, last, "backward_start"] < at[1, 0, "backward_end"]
    # Most steps, not every one: a stage task the busy machine leaves unscheduled for a moment misses the overlap.
    assert forward_overlaps > steps // 2 and backward_overlaps > steps // 2, (forward_overlaps, backward_overlaps)


REFUSED = [
    (dict(num_stages=2, num_workers=3), r"Expected `num_workers` to be a multiple of num_stages=2"),
    (dict(num_stages=2, micro_batches=64), r"Expected `micro_batches` to be at most batch_size=32"),
    (dict(num_stages=4), r"(?i)more stages than .*layers|num_stages"),
    (dict(num_stages=2, cut_points=["no_such_layer"]), r"no_such_layer"),
    (dict(num_stages=2, cut_points="dense"), r"Expected `cut_points` to be a list of layer names"),
    (dict(num_stages=2, cut_points=[""]), r"Expected `cut_points` to be a list of strings"),
    (dict(num_stages=1), r"Expected `num_stages` to be an integer >= 2"),
    (dict(micro_batches=2), r"mode='pipeline' needs `num_stages`"),
    (dict(num_stages=2, sample_weight_col="label"), r"mode='pipeline' takes no `sample_weight_col`"),
    (dict(num_stages=2, overlap=False), r"`overlap` applies to mode='sync' or 'sharded' only"),
    (dict(num_stages=2, profile=1), r"Expected `profile` to be True or False"),
    (dict(num_stages=2, schedule="pipedream"), r"Expected `schedule` to be 'gpipe' or '1f1b'"),
    (dict(num_stages=2, callbacks=[keras.callbacks.Callback()]), r"`callbacks` run inside Keras's fit"),
]


def test_what_cannot_work_is_refused_on_the_driver_before_any_job(spark, small_df):
    with no_spark_job(spark):  # one bracket around every case: two marker jobs in all
        for settings, message in REFUSED:
            with pytest.raises(ValueError, match=message):
                sparkdl.fit(
                    small_df,
                    _sgd_mlp(),
                    mode="pipeline",
                    batch_size=32,
                    progress=False,
                    **{"num_workers": 2, **settings},
                )


def test_a_resumed_pipeline_continues_where_its_checkpoint_left_off(small_df, tmp_path):
    """One epoch saved, then a fit of two resumes from it: the weights of two epochs of Keras in this process; the
    checkpoint is a whole .keras model with its optimizer state, which Keras loads on its own."""
    common = dict(mode="pipeline", num_stages=2, num_workers=2, batch_size=32, seed=2, progress=False)
    directory = str(tmp_path / "ckpt")
    first = sparkdl.fit(small_df, _sgd_mlp(), epochs=1, checkpoint_dir=directory, **common)
    saved = keras.models.load_model(tmp_path / "ckpt" / "epoch-000001.keras")
    for got, want in zip(saved.get_weights(), first.model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    resumed = sparkdl.fit(small_df, _sgd_mlp(), epochs=2, checkpoint_dir=directory, **common)
    straight, history = _one_process(small_df, epochs=2, seed=2)
    assert resumed.initial_epoch == 1 and len(resumed.history["loss"]) == 2
    assert resumed.history["loss"][0] == first.history["loss"][0]
    np.testing.assert_allclose(resumed.history["loss"], history["loss"], rtol=1e-4)
    for got, want in zip(resumed.model.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got_state, want_state in zip(_optimizer_state(resumed.model), _optimizer_state(straight), strict=True):
        np.testing.assert_allclose(got_state, want_state, rtol=1e-5, atol=1e-6)


SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import keras, numpy as np
from pyspark.sql import SparkSession
from frames import digits_frame
from models import make_mlp
from sklearn.datasets import load_digits
import sparkdl

spark = (SparkSession.builder.master("local[4]").config("spark.driver.host", "127.0.0.1")
         .config("spark.ui.enabled", "false").getOrCreate())
x, y = load_digits(return_X_y=True)
df = digits_frame(spark, (x[:400] / 16).astype(np.float32), y[:400]).cache()
mlp = lambda: make_mlp(hidden=(32, 24, 16), optimizer=keras.optimizers.SGD(0.1), seed=4)
common = dict(epochs=2, batch_size=16, seed=1, progress=False)

def same(a, b, what):
    for got, want in zip(a.model.get_weights(), b.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)
    print("same weights:", what, flush=True)

three = sparkdl.fit(df, mlp(), mode="pipeline", num_stages=3, micro_batches=3, num_workers=3, **common)
same(three, sparkdl.fit(df, mlp(), mode="sync", num_workers=1, **common), "3 stages / one process")
grid = sparkdl.fit(df, mlp(), mode="pipeline", num_stages=2, num_workers=4, **common)
same(grid, sparkdl.fit(df, mlp(), mode="sync", num_workers=2, **common), "2 replicas x 2 stages / sync on 2")
"""


@pytest.mark.slow
def test_three_stages_and_two_replicas_of_two_stages_train_what_one_process_and_sync_do(tmp_path):
    """On local[4] (a Spark of its own: more slots than the shared session's): 3 stages equal one process;
    2 data replicas x 2 stages equal sync mode on 2 workers (the replicas average each stage's gradients)."""
    script = tmp_path / "pipeline_grid.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(Path(__file__).parent))))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert "same weights: 3 stages / one process" in done.stdout
    assert "same weights: 2 replicas x 2 stages / sync on 2" in done.stdout
