"""What a sync step costs against one process, side by side in one run, and where its time goes.

For each workload of ``workloads.py`` (dense: 1M rows from Parquet; mlp8m: 8.4M parameters, 32 MB
of gradients a step; digits): one Keras process on all the machine's cores trains on the global
batch, then ``sparkdl.fit`` (sync, ``--workers`` tasks of one core each, the workers already
started by a first fit) in each variant, interleaved over ``--repeats``; the median wall time and
its ratio to one process are printed, with the spread. A last fit with ``profile=True`` breaks the
default variant's step into its phases on every rank (``sparkdl.modes.sync.step_profile``); the
difference between the ``collective`` of ``overlap=False`` and of the default shows how much
communication the buckets hide behind backprop.

    python benchmarks/step_cost.py [--workloads dense mlp8m digits] [--repeats 2]
    cd ../before && PYTHONPATH=. python ../main/benchmarks/step_cost.py --variants sync --no-profile  # an older one

An older checkout runs from its own directory: the executors' Python workers start with ``python -m``, which puts
the working directory first on their path, so from this checkout's root they would import this checkout's sparkdl
whatever ``PYTHONPATH`` says (the driver would not).

``dense`` and ``mlp8m`` are read from Parquet by both sides: one process's time includes reading
the rows into numpy, as sparkdl's includes its tasks reading them. The table is 8 files, which a fit
reads as one partition of whole files a worker, without a shuffle (``sparkdl.launch.whole_files``);
``sync, rows shuffled`` reads them behind a filter that every row passes, which the fit deals to its
workers through a shuffle, as before. The workers read their files themselves (``sparkdl.launch.parquet_files``);
``sync, read through Spark`` has Spark hand them the same partitions' rows instead (under
``spark.sql.files.ignoreMissingFiles``, which keeps the workers from reading the files).
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

VARIANTS = {
    "sync": {},
    "sync overlap=False": {"overlap": False},
    "sync compression=bf16": {"compression": "bf16"},
    "sharded": {"mode": "sharded"},
    "sharded compression=bf16": {"mode": "sharded", "compression": "bf16"},
    "sharded shard_weights=True": {"mode": "sharded", "shard_weights": True},
    "sharded shard_weights=True reshard_after_forward=True": {
        "mode": "sharded",
        "shard_weights": True,
        "reshard_after_forward": True,
    },
    "sharded shard_weights=True reshard_after_forward=False": {
        "mode": "sharded",
        "shard_weights": True,
        "reshard_after_forward": False,
    },
    # the same rows behind a filter (no row fails it): not a projection of files, so the fit shuffles them
    "sync, rows shuffled": {"where": "label IS NOT NULL"},
    # the same whole files, handed to the workers by Spark: a setting under which the workers do not read them
    "sync, read through Spark": {"conf": {"spark.sql.files.ignoreMissingFiles": "true"}},
}


def one_process(workload, parquet: str | None) -> tuple[float, float]:
    """(seconds reading the rows, seconds training) of one Keras process on the global batch."""
    import pyarrow.parquet as pq

    started = time.perf_counter()
    if parquet is not None:
        table = pq.read_table(parquet)
        features = table.column("features").combine_chunks()
        x = features.values.to_numpy().reshape(len(table), workload.width)
        y = table.column("label").to_numpy()
    else:
        x, y = workload.arrays()
    read = time.perf_counter() - started
    model = workload.model()
    started = time.perf_counter()
    model.fit(x, y, batch_size=2 * workload.batch_size, epochs=workload.epochs, verbose=0, shuffle=True)
    return read, time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--no-profile", action="store_true", help="skip the profiled fits (for a checkout without fit(profile=...))"
    )
    args = parser.parse_args(argv)

    spark = local_session(args.workers, **{"spark.driver.memory": "6g"})
    directory = tempfile.mkdtemp(prefix="sparkdl-step-cost-")
    for name in args.workloads:
        _measure(spark, WORKLOADS[name], args, directory)
    spark.stop()


def _measure(spark, workload, args, directory: str) -> None:
    import sparkdl

    parquet = workload.parquet(directory) if workload.name != "digits" else None
    if parquet is not None:
        df = spark.read.parquet(parquet)
    else:
        x, y = workload.arrays()
        df = spark.createDataFrame(
            [(row.tolist(), label.item()) for row, label in zip(x, y)],
            f"features array<float>, label {'bigint' if workload.classes else 'float'}",
        ).cache()
        df.count()

    def fit(where=None, conf=None, **options):
        for key, value in (conf or {}).items():
            spark.conf.set(key, value)
        try:
            return workload.fit(df if where is None else df.where(where), args.workers, **options)
        finally:
            for key in conf or {}:
                spark.conf.unset(key)

    sparkdl.fit(df.limit(4 * args.workers * workload.batch_size), workload.model(), num_workers=args.workers)
    reads, trains, walls = [], [], {variant: [] for variant in args.variants}
    phases: dict[str, list[dict]] = {variant: [] for variant in args.variants}
    for _ in range(args.repeats):  # interleaved, so that the machine's load hits every run alike
        read, train = one_process(workload, parquet)
        reads.append(read)
        trains.append(train)
        for variant in args.variants:
            started = time.perf_counter()
            result = fit(**VARIANTS[variant])
            walls[variant].append(time.perf_counter() - started)
            phases[variant].append(getattr(result, "phases", {}))  # an older checkout has none
    profiles = {}
    if not args.no_profile:  # a fully sharded fit runs no Keras fit steps to profile (FitResult.stats["fully_sharded"])
        profiled = [variant for variant in args.variants if not VARIANTS[variant].get("shard_weights")]
        profiles = {variant: fit(profile=True, **VARIANTS[variant]).stats["step_profile"] for variant in profiled}
    _report(workload, args, reads, trains, walls, profiles)
    _report_phases(phases)


def _report_phases(phases: dict[str, list[dict]]) -> None:
    """Each variant's fit, phase by phase (``FitResult.phases``, median seconds): the part outside ``train``
    is the fit's fixed cost."""
    names = list(dict.fromkeys(name for runs in phases.values() for run in runs for name in run))
    if not names:
        return
    print("\nfit phases, median seconds:")
    print(f"{'phase':<20}" + "".join(f"{variant:>26}" for variant in phases))
    for name in names:
        cells = [statistics.median(run.get(name, 0.0) for run in runs) for runs in phases.values()]
        print(f"{name:<20}" + "".join(f"{cell:>26.2f}" for cell in cells))


