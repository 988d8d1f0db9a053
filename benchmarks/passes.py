"""How many times a fit reads its table, from Spark's own metrics: the rows each stage of the fit's jobs read from the
Parquet files, and the bytes it wrote to and read from the shuffle, against the table's rows and size.

    python benchmarks/passes.py [--rows 250000] [--workers 2] [--modes sync async] [--epochs 1] [--persist | --filtered]

The dense workload (``benchmarks/workloads.py``: 100 float32 features a row, in Parquet, not cached) is fitted once
per mode in a fresh ``local[workers]`` session (the session's jobs before the fit are not counted). Spark's status
REST API (``/api/v1/applications/<id>/stages``: the metrics its UI shows) gives each stage's ``inputRecords`` (rows
read from the files), ``shuffleWriteBytes`` and ``shuffleReadBytes``; the benchmark prints them by stage and the
fit's rows read from the files as a multiple of the table's rows: the passes over the table that the fit made.
Rows, not bytes: Spark 4's ``inputBytes`` misses what Parquet reads on its own threads (vectored reads), and shows a
few KiB for a pass over 100 MiB; each pass reads the columns the fit uses, so a pass's bytes are the table's.
Where the workers read their Parquet files themselves (``sparkdl.launch.parquet_files``: the fit's phase line says
``by the workers, from Parquet``), Spark's metrics see none of it, and count one placeholder row a task. So the
benchmark also prints what the executors' Python processes read while the fit ran, from the kernel's own count
(``rchar`` of ``/proc/PID/io``: the bytes their ``read`` calls returned, from files and from the streams Spark sends
them; local mode's Python daemon and the workers it forks, which Spark keeps between tasks, started before the fit
by ``sparkdl.check_executors`` so that their imports are not counted), against the table's bytes.
With ``--persist`` the fit's input is the table persisted (``cache()``, filled by the fit's first read): where it has
one partition per worker, evenly filled, the rows are dealt without a shuffle (``launch.layout``); unpersisted, its
files are read as one partition of whole files a worker (``launch.whole_files``). With ``--filtered`` the input is the
table behind a filter every row passes, which is not a projection of files: its rows are dealt through a shuffle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import urllib.request

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from workloads import WORKLOADS, local_session  # noqa: E402

SETTLE_SECONDS = 30  # the status store takes the listener bus's events a moment after a job ends


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage attempt of the fit's jobs, as Spark's status API reports it."""

    stage: int
    attempt: int
    name: str
    tasks: int
    input_rows: int
    shuffle_write_bytes: int
    shuffle_read_bytes: int

    @classmethod
    def from_json(cls, data: dict) -> Stage:
        return cls(
            data["stageId"],
            data["attemptId"],
            data["name"].split(" at ")[0],
            data["numTasks"],
            data["inputRecords"],
            data["shuffleWriteBytes"],
            data["shuffleReadBytes"],
        )


def stages(spark) -> dict[tuple[int, int], Stage]:
    """Every completed or failed stage attempt of the session, by (stage, attempt)."""
    url = f"{spark.sparkContext.uiWebUrl}/api/v1/applications/{spark.sparkContext.applicationId}/stages"
    with urllib.request.urlopen(url, timeout=30) as answer:
        listed = json.load(answer)
    return {(s["stageId"], s["attemptId"]): Stage.from_json(s) for s in listed if s["status"] in ("COMPLETE", "FAILED")}


def settled(spark, before: set) -> list[Stage]:
    """The stage attempts since ``before``, once no job is active and the status store has stopped changing."""
    deadline, last = time.monotonic() + SETTLE_SECONDS, None
    while time.monotonic() < deadline:
        tracker = spark.sparkContext.statusTracker()
        now = {key: stage for key, stage in stages(spark).items() if key not in before}
        if not tracker.getActiveJobsIds() and now == last:
            return [now[key] for key in sorted(now)]
        last = now
        time.sleep(1.0)
    raise TimeoutError(f"Spark's status store did not settle within {SETTLE_SECONDS} s")


