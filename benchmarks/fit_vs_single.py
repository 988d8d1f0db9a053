"""sparkdl.fit, in any of its modes, against single-process Keras fit, side by side in one run.

Same model, same initial weights, same global batch (2 workers x 16 vs 32),
20 epochs on scikit-learn's digits. The Spark session is started before any
timing; the first sparkdl.fit (which also starts the Python workers and
imports TensorFlow in them) is reported separately as the cold start.

    python benchmarks/fit_vs_single.py [--modes sync async hogwild ssp average] [--repeats 3] [--checkpoints]
    python benchmarks/fit_vs_single.py --phases [--repeats 3] [--daemon] [--baseline DIR] [--check-early]

``--checkpoints`` adds each mode again with ``checkpoint_dir`` (a fresh local directory per run):
what saving the model and optimizer state after every epoch costs.

``--phases`` shows where a sync fit's time goes (``FitResult.phases``), for the first fit of a
session and for a warm one, next to one process's ``model.fit``: each repeat is a fresh Python
process (a fresh JVM, Spark session and Python workers; the session's start is not timed) that
runs one process's fit, the session's first sparkdl fit, one process's fit again and two warm
sparkdl fits, in that order. Each phase is printed as the median over the repeats (warm: over
both warm fits of every repeat) with its range, in seconds and as a fraction of one process's
fit (the fractions add up to the fit's ratio). ``--daemon`` starts the sessions with
``spark.python.daemon.module=sparkdl.WORKER_DAEMON`` (Python workers forked with TensorFlow loaded).
``--baseline DIR`` measures another source tree of sparkdl (a checkout of an earlier commit) as well,
its repeats alternating with this tree's, side by side in one table. ``--check-early`` adds this tree
again, its sessions calling ``sparkdl.check_executors(spark, workers, wait=False)`` right after they start,
as ``jobs/train.py`` does: the executors' TensorFlow import then overlaps building the data and one
process's fit instead of the first sparkdl fit.
"""

from __future__ import annotations

import argparse
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
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "jobs"))

import numpy as np  # noqa: E402
from train import build_mlp  # noqa: E402  (the main job's model, so the figures describe it)
from workloads import local_session  # noqa: E402


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
    parser.add_argument("--phases", action="store_true", help="sync mode's phases, first and warm fit (see above)")
    parser.add_argument("--daemon", action="store_true", help="--phases: sessions with sparkdl's worker daemon")
    parser.add_argument("--baseline", help="--phases: also another source tree of sparkdl, repeats alternating")
    parser.add_argument(
        "--check-early", action="store_true", help="--phases: also sessions that check their executors at once"
    )
    parser.add_argument("--phases-child", action="store_true", help=argparse.SUPPRESS)  # one repeat of --phases
    args = parser.parse_args(argv)
    if args.phases:
        trees = {"before": (args.baseline, False)} if args.baseline else {}
        trees["this tree"] = (ROOT, False)
        if args.check_early:
            trees["checked early"] = (ROOT, True)
        variants: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.repeats):  # the variants alternate, so load on this shared machine hits both alike
            for name, (tree, check_early) in trees.items():
                variants[name].append(phases_repeat(args, tree, check_early))
        print_phases(variants, args)
        return
    if args.phases_child:
        print("PHASES " + json.dumps(phases_child(args)), flush=True)
        return

    import keras

    import sparkdl

    spark = local_session(args.workers)
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


# FitResult.phases of a sync fit, in order, and what each one holds.
PHASES = {
    "settings": "driver: the arguments, custom objects, checkpoints checked",
    "slots": "driver: task slots claimed, columns matched to the model",
    "probe": "waiting for the executors' Python check (and TF import)",
    "serialize": "driver: the model to .keras bytes, the settings",
    "launch": "stage submitted -> task code runs (scheduling, shuffle, worker)",
    "import": "task: importing Keras and TensorFlow",
    "read": "task: reading and spilling the partition",
    "connect": "task: rendezvous, ring and shared memory",
    "model in": "task: model fetched, broadcast, loaded and compiled",
    "train": "task: Keras fit, every epoch (tracing included)",
    "model out": "task: the trained model to .keras bytes",
    "result": "upload, stage end, the model rebuilt on the driver",
}


