"""Sync ring-allreduce training through real Spark barrier tasks."""

import keras
import tensorflow as tf
import numpy as np
import pytest

import sparkdl
from sparkdl import data
from frames import digits_frame
from models import make_mlp
from partitions import partitions_as_fit_sees_them, training_stream

pytestmark = pytest.mark.horovod  # the trainer runs on both stacks: Keras 3/PySpark 4 and tf.keras 2.12/PySpark 3.5


def test_digits_two_workers_reach_96_percent(digits_df, digits):
    _, x_test, _, y_test = digits
    model = make_mlp()
    initial = [w.copy() for w in model.get_weights()]

    result = sparkdl.fit(digits_df, model, features_col="features", label_col="label",
                         num_workers=2, mode="sync", epochs=20, batch_size=16, seed=0)

    accuracy = float(np.mean(result.model.predict(x_test, verbose=0).argmax(axis=1) == y_test))
    assert accuracy >= 0.96, accuracy
    assert set(result.history) == {"loss", "accuracy"}
    assert len(result.history["loss"]) == 20
    assert result.history["loss"][-1] < result.history["loss"][0] / 5
    assert result.history["accuracy"][-1] > 0.97
    assert result.num_workers == 2 and result.steps_per_epoch == -(-len(digits[0]) // 32)
    # The trained model is a new object; the caller's model keeps its weights.
    for before, after in zip(initial, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    # Optimizer state comes back too, so training can continue where it stopped.
    assert int(result.model.optimizer.iterations.numpy()) == 20 * result.steps_per_epoch


def test_two_workers_equal_one_worker_with_double_batch(spark, digits):
    """Allreduce SGD is minibatch SGD: N=2 with batch b == 1 process with batch 2b on the same rows."""
    x_train, _, y_train, _ = digits
    x, y = x_train[:128], y_train[:128]
    df = digits_frame(spark, x, y).coalesce(1)
    b, epochs, seed = 8, 3, 7

    model = make_mlp(hidden=(32,), optimizer=tf.keras.optimizers.SGD(0.1), seed=1)
    reference = make_mlp(hidden=(32,), optimizer=tf.keras.optimizers.SGD(0.1), seed=1)
    result = sparkdl.fit(df, model, num_workers=2, epochs=epochs, batch_size=b, seed=seed)

    training = data.prepare(df, "features", "label", 2)
    parts = partitions_as_fit_sees_them(training.frame, 2, 64)
    assert sorted(len(px) for px, _ in parts) == [64, 64]
    steps = result.steps_per_epoch
    assert steps == 128 // (2 * b)
    x_seen, y_seen = training_stream(parts, batch_size=b, steps=steps, epochs=epochs, seed=seed)
    # One pass over the concatenated stream: it already holds every epoch, in order.
    reference.fit(x_seen, y_seen, batch_size=2 * b, epochs=1, shuffle=False, verbose=0)

    moved = False
    for got, want, start in zip(result.model.get_weights(), reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        moved |= not np.allclose(got, start, atol=1e-3)
    assert moved, "training did not change the weights, so the comparison proves nothing"


@pytest.mark.parametrize("layout", ["vector", "columns"])
def test_vector_and_column_list_features(spark, digits, layout):
    from pyspark.ml.feature import VectorAssembler

    x_train, _, y_train, _ = digits
    names = [f"p{i}" for i in range(8)]
    df = spark.createDataFrame([tuple(float(v) for v in r[:8]) + (int(l),) for r, l in zip(x_train[:200], y_train[:200])],
                               names + ["digit"])
    if layout == "vector":
        df = VectorAssembler(inputCols=names, outputCol="vec").transform(df)
        features = "vec"
    else:
        features = names
    result = sparkdl.fit(df, make_mlp(width=8, hidden=(16,)), features_col=features, label_col="digit",
                         num_workers=2, epochs=2, batch_size=25, seed=0)
    assert result.model.input_shape == (None, 8)
    assert len(result.history["loss"]) == 2 and np.isfinite(result.history["loss"]).all()
