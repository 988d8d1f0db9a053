"""The Horovod backend, side by side in one run (needs the Horovod stack: conf/horovod/install.sh).

(1) Launch cost: a two-rank Horovod allreduce started by sparkdl.run(backend="horovod"), by
    horovod.spark.run (Horovod's own Spark launcher), and the same allreduce on sparkdl's ring.
(2) Training: sparkdl.fit sync on digits (2 workers x 16, 20 epochs) with backend="sparkdl" and
    backend="horovod": wall time and test accuracy.

    .venv-horovod/bin/python benchmarks/horovod_backend.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import numpy as np  # noqa: E402
from fit_vs_single import accuracy, digits_split  # noqa: E402


def horovod_allreduce():
    import horovod.tensorflow as hvd

    hvd.init()
    return hvd.allreduce(np.ones(4) * (hvd.rank() + 1), op=hvd.Sum).numpy().tolist()


def ring_allreduce():
    from sparkdl import collective

    return collective.allreduce(np.ones(4) * (collective.rank() + 1)).tolist()


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def model():
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    net = tf.keras.Sequential(
        [
            tf.keras.Input((64,)),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    net.compile(optimizer=tf.keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return net


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args(argv)

    import horovod.spark
    from pyspark.sql import SparkSession

    import sparkdl

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    sparkdl.run(ring_allreduce, num_workers=2)  # starts the Python workers: not part of any figure

    print("== (1) launch + a 2-rank allreduce, median of", args.repeats, "==")
    launches = {
        "sparkdl.run(backend='horovod')": lambda: sparkdl.run(horovod_allreduce, num_workers=2, backend="horovod"),
        "horovod.spark.run": lambda: horovod.spark.run(horovod_allreduce, num_proc=2, verbose=0)[0],
        "sparkdl.run(backend='sparkdl')": lambda: sparkdl.run(ring_allreduce, num_workers=2),
    }
    seconds = {}
    for name, launch in launches.items():
        seconds[name], result = timed(launch, args.repeats)
        assert result == [3.0] * 4, (name, result)
        print(f"{name:34s} {seconds[name]:6.2f} s")
    print(
        f"horovod.spark.run / sparkdl.run(horovod): "
        f"{seconds['horovod.spark.run'] / seconds['sparkdl.run(backend=' + repr('horovod') + ')']:.2f}x"
    )

    print(f"\n== (2) sparkdl.fit sync, 2 workers x 16, {args.epochs} epochs, median of {args.repeats} ==")
    x_train, x_test, y_train, y_test = digits_split()
    df = spark.createDataFrame(
        [(r.tolist(), int(l)) for r, l in zip(x_train, y_train)], "features array<float>, label long"
    ).cache()
    df.count()
    fits = {}
    for backend in ("sparkdl", "horovod"):

        def run(backend=backend):
            return sparkdl.fit(df, model(), num_workers=2, epochs=args.epochs, batch_size=16, seed=0, backend=backend)

        run()  # warm-up (TensorFlow graph tracing in the workers)
        fits[backend], result = timed(run, args.repeats)
        print(
            f"backend={backend!r:10s} {fits[backend]:6.2f} s   test accuracy {accuracy(result.model, x_test, y_test):.4f}"
        )
    print(f"horovod / sparkdl wall time: {fits['horovod'] / fits['sparkdl']:.2f}x")
    spark.stop()


if __name__ == "__main__":
    main()