def phases_repeat(args, tree: str, check_early: bool) -> dict:
    """One repeat of ``--phases`` in a fresh Python process (a fresh JVM and Spark session) importing sparkdl
    from ``tree``, its session checking the executors at once where ``check_early``."""
    command = [sys.executable, os.path.abspath(__file__), "--phases-child", "--epochs", str(args.epochs)]
    command += ["--workers", str(args.workers), "--global-batch", str(args.global_batch)]
    command += ["--daemon"] if args.daemon else []
    command += ["--check-early"] if check_early else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    # From the tree's root: `python -m pyspark.daemon` puts its working directory first on the workers' path.
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env, cwd=tree)
    line = next((line for line in done.stdout.splitlines() if line.startswith("PHASES ")), None)
    if done.returncode != 0 or line is None:
        log = tempfile.NamedTemporaryFile("w", prefix="sparkdl-phases-", suffix=".log", delete=False)
        with log:
            log.write(done.stdout + "\n" + done.stderr)
        python_lines = [line for line in done.stderr.splitlines() if not line.startswith("\tat ")]
        raise RuntimeError(f"{' '.join(command)} failed (its output: {log.name}):\n" + "\n".join(python_lines[-60:]))
    outcome = json.loads(line.split(" ", 1)[1])
    variant = f"{tree} (checked early)" if check_early else tree
    print(
        f"{variant}: one process {[round(s, 2) for s in outcome['single']]}, "
        f"first fit {outcome['first']['wall']:.2f}s, warm fits {[round(fit['wall'], 2) for fit in outcome['warm']]}",
        flush=True,
    )
    return outcome


def phases_child(args) -> dict:
    """One process's fit, the session's first sparkdl fit, one process's fit, two warm fits: seconds and phases."""
    import keras

    import sparkdl

    config = {"spark.python.daemon.module": sparkdl.WORKER_DAEMON} if args.daemon else {}
    spark = local_session(args.workers, **config)
    if args.check_early:
        sparkdl.check_executors(spark, args.workers, wait=False)  # as jobs/train.py does; the first fit waits for it
    x_train, _, y_train, _ = digits_split()
    df = spark.createDataFrame(
        [(r.tolist(), int(l)) for r, l in zip(x_train, y_train)], "features array<float>, label int"
    ).cache()
    df.count()  # the rows cached: reading them is not part of any fit
    batch_size = args.global_batch // args.workers

    def single() -> float:
        keras.utils.set_random_seed(0)
        model = build_mlp(64, 10, 1e-3)
        started = time.perf_counter()
        model.fit(x_train, y_train, batch_size=args.global_batch, epochs=args.epochs, verbose=0)
        return time.perf_counter() - started

    def distributed() -> dict:
        keras.utils.set_random_seed(0)
        model = build_mlp(64, 10, 1e-3)
        started = time.perf_counter()
        result = sparkdl.fit(
            df, model, num_workers=args.workers, epochs=args.epochs, batch_size=batch_size, seed=0, progress=False
        )
        return {"wall": time.perf_counter() - started, "phases": result.phases}

    outcome = {"single": [single()], "first": distributed()}
    outcome["single"].append(single())
    outcome["warm"] = [distributed(), distributed()]
    spark.stop()
    return outcome


def print_phases(variants: dict[str, list[dict]], args) -> None:
    """One column per variant and fit: each phase's median [min-max] seconds over the repeats, and that median
    over the median of the variant's one-process fits."""
    columns = {}
    for variant, repeats in variants.items():
        one = statistics.median(s for r in repeats for s in r["single"])
        columns[f"{variant}: first"] = (one, [r["first"] for r in repeats])
        columns[f"{variant}: warm"] = (one, [w for r in repeats for w in r["warm"]])
    daemon = ", sparkdl.WORKER_DAEMON" if args.daemon else ""
    print(
        f"\nsync fit, digits MLP 64-128-64-10, {args.epochs} epochs, {args.workers} workers x "
        f"{args.global_batch // args.workers} (local[{args.workers}]{daemon}) vs one process x {args.global_batch}; "
        f"{args.repeats} fresh processes per variant; median [min-max] seconds, and median / one process's fit"
    )
    print(f"{'':<10}" + "".join(f"{name:>26}" for name in columns))

    def cell(values: list[float], one: float) -> str:
        median = statistics.median(values)
        return f"{median:6.2f} [{min(values):5.2f}-{max(values):5.2f}] {median / one:4.2f}"

    for name in PHASES:
        print(
            f"{name:<10}"
            + "".join(cell([f["phases"].get(name, 0.0) for f in fits], one) for one, fits in columns.values())
        )
    print(f"{'fit':<10}" + "".join(cell([f["wall"] for f in fits], one) for one, fits in columns.values()))
    ones = {variant: [s for r in repeats for s in r["single"]] for variant, repeats in variants.items()}
    print(f"{'one':<10}" + "".join(f"{cell(ones[name.split(':')[0]], one):>26}" for name, (one, _) in columns.items()))
    print("goal: first fit <= 3x one process, warm fit <= 1.5x")
    for name, what in PHASES.items():
        print(f"  {name:<10}{what}")


if __name__ == "__main__":
    main()
