"""The main job's fixed cost, phase by phase: ``jobs/train.py`` with its defaults, before and after, in one run.

Runs ``python jobs/train.py`` (its default run: digits, sync mode, 2 workers, 20 epochs) as a
subprocess, ``--runs`` times per variant (the first run warms the disk cache; the last one is
reported), for this tree and, side by side, for a baseline git ref checked out in a temporary
worktree (``--baseline``, default ``main``; ``--baseline ''`` skips it). Each run writes a Spark
event log; the phases come from it (which Spark jobs ran, from which file, how long) and from the
time each output line arrived:

    session start   process start -> Spark application start
    data load       -> the first Spark job sparkdl.fit runs (reading, splitting, the job's own jobs)
    checks          sparkdl's data check job(s) (their count in brackets)
    worker check    checks end -> training stage submitted (waiting for the environment probe)
    worker start..  training stage submitted -> epoch 1 done (Python workers, TensorFlow, model, epoch 1)
    epochs 2..N     epoch 1 done -> last epoch done
    result          last epoch -> training job done (the model back to the driver)
    scoring, save   -> process exit (test accuracy, saving, stopping Spark)

    python benchmarks/startup.py [--runs 2] [--baseline main]

The goal for a warm default run is 12 s in all on the 2-core machine the project is measured on.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_SECONDS = 12.0
ROWS = (
    "session start",
    "data load",
    "checks",
    "worker check",
    "worker start, TF, model, epoch 1",
    "epochs 2..N",
    "result",
    "scoring, save",
)
_EPOCH_LINE = re.compile(r"epoch\s+(\d+)/(\d+)")


def run_job(tree: str, work: str, verbose: bool) -> dict:
    """One ``jobs/train.py`` run from ``tree``: wall time, timed output lines, Spark events."""
    events = tempfile.mkdtemp(dir=work, prefix="events-")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])),
        PYSPARK_SUBMIT_ARGS=" ".join(
            [
                "--conf spark.eventLog.enabled=true",
                f"--conf spark.eventLog.dir=file://{events}",
                "--conf spark.eventLog.compress=false",
                "--conf spark.eventLog.rolling.enabled=false",
                "pyspark-shell",
            ]
        ),
    )
    command = [sys.executable, os.path.join(tree, "jobs", "train.py"), "--output", os.path.join(work, "model.keras")]
    if verbose:
        command.append("--verbose")
    lines: list[tuple[float, str]] = []
    started_wall, started = time.time(), time.perf_counter()
    process = subprocess.Popen(
        command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    reader = threading.Thread(
        target=lambda: lines.extend((time.perf_counter() - started, line.rstrip("\n")) for line in process.stdout),
        daemon=True,
    )
    reader.start()
    if process.wait(timeout=1200) != 0:
        reader.join(5)
        raise RuntimeError(f"{' '.join(command)} failed:\n" + "\n".join(text for _, text in lines[-40:]))
    total = time.perf_counter() - started
    reader.join(5)
    (log,) = glob.glob(os.path.join(events, "*"))
    return {"total": total, "started_wall": started_wall, "lines": lines, "events": read_events(log)}


def read_events(path: str) -> dict:
    """The application's start time and its jobs (call site, submitted, completed) from an event log."""
    app_start, jobs = None, {}
    with open(path) as log:
        for line in log:
            event = json.loads(line)
            kind = event["Event"]
            if kind == "SparkListenerApplicationStart":
                app_start = event["Timestamp"] / 1000
            elif kind == "SparkListenerJobStart":
                properties = event.get("Properties") or {}
                jobs[event["Job ID"]] = {
                    "site": properties.get("callSite.short", "?"),
                    "tags": properties.get("spark.job.tags", ""),
                    "start": event["Submission Time"] / 1000,
                    "end": None,
                }
            elif kind == "SparkListenerJobEnd":
                jobs[event["Job ID"]]["end"] = event["Completion Time"] / 1000
    return {"app_start": app_start, "jobs": [jobs[j] for j in sorted(jobs)]}


def job_kind(job: dict) -> str:
    site = job["site"]
    if "sparkdl-probe" in job["tags"] or "probe.py" in site:
        return "probe"
    if "sparkdl/data/" in site:
        return "data.py"
    if "sparkdl/" in site:
        return "training"
    return "job"


