"""The workloads the step-cost figures are measured on, defined once for every benchmark that uses them.

| name       | model                                   | rows                         | per worker batch | epochs |
|------------|-----------------------------------------|------------------------------|------------------|--------|
| ``dense``  | Dense 256-256-1 (relu), Adam, mse       | 1M x 100 float32, in Parquet | 256              | 1      |
| ``mlp8m``  | Dense 2048-2048-1024-10 on 1024 inputs  | 8,192 x 1024 float32         | 32               | 2      |
|            | (8.4M parameters, 32 MB of gradients)   |                              |                  |        |
| ``digits`` | jobs/train.py's 64-128-64-10 MLP        | scikit-learn digits (1,437)  | 16               | 20     |

One process trains the same model on the same rows with the global batch (workers x batch) on
all the machine's cores; sparkdl trains with ``workers`` tasks of one core each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jobs"))


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    rows: int
    width: int
    classes: int  # 0: a regression target
    batch_size: int  # per worker
    epochs: int

    def arrays(self, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The rows as ``(x, y)``: random features with a learnable target, or digits."""
        if self.name == "digits":
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split

            x, y = load_digits(return_X_y=True)
            x_train, _, y_train, _ = train_test_split(
                (x / 16.0).astype(np.float32), y, test_size=0.2, random_state=0, stratify=y
            )
            return x_train, y_train.astype(np.int64)
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((self.rows, self.width), dtype=np.float32)
        if self.classes:
            return x, (np.abs(x[:, 0] * 3).astype(np.int64) % self.classes)
        return x, (x[:, :4].sum(axis=1) * 0.5).astype(np.float32)

    def model(self):
        import keras

        keras.utils.set_random_seed(0)
        if self.name == "digits":
            from train import build_mlp  # the main job's model, so the figures describe it

            return build_mlp(self.width, self.classes, 1e-3)
        hidden = (256, 256) if self.name == "dense" else (2048, 2048, 1024)
        layers = [keras.Input((self.width,))] + [keras.layers.Dense(units, activation="relu") for units in hidden]
        if self.classes:
            layers.append(keras.layers.Dense(self.classes, activation="softmax"))
            loss = "sparse_categorical_crossentropy"
        else:
            layers.append(keras.layers.Dense(1))
            loss = "mse"
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        return model

    def fit(self, df, workers: int, **options):
        """``sparkdl.fit`` of this workload's model on ``df`` with ``workers`` workers (seed 0, no progress bar)."""
        import sparkdl

        return sparkdl.fit(
            df,
            self.model(),
            num_workers=workers,
            epochs=self.epochs,
            batch_size=self.batch_size,
            seed=0,
            progress=False,
            **options,
        )

    def frame(self, spark):
        """The rows as a cached DataFrame of ``spark`` (counted: cached before the first fit)."""
        frame = spark.createDataFrame(_table(*self.arrays(), self.width)).cache()
        frame.count()
        return frame

    def parquet(self, directory: str, files: int = 8) -> str:
        """The rows written as Parquet (``features array<float>``, ``label``) under ``directory``; its path."""
        import pyarrow.parquet as pq

        x, y = self.arrays()
        path = os.path.join(directory, self.name)
        os.makedirs(path, exist_ok=True)
        for i, part in enumerate(np.array_split(np.arange(len(x)), files)):
            table = _table(x[part], y[part], self.width)
            pq.write_table(table, os.path.join(path, f"part-{i:03d}.parquet"), row_group_size=64 * 1024)
        return path


def _table(x: np.ndarray, y: np.ndarray, width: int):
    """Rows ``x`` with labels ``y`` as an Arrow table: ``features list<float>``, ``label``."""
    import pyarrow as pa

    offsets = pa.array(np.arange(0, x.size + 1, width, dtype=np.int32))
    features = pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1)))
    return pa.table({"features": features, "label": pa.array(y)})


WORKLOADS = {
    "dense": Workload("dense", 1_000_000, 100, 0, 256, 1),
    "mlp8m": Workload("mlp8m", 8_192, 1024, 10, 32, 2),
    "digits": Workload("digits", 1_437, 64, 10, 16, 20),
}


class MemoryProbe:
    """A Keras callback for ``fit(callbacks=...)``, built in the workers (the class itself is pickled to them): at the
    end of training each worker writes ``<out>/<pid>.json`` with its peak resident memory (``hwm_kb``: ``VmHWM``,
    mapped file pages included), its own memory (``anon_kb``: the largest ``RssAnon`` at an epoch's end, what it
    allocated) and its last epoch's ``steps_per_second``."""

    def __new__(cls, out: str):
        import keras

        class Probe(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self._started = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self._seconds = time.perf_counter() - self._started
                self._anon = max(getattr(self, "_anon", 0), self.status_kb("RssAnon"))

            def on_train_end(self, logs=None):
                record = {
                    "hwm_kb": self.status_kb("VmHWM"),
                    "anon_kb": self._anon,
                    "steps_per_second": self.params["steps"] / self._seconds,
                    "pid": os.getpid(),
                }
                with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
                    json.dump(record, f)

            @staticmethod
            def status_kb(field: str) -> int:
                """A memory figure of this process from ``/proc/self/status``, in KiB."""
                with open("/proc/self/status") as status:
                    return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

        return Probe()


def _high_water_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


@contextlib.contextmanager
def worker_peaks(every: float = 0.005):
    """While the block runs, the high-water mark of every Python worker Spark's daemon forked (a Python process
    whose parent is a Python process started by the JVM below this one), read every ``every`` seconds. Yields a
    dict, pid -> the last mark read, complete once the block ends."""
    import psutil

    me, peaks, done = psutil.Process(), {}, threading.Event()

    def workers() -> list[int]:
        found = []
        for process in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                daemon = process.parent()
                if daemon and daemon.pid != me.pid and "python" in daemon.name() and daemon.parent().pid != me.pid:
                    found.append(process.pid)
        return found

    def sample() -> None:
        pids: list[int] = []
        for tick in range(1 << 62):
            if tick % 20 == 0:  # new workers: looked for less often than the marks are read
                pids = workers()
            for pid in pids:
                mark = _high_water_bytes(pid)
                if mark is not None:
                    peaks[pid] = mark
            if done.wait(every):
                return

    sampler = threading.Thread(target=sample, name="worker-peaks", daemon=True)
    sampler.start()
    try:
        yield peaks
    finally:
        done.set()
        sampler.join()


def local_session(workers: int, **config: str):
    """The benchmarks' Spark session: ``local[workers]`` on loopback, without console progress, logging errors only;
    ``config``: more settings (``spark.driver.memory="6g"``)."""
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(f"local[{workers}]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
    )
    for key, value in config.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
