"""Every training mode on three emulated hosts: its epoch beside ``sparkdl.plan``'s prediction, and every fault struck
in the middle of its training, with what became of the fit.

Usage (as root): python benchmarks/faults.py [--modes sync async ...] [--faults "link down 5 s" ...]
       [--epochs 5] [--train-seconds 6] [--timeout 30] [--hang-after 240] [--json faults.json]
       [--from-json faults.json]

The cluster (``benchmarks/hostnet``): three hosts, each a network namespace with its own address on one bridge, a
Spark standalone worker of one core on each (its executor and Python workers in the host's namespace), the master on
the switch, the driver in this machine's namespace: every fit's three tasks run one on each host, so the faulted
host always holds one of them. The workload: the main job's digits MLP (``workloads.py``),
3 workers, 16 rows per worker per step, ``--timeout`` as ``fit``'s timeout. Every registered mode
(``sparkdl.modes.registry``) runs with its defaults; an option a mode requires takes its value from
``REQUIRED_OPTIONS`` (a mode needing one not there is reported, not run).

Per mode, on a cluster of its own (a child process: a mode that hangs cannot stall the next):

1. a first fit of two epochs leaves a checkpoint: the starting point (:class:`StartingPoint`), and the pace of an
   epoch, from which every later fit's epochs are chosen: at least ``--epochs``, about ``--train-seconds`` of training;
2. two clean fits from copies of it train those epochs: the reference weights, the epoch time (the median gap
   between two epoch lines) and whether the mode is reproducible at all (the two clean fits' weights);
3. one fit per fault from another copy, the fault struck at host 1 half a second after training began
   (``hostnet.faults.FAULTS``: link down 5 s, 1% loss for 60 s, the executor JVM killed, the busiest Python worker
   stopped for 60 s, the host cut off for good; then, the host back, cut off again under ``min_workers=2``); its outcome (``hostnet.trials``): the same weights as the
   clean fit (to float32 rounding), different weights (a defect, where the clean fits agree), failed (and whether
   the error names the host and a rank), hang (no end within ``--hang-after`` s), or not struck (training ended
   first); and whatever it left behind.

Then the prediction: ``sparkdl.plan`` on the same cluster (its own child), for 3 workers at 16 rows. The tables go to
stdout as Markdown (docs/faults.md holds a run's); ``--json`` keeps everything, ``--from-json`` prints a saved run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # sparkdl from this checkout

from hostnet import faults as fault_catalogue
from hostnet.network import Network, available, impairment_available, remove_abandoned
from hostnet.spark_cluster import SparkCluster
from hostnet.trials import ROUNDING, run_trial, weights_difference
from workloads import WORKLOADS

HOSTS, CORES, WORKERS, BATCH = 3, 1, 3, 16  # one task slot per host: every host holds one rank, the faulted one too
FAULTED_HOST = 1
#: Values for the options a mode requires (``Option.required``), by option name.
REQUIRED_OPTIONS = {"num_stages": 3, "max_staleness": 2}
CHECKPOINT_EVERY = 10  # steps: a third of an epoch (30 steps of 3 x 16 of the 1437 rows)
MIN_WORKERS = WORKERS - 1  # the partition's second trial: the fit may go on with the two hosts left
REMOTE_TYPE = re.compile(r"^rank \d+ raised ([\w.]+):")  # the remote error's type, in a WorkerError's message
CLUSTER_SETTINGS = {"spark.ui.showConsoleProgress": "false"}


@dataclasses.dataclass(frozen=True)
class StartingPoint:
    """Where every fit of a mode's trials starts: the checkpoint a first fit of ``epochs`` epochs left in ``folder``
    (its epoch checkpoint). Each trial's fit gets a copy of its own (:meth:`copy`) and trains more epochs after it,
    saving a step checkpoint every ``CHECKPOINT_EVERY`` steps, so that the faulted fit and the clean one start from
    the same state, and a faulted fit that Spark retries resumes mid-epoch."""

    folder: str
    epochs: int

    @classmethod
    def make(cls, fit, folder: str, epochs: int = 2) -> StartingPoint:
        """``fit``'s checkpoint after ``epochs`` epochs; the first fit on a new cluster waits for its executors' Python
        workers to start (TensorFlow imported on each), so it has ``fit``'s default timeout rather than the trials'."""
        fit(checkpoint_dir=folder, epochs=epochs, timeout=600.0)
        return cls(folder, epochs)

    def copy(self, scratch: str) -> str:
        folder = tempfile.mkdtemp(prefix="trial-", dir=scratch)
        shutil.copytree(self.folder, folder, dirs_exist_ok=True)
        return folder


def more_epochs(epoch_seconds: float | None, args) -> int:
    """The epochs every fit trains after the starting point: at least ``--epochs``, and enough for about
    ``--train-seconds`` of training at the first fit's pace (its second epoch), so that a fault struck half a second
    in lands in the middle of training in the fast modes too (at most 100)."""
    if not epoch_seconds:
        return args.epochs
    return min(100, max(args.epochs, math.ceil(args.train_seconds / epoch_seconds)))


def mode_settings(name: str) -> dict | str:
    """``fit``'s keywords for mode ``name`` with its defaults, or why it cannot run here."""
    from sparkdl.modes.registry import MODES

    settings = {"mode": name}
    for option in MODES[name].options(name):
        if option.required:
            if option.name not in REQUIRED_OPTIONS:
                return f"needs `{option.name}`, which REQUIRED_OPTIONS lacks"
            settings[option.name] = REQUIRED_OPTIONS[option.name]
    return settings


