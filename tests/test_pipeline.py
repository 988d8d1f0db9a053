"""mode="pipeline" through sparkdl.fit: stages in barrier tasks train the weights one process would, each task holds
only its stage, checkpoints hold the whole model, and what cannot work is refused on the driver."""

import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
from frames import digits_frame
from models import make_mlp
from spark_jobs import no_spark_job

import sparkdl

ROOT = Path(__file__).resolve().parent.parent


def _sgd_mlp():
    return make_mlp(hidden=(32, 16), optimizer=keras.optimizers.SGD(0.1, momentum=0.9), seed=1)


def _optimizer_state(model):
    return [v.numpy() for v in model.optimizer.variables]  # in the model's variables' order (names differ per copy)


@pytest.fixture(scope="module")
def small_df(spark, digits):
    x_train, _, y_train, _ = digits
    return digits_frame(spark, x_train[:480], y_train[:480]).cache()


def test_two_stages_train_the_weights_and_optimizer_state_of_one_process(small_df):
    """Two stage tasks (one replica) against sync mode on one worker, which is one process training the whole
    model on the same batches: SGD with momentum, 4 micro-batches, held-out rows; the weights, the momentum
    and the metrics agree to float rounding, and each stage task held only its own layers."""
    common = dict(epochs=2, batch_size=32, seed=3, progress=False, validation_split=0.2)
    piped = sparkdl.fit(small_df, _sgd_mlp(), mode="pipeline", num_stages=2, micro_batches=4, num_workers=2, **common)
    alone = sparkdl.fit(small_df, _sgd_mlp(), mode="sync", num_workers=1, **common)

    for got, want in zip(piped.model.get_weights(), alone.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    got, want = _optimizer_state(piped.model), _optimizer_state(alone.model)
    assert len(got) == len(want) and int(piped.model.optimizer.iterations.numpy()) == 2 * piped.steps_per_epoch
    for got_state, want_state in zip(got, want):
        np.testing.assert_allclose(got_state, want_state, rtol=1e-5, atol=1e-6)
    assert sorted(piped.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for name, values in alone.history.items():
        np.testing.assert_allclose(piped.history[name], values, rtol=1e-4)

    stats = piped.stats["pipeline"]
    whole = sum(w.nbytes for w in piped.model.get_weights())
    held = [stage["weight_bytes"] for stage in stats["stages"]]
    assert sum(held) == whole and all(0 < part < whole for part in held)  # measured in each stage's own task
    assert [s["parameters"] for s in stats["stages"]] == [64 * 32 + 32, 32 * 16 + 16 + 16 * 10 + 10]
    assert stats["micro_batches"] == 4 and stats["gpipe_bound"] == pytest.approx(1 / 5)
    assert all(0.0 <= s["idle_fraction"] <= 1.0 for s in stats["stages"])


def test_cut_points_name_the_first_layer_of_each_later_stage(small_df):
    model = _sgd_mlp()
    last = model.layers[-1].name
    result = sparkdl.fit(
        small_df, model, mode="pipeline", num_stages=2, cut_points=last, num_workers=2, batch_size=32, progress=False
    )
    assert [s["parameters"] for s in result.stats["pipeline"]["stages"]] == [64 * 32 + 32 + 32 * 16 + 16, 16 * 10 + 10]


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(num_stages=2, num_workers=3), r"Expected `num_workers` to be a multiple of num_stages=2"),
        (dict(num_stages=2, micro_batches=64), r"Expected `micro_batches` to be at most batch_size=32"),
        (dict(num_stages=4), r"(?i)more stages than .*layers|num_stages"),
        (dict(num_stages=2, cut_points="no_such_layer"), r"no_such_layer"),
        (dict(num_stages=2, cut_points=","), r"Expected `cut_points` to be layer names separated by commas"),
        (dict(num_stages=2, cut_points=["dense"]), r"Expected `cut_points` to be layer names separated by commas"),
        (dict(num_stages=1), r"Expected `num_stages` to be an integer >= 2"),
        (dict(micro_batches=2), r"mode='pipeline' needs `num_stages`"),
        (dict(num_stages=2, sample_weight_col="label"), r"mode='pipeline' takes no `sample_weight_col`"),
        (dict(num_stages=2, overlap=False), r"`overlap` applies to mode='sync' or 'sharded' only"),
        (dict(num_stages=2, callbacks=[keras.callbacks.Callback()]), r"`callbacks` run inside Keras's fit"),
    ],
)
def test_what_cannot_work_is_refused_on_the_driver_before_any_job(spark, small_df, settings, message):
    settings = {"num_workers": 2, **settings}
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        sparkdl.fit(small_df, _sgd_mlp(), mode="pipeline", batch_size=32, progress=False, **settings)


def test_a_resumed_pipeline_continues_where_its_checkpoint_left_off(small_df, tmp_path):
    """One epoch saved, then a fit of three resumes from it: the weights of three epochs at once; the checkpoint
    is a whole .keras model with its optimizer state, which Keras loads on its own."""
    common = dict(mode="pipeline", num_stages=2, num_workers=2, batch_size=32, seed=2, progress=False)
    directory = str(tmp_path / "ckpt")
    first = sparkdl.fit(small_df, _sgd_mlp(), epochs=1, checkpoint_dir=directory, **common)
    saved = keras.models.load_model(tmp_path / "ckpt" / "epoch-000001.keras")
    for got, want in zip(saved.get_weights(), first.model.get_weights()):
        np.testing.assert_array_equal(got, want)
    resumed = sparkdl.fit(small_df, _sgd_mlp(), epochs=3, checkpoint_dir=directory, **common)
    straight = sparkdl.fit(small_df, _sgd_mlp(), epochs=3, **common)
    assert resumed.initial_epoch == 1 and len(resumed.history["loss"]) == 3
    assert resumed.history["loss"][0] == first.history["loss"][0]
    for got, want in zip(resumed.model.get_weights(), straight.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


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
