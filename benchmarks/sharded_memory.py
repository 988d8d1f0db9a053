"""How much optimizer state (and, with shard_weights=True, how much of the weights) each rank holds in mode="sharded"
against mode="sync", for N = 2, 3, 4 ranks.

Each N runs on a ``local-cluster[N,1,...]`` master, so that every rank is a Python worker of an
executor process of its own, as on a cluster. The model is ``workloads.py``'s mlp8m (8.4M
parameters, Adam: two slots per weight); one epoch of a few steps is enough, as the state's size
does not change while training. Each rank measures the bytes of the optimizer variables it holds
(``FitResult.stats["sharded"]``); the sync figure is what every rank of sync mode holds, the same
optimizer over the whole model. A third fit shards the weights too (``shard_weights=True``, ZeRO-3,
``reshard_after_forward=True``):
each rank measures the bytes of the weights it holds between steps, its optimizer state, and the most
it holds whole at once while a step runs (two layers' weights: one in use, the next being gathered);
``FitResult.stats["fully_sharded"]``. (That both train the same weights is tests/test_sharded.py's to
check, on ``local``: across executors, the order in which a shuffle's blocks arrive, and so the rows'
order in a partition, changes from one fit to the next.)

    python benchmarks/sharded_memory.py [--ranks 2 3 4]
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

from workloads import WORKLOADS  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 3, 4])
    args = parser.parse_args(argv)
    workload = WORKLOADS["mlp8m"]
    rows = [_measure(workload, ranks) for ranks in args.ranks]
    print("optimizer state per rank, MB")
    print(f"{'ranks':>5}{'sync':>8}{'sharded':>28}{'sharded / sync':>16}{'fit s sync/sharded/weights too':>32}")
    for row in rows:
        print(row["optimizer"], flush=True)
    print("with shard_weights=True: MB per rank (weights held between steps, optimizer state, peak gathered)")
    print(f"{'ranks':>5}{'whole weights':>15}{'weights held':>16}{'held / whole':>14}{'optimizer':>11}{'peak':>8}")
    for row in rows:
        print(row["weights"], flush=True)


def _measure(workload, ranks: int) -> str:
    from pyspark.sql import SparkSession

    import sparkdl

    spark = (
        SparkSession.builder.master(f"local-cluster[{ranks},1,2048]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        x, y = workload.arrays()
        rows = 4 * ranks * workload.batch_size
        df = spark.createDataFrame(
            [(row.tolist(), int(label)) for row, label in zip(x[:rows], y[:rows])],
            "features array<float>, label bigint",
        ).cache()
        df.count()
        results, seconds = {}, {}
        for name, mode, options in (
            ("sync", "sync", {}),
            ("sharded", "sharded", {}),
            ("weights too", "sharded", {"shard_weights": True, "reshard_after_forward": True}),
        ):
            started = time.perf_counter()
            results[name] = sparkdl.fit(
                df,
                workload.model(),
                mode=mode,
                **options,
                num_workers=ranks,
                epochs=1,
                batch_size=workload.batch_size,
                seed=0,
                progress=False,
            )
            seconds[name] = time.perf_counter() - started
        held = results["sharded"].stats["sharded"]["optimizer_state_bytes"]
        replicated = results["sharded"].stats["sharded"]["replicated_optimizer_state_bytes"]
        per_rank = " ".join(f"{h / 1e6:.1f}" for h in held)
        fully = results["weights too"].stats["fully_sharded"]["ranks"]
        whole = fully[0]["whole_weight_bytes"]
        weights_held = " ".join(f"{r['weight_bytes'] / 1e6:.1f}" for r in fully)
        return {
            "optimizer": f"{ranks:>5}{replicated / 1e6:>8.1f}{per_rank:>28}{max(held) / replicated:>16.3f}"
            f"{seconds['sync']:>18.1f}/{seconds['sharded']:.1f}/{seconds['weights too']:.1f}",
            "weights": f"{ranks:>5}{whole / 1e6:>15.1f}{weights_held:>16}"
            f"{max(r['weight_bytes'] for r in fully) / whole:>14.3f}{max(r['optimizer_bytes'] for r in fully) / 1e6:>11.1f}"
            f"{max(r['gathered_peak_bytes'] for r in fully) / 1e6:>8.1f}",
        }
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
