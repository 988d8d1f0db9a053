"""What step checkpoints cost a sync fit of the 8.4M-parameter model, side by side in one run.

Three fits of ``workloads.py``'s ``mlp8m`` (sync, ``--workers`` tasks), interleaved over ``--repeats``: without
checkpoints, with ``checkpoint_dir`` (epoch checkpoints; the default ``checkpoint_every``, 10 minutes, never falls
inside this short fit), and with a step checkpoint every ``--every`` steps. Printed: the median wall time of each
and its ratio to the fit without checkpoints; the seconds training waited per step checkpoint (the writer's model
serialization: ``FitResult.stats["step_checkpoints"]``; the storage is written on a background thread), and what
that wait is as a share of training at the default interval.

    python benchmarks/step_checkpoints.py [--repeats 2] [--every 32]
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

from workloads import WORKLOADS, local_session  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--every", type=int, default=32, help="steps between step checkpoints")
    args = parser.parse_args(argv)

    import sparkdl
    from sparkdl.checkpoint import DEFAULT_INTERVAL, CheckpointInterval

    workload = WORKLOADS["mlp8m"]
    spark = local_session(args.workers, **{"spark.driver.memory": "6g"})
    directory = tempfile.mkdtemp(prefix="sparkdl-step-checkpoints-")
    df = spark.read.parquet(workload.parquet(directory))

    def fit(**options):
        return workload.fit(df, args.workers, **options)

    variants = {
        "no checkpoints": lambda run: {},
        "epoch checkpoints": lambda run: {"checkpoint_dir": os.path.join(directory, f"epochs-{run}")},
        f"every {args.every} steps": lambda run: {
            "checkpoint_dir": os.path.join(directory, f"steps-{run}"),
            "checkpoint_every": args.every,
        },
    }
    sparkdl.fit(df.limit(4 * args.workers * workload.batch_size), workload.model(), num_workers=args.workers)
    walls: dict[str, list[float]] = {name: [] for name in variants}
    waits: list[tuple[int, float]] = []
    steps = 0
    for run in range(args.repeats):  # interleaved, so that the machine's load hits every variant alike
        for name, options in variants.items():
            started = time.perf_counter()
            result = fit(**options(run))
            walls[name].append(time.perf_counter() - started)
            steps = result.steps_per_epoch * workload.epochs
            if "checkpoint_every" in options(run):
                saved = result.stats["step_checkpoints"]
                waits.append((saved["saved"], saved["seconds"]))
    spark.stop()

    base = statistics.median(walls["no checkpoints"])
    print(f"mlp8m sync, {args.workers} workers, {steps} steps, {args.repeats} runs each (median wall, ratio):")
    for name, runs in walls.items():
        spread = f"{min(runs):.2f}-{max(runs):.2f}"
        print(f"  {name:<22} {statistics.median(runs):7.2f} s  ({spread})  {statistics.median(runs) / base:5.3f}x")
    saved = sum(n for n, _ in waits)
    wait = sum(s for _, s in waits) / max(saved, 1)
    interval = CheckpointInterval.parse(DEFAULT_INTERVAL).seconds or 0.0
    print(f"  step checkpoints saved: {saved} in {len(waits)} fits; training waited {wait:.3f} s per checkpoint")
    print(f"  at the default interval ({DEFAULT_INTERVAL}): {100 * wait / interval:.3f}% of training time")


if __name__ == "__main__":
    main()
