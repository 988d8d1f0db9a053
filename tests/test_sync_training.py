"""Sync ring-allreduce training through real Spark barrier tasks."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from frames import digits_frame
from models import RecordBatches, make_mlp, recorded_batches

import sparkdl

pytestmark = pytest.mark.horovod  # the trainer runs on both stacks: Keras 3/PySpark 4 and tf.keras 2.12/PySpark 3.5


def test_digits_two_workers_reach_96_percent(digits_df, digits):
    _, x_test, _, y_test = digits
    model = make_mlp()
    initial = [w.copy() for w in model.get_weights()]

    result = sparkdl.fit(
        digits_df,
        model,
        features_col="features",
        label_col="label",
        num_workers=2,
        mode="sync",
        epochs=20,
        batch_size=16,
        seed=0,
    )

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


def _unique_rows(digits, n):
    """The first ``n`` training rows whose pixels differ from every other's, so that a row can be found by its pixels."""
    x_train, _, y_train, _ = digits
    _, first = np.unique(x_train, axis=0, return_index=True)
    keep = np.sort(first)[:n]
    return x_train[keep], y_train[keep]


def _row_indices(batches, x):
    """Which rows of ``x`` each recorded batch holds, in order (-1 for a row that is not in ``x``)."""
    position = {row.tobytes(): i for i, row in enumerate(x)}
    return [np.array([position.get(row.tobytes(), -1) for row in batch]) for batch in batches]


def _recording_mlp(directory, optimizer, seed, *middle):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            RecordBatches(str(directory)),
            *middle,
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("shuffle", [True, False])
def test_two_workers_equal_one_worker_with_double_batch(spark, digits, tmp_path, shuffle):
    """Allreduce SGD is minibatch SGD: N=2 with batch b == 1 process with batch 2b on the rows each rank trained on
    (read back from the workers, not re-derived with the library's own order). Each rank trains on its own half of
    the rows every epoch: reshuffled each epoch with shuffle=True, in one unchanging order with shuffle=False."""
    x, y = _unique_rows(digits, 128)
    df = digits_frame(spark, x, y).coalesce(1)
    b, epochs = 8, 3
    model = _recording_mlp(tmp_path, tf.keras.optimizers.SGD(0.1), 1)
    reference = _recording_mlp(None, tf.keras.optimizers.SGD(0.1), 1)
    result = sparkdl.fit(
        df,
        model,
        num_workers=2,
        epochs=epochs,
        batch_size=b,
        seed=7,
        shuffle=shuffle,
        custom_objects={"RecordBatches": RecordBatches},
    )

    steps = result.steps_per_epoch
    assert steps == 128 // (2 * b)
    seen = [_row_indices(recorded_batches(tmp_path, rank), x) for rank in (0, 1)]
    assert [len(batches) for batches in seen] == [steps * epochs] * 2
    orders = [[np.concatenate(batches[e * steps : (e + 1) * steps]) for e in range(epochs)] for batches in seen]
    halves = [set(order[0].tolist()) for order in orders]
    assert len(halves[0]) == len(halves[1]) == 64 and halves[0] | halves[1] == set(range(128))  # disjoint halves
    for rank_orders, half in zip(orders, halves):
        assert all(set(order.tolist()) == half for order in rank_orders)  # every row of its half, once an epoch
        changed = [not np.array_equal(order, rank_orders[0]) for order in rank_orders[1:]]
        assert changed == [shuffle] * (epochs - 1)

    # The global batch of step s is rank 0's batch s then rank 1's: one process, batch 2b, no shuffling.
    stream = np.concatenate([np.concatenate([seen[0][s], seen[1][s]]) for s in range(steps * epochs)])
    reference.fit(x[stream], y[stream], batch_size=2 * b, epochs=1, shuffle=False, verbose=0)
    moved = False
    for got, want, start in zip(result.model.get_weights(), reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        moved |= not np.allclose(got, start, atol=1e-3)
    assert moved, "training did not change the weights, so the comparison proves nothing"


def test_batchnorm_statistics_are_averaged_over_ranks_and_dropout_trains(spark, digits, tmp_path):
    """BatchNorm right after the input: its moving statistics depend on the rows only, so the test can follow
    each rank's from the batches the rank saw. At each epoch end they are averaged over the ranks (README):
    the result holds the average, which is neither rank's own. Dropout (a different mask per rank) trains
    and the replicas still end identical (fit checks it)."""
    x, y = _unique_rows(digits, 128)
    df = digits_frame(spark, x, y).coalesce(1)
    momentum, b, epochs = 0.5, 8, 2
    model = _recording_mlp(
        tmp_path,
        tf.keras.optimizers.Adam(1e-2),
        2,
        keras.layers.BatchNormalization(momentum=momentum),
        keras.layers.Dropout(0.3),
    )
    result = sparkdl.fit(
        df, model, num_workers=2, epochs=epochs, batch_size=b, seed=3, custom_objects={"RecordBatches": RecordBatches}
    )
    steps = result.steps_per_epoch
    seen = [recorded_batches(tmp_path, rank) for rank in (0, 1)]
    assert [len(batches) for batches in seen] == [steps * epochs] * 2

    def follow(mean, variance, batches):
        for batch in batches:
            batch = batch.astype(np.float64)
            mean = mean * momentum + batch.mean(axis=0) * (1 - momentum)
            variance = variance * momentum + batch.var(axis=0) * (1 - momentum)
        return mean, variance

    averaged = (np.zeros(64), np.ones(64))
    alone = [averaged, averaged]  # each rank's statistics, were they never averaged
    for epoch in range(epochs):
        ends = [follow(*averaged, batches[epoch * steps : (epoch + 1) * steps]) for batches in seen]
        averaged = tuple((a + b_) / 2 for a, b_ in zip(*ends))
        alone = [follow(*own, batches[epoch * steps : (epoch + 1) * steps]) for own, batches in zip(alone, seen)]
    norm = result.model.layers[1]
    assert isinstance(norm, keras.layers.BatchNormalization)
    for got, want, own in zip((norm.moving_mean, norm.moving_variance), averaged, zip(*alone)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
        for rank_value in own:
            assert np.max(np.abs(rank_value - want)) > 1e-2, (
                "the ranks' statistics barely differ: the test proves nothing"
            )
    assert result.history["loss"][-1] < result.history["loss"][0]


@pytest.mark.parametrize("layout", ["vector", "columns"])
def test_vector_and_column_list_features(spark, digits, layout):
    from pyspark.ml.feature import VectorAssembler

    x_train, _, y_train, _ = digits
    names = [f"p{i}" for i in range(8)]
    df = spark.createDataFrame(
        [tuple(float(v) for v in r[:8]) + (int(l),) for r, l in zip(x_train[:200], y_train[:200])], names + ["digit"]
    )
    if layout == "vector":
        df = VectorAssembler(inputCols=names, outputCol="vec").transform(df)
        features = "vec"
    else:
        features = names
    result = sparkdl.fit(
        df,
        make_mlp(width=8, hidden=(16,)),
        features_col=features,
        label_col="digit",
        num_workers=2,
        epochs=2,
        batch_size=25,
        seed=0,
    )
    assert result.model.input_shape == (None, 8)
    assert len(result.history["loss"]) == 2 and np.isfinite(result.history["loss"]).all()
