"""A custom Keras layer that is NOT registered with Keras: loading a model that uses it needs custom_objects."""

import keras


class Scale(keras.layers.Layer):
    """Multiplies its input by a constant factor (part of the saved config)."""

    def __init__(self, factor=1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def make_scaled_classifier(width=4, classes=3, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((width,)), Scale(0.5), keras.layers.Dense(classes, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class LoadLog(keras.layers.Layer):
    """Identity layer that appends this process's pid to ``<log_dir>/loads`` when it is built from its config
    (once per model load) and to ``<log_dir>/calls`` each time it runs: which processes loaded and ran a model."""

    def __init__(self, log_dir, **kwargs):
        super().__init__(**kwargs)
        self.log_dir = log_dir
        self._append("loads")

    def _append(self, name):
        import os

        with open(os.path.join(self.log_dir, name), "a") as f:
            f.write(f"{os.getpid()}\n")

    def _record_call(self, x):
        self._append("calls")
        return x

    def call(self, x):
        import tensorflow as tf

        y = tf.numpy_function(self._record_call, [x], x.dtype, stateful=True)
        y.set_shape(x.shape)
        return y

    def get_config(self):
        return {**super().get_config(), "log_dir": self.log_dir}


def pids(path) -> list:
    """The pids a LoadLog file holds, one per logged event (empty when the file does not exist yet)."""
    import os

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(line) for line in f.read().split()]
