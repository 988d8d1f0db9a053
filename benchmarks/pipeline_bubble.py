"""mode="pipeline": the time of a step against one process, and the stages' idle ("bubble") fraction as the number
of micro-batches grows, against GPipe's bound (S-1)/(M+S-1).

Two stages (``local[2]``: two tasks, one core each) train a 1.4M-parameter MLP (256 -> 6 x 512 -> 10, Adam) cut
in two by parameter count, at batch 256, for M = 1, 2, 4, 8, 16 micro-batches. Each stage task times
what it spends computing and what it spends waiting for its neighbour (``FitResult.stats["pipeline"]``);
the idle fraction is waiting over both. One process is Keras's own ``fit`` on the driver, with both cores,
on the same rows and batch size, measured before and after the pipeline runs (the spread is the
machine's noise). Per-step time is the training phase of the fit (``FitResult.phases["train"]``: without
start-up) over its steps.

    python benchmarks/pipeline_bubble.py [--micro-batches 1 2 4 8 16] [--epochs 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

ROWS, WIDTH, HIDDEN, DEPTH, CLASSES, BATCH = 4096, 256, 512, 6, 10, 256


def make_model():
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((WIDTH,))] + [keras.layers.Dense(HIDDEN, activation="relu") for _ in range(DEPTH)]
    model = keras.Sequential([*layers, keras.layers.Dense(CLASSES, activation="softmax")])
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    return model


def one_process_ms(x, y, epochs: int) -> float:
    """Keras's own fit on the driver: milliseconds per step, after a first epoch that builds and compiles."""
    model = make_model()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    started = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    return 1000 * (time.perf_counter() - started) / (epochs * -(-len(x) // BATCH))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    import numpy as np
    from pyspark.sql import SparkSession

    import sparkdl

    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    y = rng.integers(0, CLASSES, ROWS).astype(np.int64)
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.createDataFrame(
        [(r.tolist(), int(label)) for r, label in zip(x, y)], "features array<float>, label long"
    )
    df = df.cache()
    df.count()
    before = one_process_ms(x, y, args.epochs)
    print(f"one process (Keras fit, 2 cores): {before:.1f} ms/step", flush=True)
    print(f"{'M':>3}{'GPipe bound':>13}{'idle stage 0':>14}{'idle stage 1':>14}{'ms/step':>10}{'x one process':>15}")
    rows = []
    for micro_batches in args.micro_batches:
        result = sparkdl.fit(
            df,
            make_model(),
            mode="pipeline",
            num_stages=2,
            micro_batches=micro_batches,
            num_workers=2,
            epochs=args.epochs,
            batch_size=BATCH,
            seed=0,
            progress=False,
        )
        stats = result.stats["pipeline"]
        step_ms = 1000 * result.phases["train"] / (args.epochs * result.steps_per_epoch)
        idle = [stage["idle_fraction"] for stage in stats["stages"]]
        rows.append((micro_batches, stats["gpipe_bound"], idle, step_ms, stats["stages"]))
        print(
            f"{micro_batches:>3}{stats['gpipe_bound']:>13.3f}{idle[0]:>14.3f}{idle[1]:>14.3f}{step_ms:>10.1f}"
            f"{step_ms / before:>15.2f}",
            flush=True,
        )
    after = one_process_ms(x, y, args.epochs)
    print(f"one process again: {after:.1f} ms/step (noise: {abs(after - before) / min(before, after):.0%})")
    stages = rows[0][4]
    whole = sum(stage["weight_bytes"] + stage["optimizer_bytes"] for stage in stages)
    held = ", ".join(f"{(s['weight_bytes'] + s['optimizer_bytes']) / 1e6:.2f} MB" for s in stages)
    print(f"weights and Adam's state held per stage task: {held} (the whole model's: {whole / 1e6:.2f} MB)")
    spark.stop()


if __name__ == "__main__":
    main()
