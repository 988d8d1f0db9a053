"""Regression in sync mode on a real regression dataset (scikit-learn's diabetes), with a scalar label and with
multi-output targets as an array column and as an ML Vector column."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparkdl


@pytest.fixture(scope="module")
def diabetes():
    """Standardised features and targets, 80/20: the disease progression and a second target, bmi + s5."""
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    x, y = load_diabetes(return_X_y=True)
    targets = np.stack([y, x[:, 2] + x[:, 8]], axis=1)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    targets = (targets - targets.mean(axis=0)) / targets.std(axis=0)
    return train_test_split(x.astype(np.float32), targets.astype(np.float32), test_size=0.2, random_state=0)


def _frame(spark, x, targets, label):
    from pyspark.ml.linalg import Vectors

    if label == "scalar":
        return spark.createDataFrame(
            [(r.tolist(), float(t[0])) for r, t in zip(x, targets)], "features array<float>, label double"
        )
    if label == "array":
        return spark.createDataFrame(
            [(r.tolist(), t.tolist()) for r, t in zip(x, targets)], "features array<float>, label array<float>"
        )
    return spark.createDataFrame(
        [(r.tolist(), Vectors.dense(t.tolist())) for r, t in zip(x, targets)], ["features", "label"]
    )


@pytest.mark.parametrize("label", ["scalar", "array", "vector"])
def test_regression_beats_the_mean_predictor_on_every_output(spark, diabetes, label):
    """Mean squared error on held-out rows well below that of predicting the training mean, for each output."""
    x_train, x_test, t_train, t_test = diabetes
    outputs = 1 if label == "scalar" else 2
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((10,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(outputs)]
    )
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-2), loss="mse")
    df = _frame(spark, x_train, t_train, label)

    result = sparkdl.fit(df, model, num_workers=2, epochs=15, batch_size=16, seed=0, progress=False)

    assert result.model.output_shape == (None, outputs)
    predicted = result.model.predict(x_test, verbose=0)
    assert predicted.shape == (len(x_test), outputs)
    wanted = t_test[:, :outputs]
    mse = np.mean((predicted - wanted) ** 2, axis=0)
    baseline = np.mean((t_train[:, :outputs].mean(axis=0) - wanted) ** 2, axis=0)
    assert np.all(mse < 0.75 * baseline), (mse, baseline)
    assert result.history["loss"][-1] < result.history["loss"][0]
