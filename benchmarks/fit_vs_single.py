"""sparkdl.fit, in any of its modes, against single-process Keras fit, side by side in one run.

Same model, same initial weights, same global batch (2 workers x 16 vs 32),
20 epochs on scikit-learn's digits. The Spark session is started before any
timing; the first sparkdl.fit (which also starts the Python workers and
imports TensorFlow in them) is reported separately as the cold start.

    python benchmarks/fit_vs_single.py [--modes sync async hogwild ssp average] [--repeats 3] [--checkpoints]

``--checkpoints`` adds each mode again with ``checkpoint_dir`` (a fresh local directory per run):
what saving the model and optimizer state after every epoch costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jobs"))

import numpy as np  # noqa: E402
from train import build_mlp  # noqa: E402  (the main job's model, so the figures describe it)


def digits_split():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    return train_test_split((x / 16.0).astype(np.float32), y, test_size=0.2, random_state=0, stratify=y)


def accuracy(model, x, y) -> float:
    return float(np.mean(model.predict(x, verbose=0).argmax(axis=1) == y))


# The settings each mode is benchmarked with (and the goal its wall time is held to, x single-process).
MODES = {
    "sync": ({}, 4.0),
    "async": ({"push_every": 1}, 6.0),
    "hogwild": ({"push_every": 1}, None),
    "ssp": ({"max_staleness": 2}, None),
    "average": ({}, None),  # the default: sync_every = half an epoch
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["sync"], choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--checkpoints", action="store_true", help="also run each mode with checkpoint_dir")
    args = parser.parse_args(argv)

    import keras
    from pyspark.sql import SparkSession

    import sparkdl

    spark = (
        SparkSession.builder.master(f"local[{args.workers}]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    x_train, x_test, y_train, y_test = digits_split()
    df = spark.createDataFrame(
        [(r.tolist(), int(l)) for r, l in zip(x_train, y_train)], "features array<float>, label int"
    ).cache()
    df.count()
    batch_size = args.global_batch // args.workers

    def model():
        keras.utils.set_random_seed(0)
        return build_mlp(64, 10, 1e-3)

    started = time.perf_counter()
    sparkdl.fit(df, model(), num_workers=args.workers, epochs=1, batch_size=batch_size, seed=0)
    cold = time.perf_counter() - started

    variants = [(mode, False) for mode in args.modes] + [(mode, True) for mode in args.modes if args.checkpoints]
    runs = ["single"] + [_run_name(mode, checkpointed) for mode, checkpointed in variants]
    timings = {run: [] for run in runs}
    accuracies = {run: [] for run in runs}
    for _ in range(args.repeats):  # interleaved, so load on this shared machine hits every run alike
        m = model()
        started = time.perf_counter()
        m.fit(x_train, y_train, batch_size=args.global_batch, epochs=args.epochs, verbose=0)
        timings["single"].append(time.perf_counter() - started)
        accuracies["single"].append(accuracy(m, x_test, y_test))
        for mode, checkpointed in variants:
            with tempfile.TemporaryDirectory(prefix="sparkdl-bench-") as directory:
                started = time.perf_counter()
                result = sparkdl.fit(
                    df,
                    model(),
                    num_workers=args.workers,
                    mode=mode,
                    epochs=args.epochs,
                    batch_size=batch_size,
                    seed=0,
                    checkpoint_dir=directory if checkpointed else None,
                    **MODES[mode][0],
                )
                timings[_run_name(mode, checkpointed)].append(time.perf_counter() - started)
            accuracies[_run_name(mode, checkpointed)].append(accuracy(result.model, x_test, y_test))

    single_time, single_accuracy = statistics.median(timings["single"]), np.median(accuracies["single"])
    print(
        f"\ndigits MLP 64-128-64-10, {len(x_train)} train rows, {args.epochs} epochs, global batch "
        f"{args.global_batch} ({args.workers} workers x {batch_size}), median of {args.repeats} interleaved runs"
    )
    print(f"{'run':<44}{'wall s':>8}{'x single':>10}{'test acc':>10}{'gap pts':>9}  goal")
    for run in runs:
        wall, acc = statistics.median(timings[run]), np.median(accuracies[run])
        if run == "single":
            label, goal = "single-process model.fit", ""
        else:
            mode = run.split()[0]
            options, limit = MODES[mode]
            label = f"sparkdl {run} " + (" ".join(f"{k}={v}" for k, v in options.items()) or "(defaults)")
            goal = f"<= {limit:g}x, within 1 pt" if limit and run == mode else ""
        print(
            f"{label:<44}{wall:>8.2f}{wall / single_time:>10.2f}{acc:>10.4f}"
            f"{100 * (single_accuracy - acc):>+9.2f}  {goal}"
        )
    print(f"cold start (first fit of the session, 1 epoch, Python workers + TensorFlow import): {cold:.2f}s")
    spark.stop()


def _run_name(mode: str, checkpointed: bool) -> str:
    return f"{mode} +checkpoint_dir" if checkpointed else mode


if __name__ == "__main__":
    main()
