"""A custom Keras layer that is NOT registered with Keras: loading a model that uses it needs custom_objects."""

import itertools

import keras

_TRACES = itertools.count()


class Scale(keras.layers.Layer):
    """Multiplies its input by a constant factor (part of the saved config)."""

    def __init__(self, factor=1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def make_scaled_classifier(width=4, classes=3, seed=0, log_dir=None):
    """A classifier with a Scale layer (and a LoadLog layer when ``log_dir`` is given)."""
    keras.utils.set_random_seed(seed)
    logs = [LoadLog(log_dir)] if log_dir else []
    model = keras.Sequential(
        [keras.Input((width,)), *logs, Scale(0.5), keras.layers.Dense(classes, activation="softmax")]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class LoadLog(keras.layers.Layer):
    """Identity layer that appends this process's pid to ``<log_dir>/loads`` when it is built from its config
    (once per model load), and its pid, Spark partition (-1 outside a task), trace and row count to
    ``<log_dir>/calls`` each time it runs: which processes loaded and ran a model, in how many tasks, and how
    many times its call was traced into a graph (each trace numbers itself, counting per process)."""

    def __init__(self, log_dir, **kwargs):
        super().__init__(**kwargs)
        self.log_dir = log_dir
        self._append("loads")

    def _append(self, name, *fields):
        import os

        with open(os.path.join(self.log_dir, name), "a") as f:
            f.write(" ".join(map(str, (os.getpid(), *fields))) + "\n")

    def _record_call(self, x, trace):
        from pyspark import TaskContext

        context = TaskContext.get()
        self._append("calls", -1 if context is None else context.partitionId(), int(trace), len(x))
        return x

    def call(self, x):
        import tensorflow as tf

        trace = next(_TRACES)  # Python runs here once per trace; the graph then carries the number
        y = tf.numpy_function(self._record_call, [x, tf.constant(trace)], x.dtype, stateful=True)
        y.set_shape(x.shape)
        return y

    def get_config(self):
        return {**super().get_config(), "log_dir": self.log_dir}


def logged(path, field=0) -> list:
    """One field of every line of a LoadLog file (0: the pid; in ``calls``, 1: the partition, 2: the trace, 3: the
    rows); empty when there is no file yet."""
    import os

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(line.split()[field]) for line in f.read().splitlines()]