def python_reads() -> dict[int, int]:
    """The bytes each of the executors' Python processes has read so far (``rchar``), by pid: Spark's daemon (or
    sparkdl's) and the workers it forked, whose command line is the daemon's."""
    read = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                command = cmdline.read()
            if b"pyspark.daemon" not in command and b"worker_daemon" not in command:
                continue
            with open(f"/proc/{entry.name}/io") as io:
                read[int(entry.name)] = next(int(line.split()[1]) for line in io if line.startswith("rchar:"))
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
            continue
    return read


def measure(mode: str, args, table: str) -> dict:
    """One fit of ``mode`` on the Parquet ``table`` in a fresh session: its stages and the passes over the table."""
    workload = dataclasses.replace(WORKLOADS["dense"], rows=args.rows, epochs=args.epochs)
    import sparkdl

    spark = local_session(args.workers, **{"spark.ui.enabled": "true", "spark.ui.port": "0"})
    try:
        frame = spark.read.parquet(table)
        if args.persist:
            frame = frame.cache()
        if args.filtered:
            frame = frame.where("label IS NOT NULL")
        sparkdl.check_executors(spark, args.workers)  # their Python started, TensorFlow imported: not the fit's reads
        before, python_before = set(stages(spark)), python_reads()
        clock = time.monotonic()
        workload.fit(frame, args.workers, mode=mode)
        seconds = time.monotonic() - clock
        python_after = python_reads()
        fit_stages = settled(spark, before)
    finally:
        spark.stop()
    read = sum(stage.input_rows for stage in fit_stages)
    return {
        "mode": mode,
        "seconds": seconds,
        "stages": [dataclasses.asdict(stage) for stage in fit_stages],
        "input_rows": read,
        "shuffle_write_bytes": sum(stage.shuffle_write_bytes for stage in fit_stages),
        "shuffle_read_bytes": sum(stage.shuffle_read_bytes for stage in fit_stages),
        "passes": read / args.rows,
        "python_read_bytes": sum(after - python_before.get(pid, 0) for pid, after in python_after.items()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["sync", "async"])
    read = parser.add_mutually_exclusive_group()
    read.add_argument("--persist", action="store_true", help="fit the table persisted (cache())")
    read.add_argument("--filtered", action="store_true", help="fit the table behind a filter every row passes")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="passes-") as folder:
        table = dataclasses.replace(WORKLOADS["dense"], rows=args.rows).parquet(folder)
        table_bytes = sum(entry.stat().st_size for entry in os.scandir(table) if entry.name.endswith(".parquet"))
        print(f"the table: {args.rows:,} rows x 100 float32, {table_bytes / 2**20:.1f} MiB of Parquet")
        results = [measure(mode, args, table) for mode in args.modes]
    for result in results:
        print(f"\n{result['mode']}, {args.workers} workers, {args.epochs} epoch(s): {result['seconds']:.1f} s")
        print(f"  {'stage':>5} {'tasks':>5} {'rows from files':>16} {'shuffle write':>14} {'shuffle read':>13}  name")
        for stage in result["stages"]:
            print(
                f"  {stage['stage']:>3}.{stage['attempt']} {stage['tasks']:>5} {stage['input_rows']:>16,}"
                f" {stage['shuffle_write_bytes'] / 2**20:>10.1f} MiB {stage['shuffle_read_bytes'] / 2**20:>9.1f} MiB"
                f"  {stage['name']}"
            )
        print(
            f"  read from the files: {result['input_rows']:,} rows = {result['passes']:.2f}x the table; "
            f"shuffled: {result['shuffle_write_bytes'] / 2**20:.1f} MiB written, "
            f"{result['shuffle_read_bytes'] / 2**20:.1f} MiB read"
        )
        print(
            f"  read by the executors' Python: {result['python_read_bytes'] / 2**20:.1f} MiB = "
            f"{result['python_read_bytes'] / table_bytes:.2f}x the table's files"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": args.rows, "workers": args.workers, "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