def mode_main(args) -> None:
    """One mode's clean fits and trials on a cluster of its own; one JSON line per result to ``args.out``."""
    import sparkdl

    settings = mode_settings(args.mode)
    workload = WORKLOADS["digits"]
    chosen = trials(args.faults)

    def record(**line) -> None:
        with open(args.out, "a") as out:
            out.write(json.dumps(dict(line, load_average=os.getloadavg()[0])) + "\n")

    with Network(HOSTS, root_port=True) as network, SparkCluster(network, cores=CORES) as cluster:
        frame = WORKLOADS["digits"].frame(cluster.session(**CLUSTER_SETTINGS))

        def fit(checkpoint_dir: str, epochs: int, timeout: float = args.timeout, **extra):
            return sparkdl.fit(
                frame,
                workload.model(),
                num_workers=WORKERS,
                batch_size=BATCH,
                epochs=epochs,
                seed=0,
                timeout=timeout,
                progress=False,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every=CHECKPOINT_EVERY,
                **settings,
                **extra,
            )

        with fault_catalogue.TrainingStarted() as first:
            start = StartingPoint.make(fit, tempfile.mkdtemp(prefix="start-", dir=cluster.scratch))
        total = start.epochs + more_epochs(first.epoch_seconds(), args)
        clean = [
            run_trial(
                cluster,
                fault_catalogue.NO_FAULT,
                lambda: fit(start.copy(cluster.scratch), total),
                host=FAULTED_HOST,
                reference=None,
                hang_after=args.hang_after,
            )
            for _ in range(2)
        ]
        weights = [None if c.result is None else c.result.model.get_weights() for c in clean]
        reproducible = None if None in weights else weights_difference(weights[0], weights[1])
        record(
            line="clean",
            mode=args.mode,
            epochs=total - start.epochs,
            epoch_seconds=clean[0].epoch_seconds,
            seconds=clean[0].seconds,
            clean_difference=reproducible,
            outcomes=[c.kind for c in clean],
        )
        for number, (name, fault, extra) in enumerate(chosen):
            folder = start.copy(cluster.scratch)
            outcome = run_trial(
                cluster,
                fault,
                lambda folder=folder, extra=extra: fit(folder, total, **extra),
                host=FAULTED_HOST,
                reference=None if extra else weights[0],  # fewer workers train other batches
                checkpoint_dirs=[folder],
                hang_after=args.hang_after,
            )
            workers = None if outcome.result is None else outcome.result.num_workers
            record(line="trial", mode=args.mode, **dict(outcome.to_json(), fault=name, workers=workers))
            if outcome.stuck or number == len(chosen) - 1:
                break
            if fault.for_good:
                cluster.network.link(FAULTED_HOST, up=True)  # the host comes back for the next trial
            cluster.wait_for_executors(HOSTS, timeout=args.hang_after)


def trials(faults: list[str]) -> list[tuple[str, fault_catalogue.Fault, dict]]:
    """The trials of ``faults`` (names from ``hostnet.faults.FAULTS``), in its order: (the trial's name, the fault,
    ``fit``'s keywords beyond the common ones); a partition twice, the second time under ``MIN_WORKERS``."""
    chosen = [(fault.name, fault, {}) for fault in fault_catalogue.FAULTS if fault.name in faults]
    partition = next((fault for fault in fault_catalogue.FAULTS if fault.name == "partition"), None)
    if partition is not None and partition.name in faults:
        chosen.append((f"partition, min_workers={MIN_WORKERS}", partition, {"min_workers": MIN_WORKERS}))
    return chosen


