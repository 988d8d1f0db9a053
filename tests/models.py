"""Small real Keras models shared by the tests."""

import keras
import numpy as np
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
    on the first attempt of one Spark task only: a worker lost mid-epoch.

    A retried barrier stage is a new stage attempt whose tasks count attempts from 0 again (and
    PySpark does not expose the stage attempt), so there ``marker`` names a file that the crash
    leaves behind: the first attempt is the one that finds no marker.
    """

    def __init__(self, partition=0, at_call=5, marker=None, **kwargs):
        super().__init__(**kwargs)
        self.partition = partition
        self.at_call = at_call
        self.marker = marker
        self._calls = 0

    def _maybe_crash(self, x):
        import os

        from pyspark import TaskContext

        self._calls += 1
        context = TaskContext.get()
        if context is None or context.partitionId() != self.partition or self._calls != self.at_call:
            return x
        if self.marker is None and context.attemptNumber() == 0:
            os._exit(1)
        if self.marker is not None and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return x

    def call(self, x, training=None):
        import tensorflow as tf

        if not training:
            return x
        y = tf.numpy_function(self._maybe_crash, [x], x.dtype, stateful=True)
        return tf.ensure_shape(y, x.shape)

    def get_config(self):
        return {**super().get_config(), "partition": self.partition, "at_call": self.at_call, "marker": self.marker}


class RecordEpochs(keras.callbacks.Callback):
    """A user callback for workers: writes the logs it sees at each epoch end to
    ``<directory>/rank<partition>-epoch<e>.json``; before epoch ``wait_before_epoch`` it waits
    (up to two minutes) for the file ``wait_for`` to appear."""

    def __init__(self, directory, wait_for=None, wait_before_epoch=1):
        super().__init__()
        self.directory = directory
        self.wait_for = wait_for
        self.wait_before_epoch = wait_before_epoch

    def on_epoch_begin(self, epoch, logs=None):
        import os
        import time

        if self.wait_for is None or epoch != self.wait_before_epoch:
            return
        deadline = time.monotonic() + 120
        while not os.path.exists(self.wait_for):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.wait_for} never appeared: the driver did not see the epoch live")
            time.sleep(0.05)

    def on_epoch_end(self, epoch, logs=None):
        import json
        import os

        from pyspark import TaskContext

        path = os.path.join(self.directory, f"rank{TaskContext.get().partitionId()}-epoch{epoch}.json")
        with open(path, "w") as f:
            json.dump({k: float(v) for k, v in logs.items()}, f)


@keras.utils.register_keras_serializable(package="sparkdl_tests")
class RecordBatches(keras.layers.Layer):
    """Identity layer that saves every training batch it sees, as ``<directory>/rank<partition>-call<n>.npy``:
    which rows each rank trained on, in which order, read back by the test without the library's help."""

    def __init__(self, directory=None, **kwargs):
        super().__init__(**kwargs)
        self.directory = directory
        self._calls = 0

    def _record(self, x):
        import os

        import numpy as np
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None and self.directory is not None:
            np.save(os.path.join(self.directory, f"rank{context.partitionId()}-call{self._calls:05d}.npy"), x)
            self._calls += 1
        return x

    def call(self, x, training=None):
        if not training:
            return x
        y = tf.numpy_function(self._record, [x], x.dtype, stateful=True)
        return tf.ensure_shape(y, x.shape)

    def get_config(self):
        return {**super().get_config(), "directory": self.directory}


def recorded_batches(directory, rank):
    """The batches ``RecordBatches`` saved for one rank, in the order it trained on them."""
    import glob

    import numpy as np

    return [np.load(path) for path in sorted(glob.glob(f"{directory}/rank{rank}-call*.npy"))]


@keras.utils.register_keras_serializable(package="sparkdl_tests")
class RecordIds(keras.layers.Layer):
    """Identity on its second input; in training, appends ``partition id`` lines for the ids of every batch it
    sees (its first input) to ``<directory>/<pid>.txt``: which rows really reached a worker's train step."""

    def __init__(self, directory, **kwargs):
        super().__init__(**kwargs)
        self.directory = directory

    def _record(self, ids):
        import os

        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        with open(os.path.join(self.directory, f"{os.getpid()}.txt"), "a") as f:
            f.writelines(f"{partition} {int(i)}\n" for i in ids.reshape(-1))
        return np.float32(0)

    def call(self, inputs, training=None):
        ids, x = inputs
        if not training:
            return x
        return x + tf.ensure_shape(tf.numpy_function(self._record, [ids], tf.float32, stateful=True), [])

    def get_config(self):
        return {**super().get_config(), "directory": self.directory}


@keras.utils.register_keras_serializable(package="sparkdl_tests")
class RecordScoredIds(RecordIds):
    """``RecordIds`` that records when the model scores too (``KerasModel.transform``), not only in training."""

    def call(self, inputs, training=None):
        ids, x = inputs
        return x + tf.ensure_shape(tf.numpy_function(self._record, [ids], tf.float32, stateful=True), [])


def recorded_ids(directory) -> dict[int, list[int]]:
    """The ids ``RecordIds`` (or ``RecordScoredIds``) recorded in ``directory``, by partition, each partition's in
    order (one process per partition in sync and async modes)."""
    from pathlib import Path

    by_partition: dict[int, list[int]] = {}
    for file in sorted(Path(directory).glob("*.txt")):
        for line in file.read_text().splitlines():
            partition, row = map(int, line.split())
            by_partition.setdefault(partition, []).append(row)
    return by_partition


@keras.utils.register_keras_serializable(package="sparkdl_tests")
class WaitForPeers(keras.layers.Layer):
    """Identity layer whose first training call in a process leaves a file in ``directory`` and waits (up to
    ``seconds``) until ``peers`` files are there: ``peers`` fits' tasks meet only if they train at the same time.
    A later fit finds the files there and goes on at once."""

    def __init__(self, directory=None, peers=2, seconds=120.0, **kwargs):
        super().__init__(**kwargs)
        self.directory = directory
        self.peers = peers
        self.seconds = seconds
        self._met = False

    def _meet(self, x):
        import os
        import time
        import uuid

        if self._met or self.directory is None:
            return x
        open(os.path.join(self.directory, uuid.uuid4().hex), "w").close()
        deadline = time.monotonic() + self.seconds
        while len(os.listdir(self.directory)) < self.peers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no other fit trained within {self.seconds}s: the fits did not run at once")
            time.sleep(0.05)
        self._met = True
        return x

    def call(self, x, training=None):
        if not training:
            return x
        y = tf.numpy_function(self._meet, [x], x.dtype, stateful=True)
        return tf.ensure_shape(y, x.shape)

    def get_config(self):
        return {**super().get_config(), "directory": self.directory, "peers": self.peers, "seconds": self.seconds}
