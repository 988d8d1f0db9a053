"""Small real Keras models shared by the tests."""

import keras
import tensorflow as tf


def make_mlp(width=64, hidden=(128, 64), classes=10, optimizer=None, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(h, activation="relu") for h in hidden]
        + [keras.layers.Dense(classes, activation="softmax")]
    )
    model.compile(
        optimizer=optimizer or tf.keras.optimizers.Adam(1e-3),  # on Keras 2.12, keras.optimizers.Adam is legacy
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


@keras.utils.register_keras_serializable(package="sparkdl_tests")
class CrashOnFirstAttempt(keras.layers.Layer):
    """Identity layer that kills its Python worker hard (os._exit) at a given training step,
    on the first attempt of one Spark task only: a worker lost mid-epoch."""

    def __init__(self, partition=0, at_call=5, **kwargs):
        super().__init__(**kwargs)
        self.partition = partition
        self.at_call = at_call
        self._calls = 0

    def _maybe_crash(self, x):
        import os

        from pyspark import TaskContext

        self._calls += 1
        context = TaskContext.get()
        if (context is not None and context.partitionId() == self.partition and context.attemptNumber() == 0
                and self._calls == self.at_call):
            os._exit(1)
        return x

    def call(self, x, training=None):
        import tensorflow as tf

        if not training:
            return x
        y = tf.numpy_function(self._maybe_crash, [x], x.dtype, stateful=True)
        return tf.ensure_shape(y, x.shape)

    def get_config(self):
        return {**super().get_config(), "partition": self.partition, "at_call": self.at_call}
