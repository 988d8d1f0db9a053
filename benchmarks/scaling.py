"""A fit's cost as the table grows: its time against one process's, the workers' peak memory and the rows read.

    python benchmarks/scaling.py [--rows 250000 1000000 4000000] [--workers 2] [--repeats 1]

For each size the dense workload (``workloads.py``: 100 float32 features a row, Dense 256-256-1, one epoch) is
written as Parquet and, side by side in one run (alternating over ``--repeats``): one Keras process in a fresh
Python process reads it into numpy and trains on the global batch (its wall time, read included, and its peak
resident memory), and ``sparkdl.fit`` (sync, ``--workers`` tasks, in a session whose workers a first small fit
started) trains on it, not cached. Each worker records its peak resident memory (``workloads.MemoryProbe``:
``VmHWM``, mapped pages included) and its own memory (``RssAnon``); Spark's status API gives the rows the fit's
stages read from the files (``passes.py``). Time should grow with the rows and the workers' memory stay flat.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from passes import settled, stages  # noqa: E402
from workloads import WORKLOADS, MemoryProbe, local_session  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def one_process(rows: int, table: str) -> dict:
    """One Keras process (a fresh Python: its peak memory is this fit's) on the Parquet ``table``."""
    command = [sys.executable, __file__, "--single", str(rows), table]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"one process at {rows} rows failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _single(rows: int, table: str) -> None:
    """In the fresh process: ``step_cost.one_process`` on ``table``, its time and peak memory printed as JSON."""
    from step_cost import one_process as train_alone

    started = time.perf_counter()
    read, _ = train_alone(dataclasses.replace(WORKLOADS["dense"], rows=rows), table)
    with open("/proc/self/status") as status:
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"seconds": time.perf_counter() - started, "read": read, "peak_mb": peak_kb / 1024}))


def fit(spark, rows: int, table: str, workers: int) -> dict:
    """One ``sparkdl.fit`` of the dense workload on ``table``: its time, its workers' memory, its reads."""
    workload = dataclasses.replace(WORKLOADS["dense"], rows=rows)
    before = set(stages(spark))
    with tempfile.TemporaryDirectory(prefix="scaling-") as out:
        started = time.perf_counter()
        workload.fit(spark.read.parquet(table), workers, callbacks=[MemoryProbe(out)])
        seconds = time.perf_counter() - started
        probes = [json.load(open(os.path.join(out, name))) for name in os.listdir(out)]
    fit_stages = settled(spark, before)
    return {
        "seconds": seconds,
        "worker_peak_mb": max(p["hwm_kb"] for p in probes) / 1024,
        "worker_own_mb": max(p["anon_kb"] for p in probes) / 1024,
        "rows_read": sum(s.input_rows for s in fit_stages),
        "shuffled_mb": sum(s.shuffle_write_bytes for s in fit_stages) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[250_000, 1_000_000, 4_000_000])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--single", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        _single(int(args.single[0]), args.single[1])
        return
    spark = local_session(
        args.workers, **{"spark.ui.enabled": "true", "spark.ui.port": "0", "spark.driver.memory": "4g"}
    )
    small = dataclasses.replace(WORKLOADS["dense"], rows=4 * args.workers * WORKLOADS["dense"].batch_size)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="scaling-tables-") as folder:
            small.fit(small.frame(spark), args.workers)  # starts the workers
            for rows in args.rows:
                table = dataclasses.replace(WORKLOADS["dense"], rows=rows).parquet(os.path.join(folder, str(rows)))
                singles, fits = [], []
                for _ in range(args.repeats):
                    singles.append(one_process(rows, table))
                    fits.append(fit(spark, rows, table, args.workers))
                    print(f"{rows:>10,} rows: one process {singles[-1]}, fit {fits[-1]}", flush=True)
                results.append((rows, _median(singles), _median(fits)))
    finally:
        spark.stop()
    print(
        "\n| rows | fit | one process | ratio | worker peak | worker own | one process peak | rows read | shuffled |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for rows, single, fitted in results:
        print(
            f"| {rows:,} | {fitted['seconds']:.1f} s | {single['seconds']:.1f} s | "
            f"{fitted['seconds'] / single['seconds']:.2f}x | {fitted['worker_peak_mb']:.0f} MB | "
            f"{fitted['worker_own_mb']:.0f} MB | {single['peak_mb']:.0f} MB | "
            f"{fitted['rows_read'] / rows:.2f}x | {fitted['shuffled_mb']:.0f} MiB |"
        )


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


if __name__ == "__main__":
    main()