def _report(workload, args, reads, trains, walls, profiles) -> None:
    single = [r + t for r, t in zip(reads, trains)]
    base = statistics.median(single)
    print(
        f"\n== {workload.name}: {workload.rows:,} rows x {workload.width}, {workload.epochs} epoch(s), "
        f"{args.workers} workers x batch {workload.batch_size} vs one process x batch {args.workers * workload.batch_size}"
        f" (median of {args.repeats}, spread in brackets) =="
    )
    print(f"{'run':<28}{'wall s':>10}{'x one process':>16}  spread")
    print(
        f"{'one process':<28}{base:>10.2f}{1.0:>16.2f}  [{min(single):.2f}-{max(single):.2f}]"
        f"  (reading {statistics.median(reads):.2f} s, training {statistics.median(trains):.2f} s)"
    )
    for variant, times in walls.items():
        ratios = [t / s for t, s in zip(times, single)]
        print(
            f"{'sparkdl ' + variant:<28}{statistics.median(times):>10.2f}{statistics.median(times) / base:>16.2f}"
            f"  [{min(ratios):.2f}-{max(ratios):.2f}x]"
        )
    if not profiles:
        return
    phases = [name for name in next(iter(profiles.values())) if isinstance(next(iter(profiles.values()))[name], list)]
    print(f"\nms per step, rank 0 / rank 1 ({next(iter(profiles.values()))['steps']} steps profiled):")
    print(f"{'phase':<20}" + "".join(f"{variant:>26}" for variant in profiles))
    for phase in phases:
        cells = ["/".join(f"{v:.2f}" for v in profile[phase]) for profile in profiles.values()]
        print(f"{phase:<20}" + "".join(f"{cell:>26}" for cell in cells))
    counts = ("step_median", "buckets_done_early", "steps_overlapped")  # per rank, but not a phase's milliseconds
    totals = [
        "/".join(f"{sum(p[ph][r] for ph in phases if ph not in counts):.2f}" for r in range(args.workers))
        for p in profiles.values()
    ]
    print(f"{'total':<20}" + "".join(f"{cell:>26}" for cell in totals))
    print(
        "buckets and gradient MB per step: "
        + ", ".join(f"{v}: {p['buckets']}, {p['gradient_bytes'] / 1e6:.2f}" for v, p in profiles.items())
    )


if __name__ == "__main__":
    main()
