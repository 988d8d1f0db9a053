"""Each rank's peak resident memory in mode="sync", mode="sharded" (ZeRO-1) and shard_weights=True (ZeRO-3), side by
side: what the sharded modes promise (1/N of Adam's state per rank; 1/N of the weights too), measured at the peak,
wherever the peak comes from (loading the model, a step, a checkpoint, rank 0's result).

One session on ``local[2]`` whose Python workers are not reused (``spark.python.worker.reuse=false``): every task
runs in a worker freshly forked from the daemon, so no fit inherits another's memory. While each fit runs, a thread
reads every worker's high-water mark (``VmHWM``: the most it ever had resident, as the kernel counts it) every few
milliseconds; a fit's ranks are its two workers of the highest marks (highest first: rank 0 builds the result).
The model is ``--layers`` Dense(``--width``) layers with Adam: W bytes of weights, so that at N=2 ZeRO-1 should
save about W per rank (half of Adam's 2 W) and ZeRO-3 about 1.5 W.

    python benchmarks/zero_memory.py [--layers 8] [--width 1024] [--rows 128] [--modes sync sharded ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

#: name: (mode, options)
MODES = {
    "sync": ("sync", {}),
    "sharded": ("sharded", {}),
    # every unit's weights but the last's gathered again for its backward pass: two units' weights at once
    "shard_weights": ("sharded", {"shard_weights": True, "reshard_after_forward": True}),
    # every unit's gathered weights and forward tape kept until its backward pass: the whole weights during a step
    "shard_weights kept": ("sharded", {"shard_weights": True, "reshard_after_forward": False}),
}
FEATURES = 64


def model(layers: int, width: int):
    import keras

    keras.utils.set_random_seed(0)
    dense = [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
    built = keras.Sequential([keras.Input((FEATURES,)), *dense, keras.layers.Dense(10, activation="softmax")])
    built.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    return built


def measure(names, *, layers: int, width: int, rows: int) -> dict:
    """``{"weight_bytes": W, name: [rank peaks, highest first]}`` for the fits of ``names`` (``MODES``)."""
    import numpy as np
    from pyspark.sql import SparkSession
    from workloads import worker_peaks

    import sparkdl

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.python.worker.reuse", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        rng = np.random.default_rng(0)
        df = spark.createDataFrame(
            [(rng.random(FEATURES).astype(np.float32).tolist(), int(rng.integers(10))) for _ in range(rows)],
            "features array<float>, label bigint",
        ).cache()
        df.count()
        result: dict = {"weight_bytes": sum(int(np.prod(w.shape)) * 4 for w in model(layers, width).trainable_weights)}
        for name in names:
            mode, options = MODES[name]
            with worker_peaks() as peaks:
                sparkdl.fit(
                    df,
                    model(layers, width),
                    mode=mode,
                    num_workers=2,
                    epochs=1,
                    batch_size=16,
                    seed=0,
                    progress=False,
                    **options,
                )
            result[name] = sorted(peaks.values(), reverse=True)[:2]
        return result
    finally:
        spark.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", action="store_true", help="print one JSON line (weight_bytes, each mode's peaks)")
    args = parser.parse_args(argv)
    result = measure(args.modes, layers=args.layers, width=args.width, rows=args.rows)
    if args.json:
        print(json.dumps(result), flush=True)
        return
    weights = result["weight_bytes"]
    print(f"W = {weights / 1e6:.1f} MB of weights (Adam: 2 W of state); peak resident MB of each rank, highest first")
    for name in args.modes:
        line = f"{name:>14}: " + " / ".join(f"{peak / 1e6:.0f}" for peak in result[name])
        if name != "sync" and "sync" in result:
            line += "   below sync: " + " / ".join(
                f"{(s - p) / weights:.2f} W" for s, p in zip(result["sync"], result[name])
            )
        print(line)


if __name__ == "__main__":
    main()