def phases(run: dict) -> dict:
    """The phase table's figures (seconds) for one run.

    fit's checks were the ``sparkdl/data/`` checks job right before the training stage (with adaptive
    execution one aggregate showed as two Spark jobs); since the training tasks check the rows as they read
    them, the row shows any Spark job left between the data load and the training stage. The probe runs in
    the background and is listed with the jobs.
    """
    wall0, jobs = run["started_wall"], run["events"]["jobs"]
    offset = lambda t: t - wall0  # noqa: E731 -- event times are wall-clock seconds
    first_training = next(i for i, j in enumerate(jobs) if job_kind(j) == "training")
    checks = []
    for job in reversed(jobs[:first_training]):
        if job_kind(job) == "probe":
            continue
        if job_kind(job) != "data.py":
            break
        checks.insert(0, job)
    training = [j for j in jobs if job_kind(j) == "training"]
    train_job = {"start": training[0]["start"], "end": max(j["end"] for j in training)}
    epoch_times: dict[int, float] = {}
    for seconds, text in run["lines"]:
        match = _EPOCH_LINE.search(text)
        if match and "step" not in text and offset(train_job["start"]) <= seconds:
            epoch_times.setdefault(int(match.group(1)), seconds)
    first_epoch = epoch_times.get(1, offset(train_job["end"]))
    last_epoch = epoch_times[max(epoch_times)] if epoch_times else offset(train_job["end"])
    checks_start = offset(checks[0]["start"]) if checks else offset(train_job["start"])
    checks_end = max((offset(j["end"]) for j in checks), default=checks_start)
    figures = {
        "session start": offset(run["events"]["app_start"]),
        "data load": checks_start - offset(run["events"]["app_start"]),
        "checks": checks_end - checks_start,
        "worker check": offset(train_job["start"]) - checks_end,
        "worker start, TF, model, epoch 1": first_epoch - offset(train_job["start"]),
        "epochs 2..N": last_epoch - first_epoch,
        "result": offset(train_job["end"]) - last_epoch,
        "scoring, save": run["total"] - offset(train_job["end"]),
        "total": run["total"],
    }
    figures["_checks_jobs"] = len(checks)
    figures["_fit_line"] = next(
        (text.split("sparkdl: phases ", 1)[1] for _, text in run["lines"] if "sparkdl: phases " in text), None
    )
    figures["_jobs"] = [(job_kind(j), j["site"], j["end"] - j["start"], offset(j["start"])) for j in jobs]
    return figures


@contextlib.contextmanager
def baseline_tree(ref: str, work: str):
    """A detached worktree of ``ref``, removed afterwards."""
    path = os.path.join(work, "baseline")
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", path, ref], check=True, capture_output=True, timeout=120
    )
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], capture_output=True, timeout=120)


def accepts_verbose(tree: str) -> bool:
    done = subprocess.run(
        [sys.executable, os.path.join(tree, "jobs", "train.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tree,
    )
    return "--verbose" in done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per variant; the last one is reported")
    parser.add_argument("--baseline", default="main", help="git ref to compare with ('' for none)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="sparkdl-startup-") as work:
        with contextlib.ExitStack() as stack:
            variants = {"this tree": ROOT}
            if args.baseline:
                variants = {
                    f"before ({args.baseline})": stack.enter_context(baseline_tree(args.baseline, work)),
                    **variants,
                }
            for name, tree in variants.items():
                verbose = accepts_verbose(tree)
                for run in range(args.runs):
                    outcome = run_job(tree, work, verbose)
                    print(f"{name}: run {run + 1}/{args.runs}: {outcome['total']:.1f}s", flush=True)
                results[name] = phases(outcome)
    names = list(results)
    print(f"\njobs/train.py default run (warm: run {args.runs} of {args.runs}), seconds")
    print(f"{'phase':34s}" + "".join(f"{n:>22s}" for n in names))
    for row in (*ROWS, "total"):
        label = row + (
            " [" + ", ".join(str(results[n]["_checks_jobs"]) for n in names) + " job(s)]" if row == "checks" else ""
        )
        print(f"{label:34s}" + "".join(f"{results[n][row]:22.1f}" for n in names))
    if len(names) == 2:
        before, after = (results[n]["total"] for n in names)
        print(f"{'after / before':34s}{after / before:44.2f}")
    print(f"{'goal':34s}" + "".join(f"{GOAL_SECONDS:22.1f}" for _ in names))
    for name in names:
        print(f"\n{name}: Spark jobs (kind, call site, seconds, submitted at)")
        for kind, site, seconds, at in results[name]["_jobs"]:
            print(f"  {kind:9s} {site[-70:]:70s} {seconds:6.2f}s  +{at:.1f}s")
        if results[name]["_fit_line"]:
            print(f"  sparkdl.fit's phases: {results[name]['_fit_line']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