def plan_main(args) -> None:
    """``sparkdl.plan`` for the workload on the cluster: every choice, as JSON to ``args.out``."""
    import sparkdl

    with Network(HOSTS, root_port=True) as network, SparkCluster(network, cores=CORES) as cluster:
        frame = WORKLOADS["digits"].frame(cluster.session(**CLUSTER_SETTINGS))
        plan = sparkdl.plan(frame, WORKLOADS["digits"].model(), num_workers=WORKERS, batch_size=BATCH, show=False)
        print(plan, flush=True)
        from sparkdl.planner.planned import NOT_PLANNED, PLANNED

        choices = [
            dict(dataclasses.asdict(c), keywords=PLANNED[c.mode].fit_keywords(c.num_workers)) for c in plan.choices
        ]
        with open(args.out, "w") as out:
            json.dump({"choices": choices, "not_planned": NOT_PLANNED, "table": str(plan)}, out)


def child(role: str, out: str, args, *extra: str, cap: float) -> int | None:
    """This script as a child process of ``role`` (its own process group, output in ``out``.log), for at most ``cap``
    seconds; its exit status, None when it ran past the cap (then it and everything it started are killed)."""
    command = [sys.executable, os.path.abspath(__file__), "--role", role, "--out", out, "--timeout", str(args.timeout)]
    command += ["--epochs", str(args.epochs), "--train-seconds", str(args.train_seconds)]
    command += ["--hang-after", str(args.hang_after), *extra]
    with open(out + ".log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            return None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            process.wait()
            remove_abandoned()  # its namespaces and the processes left in them, if it was killed


def run_all(args) -> dict:
    from sparkdl.modes.registry import MODES

    work = tempfile.mkdtemp(prefix="sparkdl-faults-")
    results: dict = {"modes": {}, "faults": [name for name, _, _ in trials(args.faults)]}
    plan_out = os.path.join(work, "plan.json")
    status = child("plan", plan_out, args, cap=900)
    results["plan"] = json.load(open(plan_out)) if status == 0 else {"error": _tail(plan_out + ".log")}
    print(results["plan"].get("table", results["plan"].get("error")), flush=True)
    for mode in args.modes or list(MODES):
        settings = mode_settings(mode)
        if isinstance(settings, str):
            results["modes"][mode] = {"not_run": settings}
            continue
        out = os.path.join(work, f"{mode}.jsonl")
        cap = 600 + len(trials(args.faults)) * (args.hang_after + 120)
        clock = time.monotonic()
        status = child("mode", out, args, "--mode", mode, "--faults", *args.faults, cap=cap)
        lines = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
        entry = {"settings": settings, "lines": lines, "exit": status, "seconds": time.monotonic() - clock}
        if status != 0:
            entry["log_tail"] = _tail(out + ".log")
        results["modes"][mode] = entry
        print(f"{mode}: {len(lines)} results in {entry['seconds']:.0f} s (exit {status})", flush=True)
        if args.json:
            save(args.json, results)
    shutil.rmtree(work, ignore_errors=True)
    return results


def _tail(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as log:
        return log.read()[-4000:]
    return ""


def save(path: str, results: dict) -> None:
    with open(path, "w") as out:
        json.dump(results, out, indent=1)


def predicted_epoch(plan: dict, settings: dict) -> str:
    """sparkdl.plan's epoch for ``settings`` on WORKERS workers at BATCH rows, or why there is none."""
    keywords = {k: v for k, v in settings.items() if k != "num_stages"}
    for choice in plan.get("choices", []):
        if choice["keywords"] == keywords and choice["num_workers"] == WORKERS and choice["batch_size"] == BATCH:
            return f"{choice['epoch_seconds']:.2f} s"
    return "not planned" if settings["mode"] in plan.get("not_planned", {}) else "?"


def report(results: dict) -> str:
    """The epoch of every mode beside sparkdl.plan's, the mode x fault matrix, and the first line of every error."""
    plan = results.get("plan", {})
    faults = results["faults"]
    epochs = [
        "| mode | epochs | epoch (measured) | epoch (sparkdl.plan) | two clean fits' weights |",
        "|---|---|---|---|---|",
    ]
    matrix = ["| mode | " + " | ".join(faults) + " |", "|---|" + "---|" * len(faults)]
    errors = []
    for mode, entry in results["modes"].items():
        if "not_run" in entry:
            epochs.append(f"| {mode} | not run: {entry['not_run']} | | | |")
            continue
        clean = next((line for line in entry["lines"] if line["line"] == "clean"), None)
        if clean is None:
            epochs.append(f"| {mode} | no clean fit (exit {entry['exit']}) | | | |")
            continue
        epoch = f"{clean['epoch_seconds']:.2f} s" if clean["epoch_seconds"] else "?"
        differ = clean["clean_difference"]
        same = "?" if differ is None else ("identical" if differ == 0 else f"differ by up to {differ:.2g}")
        predicted = predicted_epoch(plan, entry["settings"])
        epochs.append(f"| {mode} | {clean.get('epochs', '?')} | {epoch} | {predicted} | {same} |")
        trials = {line["fault"]: line for line in entry["lines"] if line["line"] == "trial"}
        matrix.append(f"| {mode} | " + " | ".join(_cell(trials.get(fault), differ) for fault in faults) + " |")
        for fault in faults:
            line = trials.get(fault)
            if line is not None and line["kind"] == "failed":
                errors.append(f"- {mode}, {fault}: `{line['message'].splitlines()[0][:300]}`")
    return "\n".join([*epochs, "", *matrix, "", *errors])


def _cell(line: dict | None, clean_difference: float | None) -> str:
    """One trial's outcome and time, for the matrix (``completed*``: a mode whose clean fits differ, nothing to
    compare)."""
    if line is None:
        return "not run"
    kind, difference = line["kind"], line["max_difference"]
    if difference is not None:  # as the trials compare now, whatever a saved run's tolerance was
        if clean_difference is not None and clean_difference > ROUNDING:
            kind = "completed*"
        elif difference <= ROUNDING:
            kind = "same weights" + (f" (to {difference:.0e})" if difference else "")
        else:
            kind = f"DIFFERENT weights (by {difference:.2g})"
    elif kind == "failed" and line["struck_at"] is None:
        return f"refused before training: {line['error_type']} (below)"
    elif kind == "failed":
        named = [n for n, ok in (("host", line["names_host"]), ("rank", line["names_rank"])) if ok]
        raised = REMOTE_TYPE.search(line["message"])
        error = (raised.group(1) if raised else line["error_type"]).rsplit(".", 1)[-1]
        after = f" {line['seconds'] - line['struck_at']:.0f} s after the fault" if line["struck_at"] is not None else ""
        return f"failed{after}: {error}, names {' and '.join(named) or 'neither host nor rank'}" + _left(line)
    elif kind == "hang":
        return f"hang (cut at {line['seconds']:.0f} s)" + _left(line)
    if kind == "completed" and line.get("workers") not in (None, WORKERS):
        kind = f"completed on {line['workers']} workers"
    return f"{kind}, {line['seconds']:.0f} s" + _left(line)


def _left(line: dict) -> str:
    return f"; left {len(line['leftovers'])} behind" if line["leftovers"] else ""


def main(argv=None) -> None:
    names = [f.name for f in fault_catalogue.FAULTS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", help="registered modes to run (default: every one)")
    parser.add_argument("--faults", nargs="+", default=names, choices=names, metavar="FAULT", help=f"of {names}")
    parser.add_argument("--epochs", type=int, default=5, help="the least epochs a fit trains after the start")
    parser.add_argument("--train-seconds", type=float, default=6.0, help="about how long a fit trains after the start")
    parser.add_argument("--timeout", type=float, default=30.0, help="fit's timeout, seconds")
    parser.add_argument("--hang-after", type=float, default=240.0, help="seconds after which a fit counts as hung")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--from-json", help="report a saved run")
    parser.add_argument("--role", choices=["mode", "plan"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "mode":
        return mode_main(args)
    if args.role == "plan":
        return plan_main(args)
    if args.from_json:
        with open(args.from_json) as saved:
            print(report(json.load(saved)))
        return None
    why = available() or impairment_available()
    if why is not None:
        print(f"faults: skipped: {why}")
        return None
    results = run_all(args)
    if args.json:
        save(args.json, results)
    print(report(results))
    return None


if __name__ == "__main__":
    main()
