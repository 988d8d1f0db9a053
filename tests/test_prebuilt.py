"""The driver builds the result's model while the tasks train: it ends as ``load_model`` would have left it."""

import keras
import numpy as np

from sparkdl.keras import serialization
from sparkdl.keras.prebuilt import PrebuiltModel


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(), keras.layers.Dense(3)]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
    return model


def _trained(model) -> bytes:
    model.fit(np.random.rand(64, 8), np.random.rand(64, 3), epochs=2, verbose=0)
    return serialization.model_to_bytes(model)


def _state(model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in model.weights + model.optimizer.variables]


def test_the_prebuilt_model_takes_the_trained_variables_as_load_model_reads_them():
    model = _model()
    prebuilt = PrebuiltModel(serialization.model_to_bytes(model), None, timeout=60)
    trained = _trained(model)
    got, want = prebuilt.trained(trained), serialization.model_from_bytes(trained)
    assert int(got.optimizer.iterations.numpy()) == int(want.optimizer.iterations.numpy()) == 4
    for a, b in zip(_state(got), _state(want), strict=True):  # Adam's moments and BatchNorm's statistics too
        np.testing.assert_array_equal(a, b)
    assert got.get_config() == want.get_config() and got.compiled


def test_a_model_whose_config_changed_while_training_is_loaded_whole():
    model = _model()
    model.layers[0].trainable = False
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    prebuilt = PrebuiltModel(serialization.model_to_bytes(model), None, timeout=60)
    model.layers[0].trainable = True  # as a callback unfreezing a layer would
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    got = prebuilt.trained(_trained(model))
    assert got.layers[0].trainable
    assert len(got.trainable_weights) == len(model.trainable_weights)
