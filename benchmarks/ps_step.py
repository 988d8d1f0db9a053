"""The async parameter-server step against one process's step, on an 8.4M-parameter model, in one run.

    python benchmarks/ps_step.py [--repeats 3] [--variants single async async-bf16] [--workload mlp8m]
                                 [--placement driver executors] [--num-servers 1]

The workload is ``WORKLOADS["mlp8m"]`` (``benchmarks/workloads.py``): Dense 2048-2048-1024-10 on
1024 inputs, 8,192 rows, 2 epochs. One process trains with batch 64 on all the machine's cores;
sparkdl trains ``mode="async"`` with 2 workers of batch 32 (one core each) against the parameter
server on the driver, with float32 pushes (``async``) and with ``compression="bf16"``
(``async-bf16``). With ``--placement driver executors`` every async variant runs in both server
placements side by side: the server threads on the driver (``@driver``), and ``--num-servers``
server tasks beside the workers in one barrier stage (``@executors``, ``server_placement="executors"``;
the session then has a slot for each). The Spark session starts, and one untimed async fit per
placement warms its Python workers, before anything is timed. The runs are interleaved (every repeat runs every variant, the order
rotated by one each repeat, so that the load of a shared machine hits every variant alike); the
tables give the median and the spread [min-max] over the repeats of:

- ``fit``: the whole call (``model.fit``, or ``sparkdl.fit`` from its checks to the returned model);
- ``epoch 2``: the wall time of the second epoch (the first also traces the train step and, in
  sparkdl, compiles the server's update), of the slowest worker; ``x one``: its ratio to one
  process's second epoch, the step cost the issue's goal is about;
- ``epoch 2 CPU``: the CPU seconds the epoch cost: one process's own; for sparkdl the workers'
  and the driver's (the parameter server) over that epoch (Spark's JVM is left out: it idles
  while the workers train). Under ``@executors`` the server runs in a task process that is not
  sampled: there the column holds the workers' and the (idle) driver's CPU only. On a shared machine other jobs' load stretches the wall times,
  sparkdl's three processes more than one process's two threads (each exchange waits for the
  scheduler to run the server, then the worker), while the CPU a run costs holds still: each
  repeat prints the load average it ended at.

Then where an async step goes, per push (each worker pushes once a step, and a step's wall time
here is the training loop's, both epochs, as the counters'), from the counters
``sparkdl.fit`` returns in ``result.stats``: the worker's waits for a push (sending, the server's
NaN check and update, the answer) and a pull (the server's read, receiving), the server's own
parts of those, and the rest of the worker's step (forward, backward, fusing the gradients,
assigning the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from workloads import WORKLOADS, local_session  # noqa: E402

WORKERS = 2
VARIANTS = {"single": None, "async": None, "async-bf16": "bf16", "async-fp16": "fp16"}


def epoch_clock(directory: str):
    """A Keras callback writing each epoch's start and end (wall clock, and the process's CPU time) to a file of
    the process's own in ``directory``: in sparkdl it runs in every worker."""
    import keras

    class EpochClock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._begin = (time.time(), time.process_time())

        def on_epoch_end(self, epoch, logs=None):
            (begin, cpu), end = self._begin, time.time()
            record = {"epoch": epoch, "begin": begin, "end": end, "cpu": time.process_time() - cpu}
            with open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a") as out:
                out.write(json.dumps(record) + "\n")

    return EpochClock()


class CpuSampler:
    """This process's CPU time, sampled every 20 ms while it runs: the driver's share of an epoch."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), time.process_time()))
            self._stop.wait(0.02)

    def between(self, begin: float, end: float) -> float:
        """CPU seconds used between the wall-clock times ``begin`` and ``end`` (to the nearest samples)."""
        inside = [cpu for wall, cpu in self.samples if begin <= wall <= end]
        return inside[-1] - inside[0] if len(inside) > 1 else 0.0


def timings(directory: str, driver: CpuSampler | None) -> dict:
    """``train``: the training loop's wall time (first epoch's start to last epoch's end, over the processes);
    ``epoch2``: the slowest process's second epoch; ``cpu2``: the CPU of every process (and the driver's) in it."""
    epochs = []
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as lines:
            epochs += list(map(json.loads, lines))
    second = [e for e in epochs if e["epoch"] == 1]
    begin, end = min(e["begin"] for e in second), max(e["end"] for e in second)
    return {
        "train": max(e["end"] for e in epochs) - min(e["begin"] for e in epochs),
        "epoch2": max(e["end"] - e["begin"] for e in second),
        "cpu2": sum(e["cpu"] for e in second) + (driver.between(begin, end) if driver else 0.0),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["single", "async", "async-bf16"], choices=list(VARIANTS))
    parser.add_argument("--workload", default="mlp8m", choices=list(WORKLOADS))
    parser.add_argument("--placement", nargs="+", default=["driver"], choices=["driver", "executors"])
    parser.add_argument("--num-servers", type=int, default=1)
    args = parser.parse_args(argv)

    import sparkdl

    workload = WORKLOADS[args.workload]
    placements = list(dict.fromkeys(args.placement))
    # Each async variant once per placement; one placement keeps the variant's plain name.
    variants = [
        v if v == "single" or len(placements) == 1 else f"{v}@{p}"
        for v in args.variants
        for p in (placements if v != "single" else ["driver"])
    ]
    spark = local_session(WORKERS + (args.num_servers if "executors" in placements else 0))
    x, y = workload.arrays()
    scratch = tempfile.mkdtemp(prefix="sparkdl-ps-step-")
    df = spark.read.parquet(workload.parquet(scratch)).cache()
    df.count()

    def run(name: str) -> dict:
        variant, _, where = name.partition("@")
        placement = where or placements[0]
        clocks = tempfile.mkdtemp(dir=scratch)
        model = workload.model()
        started = time.perf_counter()
        if variant == "single":
            model.fit(
                x, y, batch_size=WORKERS * workload.batch_size, epochs=workload.epochs, verbose=0,
                callbacks=[epoch_clock(clocks)],
            )  # fmt: skip
            return {"fit": time.perf_counter() - started, **timings(clocks, None), "stats": {}}
        with CpuSampler() as driver:
            result = sparkdl.fit(
                df, model, num_workers=WORKERS, mode="async", epochs=workload.epochs,
                batch_size=workload.batch_size, seed=0, progress=False, callbacks=[epoch_clock(clocks)],
                num_servers=args.num_servers, server_placement=placement,
                **({"compression": VARIANTS[variant]} if VARIANTS[variant] else {}),
            )  # fmt: skip
        fit = time.perf_counter() - started
        return {"fit": fit, **timings(clocks, driver), "stats": result.stats}

    for placement in placements:  # the first fit of a session starts the Python workers, importing TensorFlow
        run(f"async@{placement}")
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            runs[variant].append(run(variant))
            figures = runs[variant][-1]
            print(
                f"repeat {repeat + 1}: {variant:<18} fit {figures['fit']:.2f}s  epoch 2 {figures['epoch2']:.2f}s "
                f"(CPU {figures['cpu2']:.2f}s)  load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )

    parameters = sum(int(np.prod(w.shape)) for w in workload.model().trainable_weights)
    print(
        f"\n{workload.name}: {parameters:,} parameters, {workload.rows:,} rows, {workload.epochs} epochs; one "
        f"process: batch {WORKERS * workload.batch_size} on {os.cpu_count()} cores; sparkdl async: {WORKERS} "
        f"workers x {workload.batch_size}, {args.num_servers} server shard(s) ({' and '.join(placements)}); "
        f"median [min-max] of {args.repeats} interleaved repeats"
    )
    one = {key: [r[key] for r in runs["single"]] for key in ("epoch2", "cpu2")} if "single" in runs else None
    print("| run | fit s | epoch 2 s | epoch 2 x one | epoch 2 CPU s | CPU x one |")
    print("|---|---|---|---|---|---|")
    for variant, results in runs.items():
        cells = [spread([r["fit"] for r in results], "{:.2f}")]
        for key in ("epoch2", "cpu2"):
            cells.append(spread([r[key] for r in results], "{:.2f}"))
            # each repeat against the one-process run of the same repeat: interleaved, under the same load
            cells.append(spread([r[key] / o for r, o in zip(results, one[key])], "{:.2f}") if one else "")
        print(f"| {variant} | " + " | ".join(cells) + " |")

    parameter_server = [variant for variant in runs if variant != "single"]
    if parameter_server:
        print("\nwhere an async step goes, ms per push (both epochs; each worker pushes once a step)")
        print("| phase | " + " | ".join(parameter_server) + " |")
        print("|---|" + "---|" * len(parameter_server))
        for label, phase in PHASES:
            cells = [spread([phase(r) for r in runs[variant]], "{:.1f}") for variant in parameter_server]
            print(f"| {label} | " + " | ".join(cells) + " |")


def spread(values: list[float], form: str) -> str:
    """The median of ``values`` and their range."""
    return f"{form.format(statistics.median(values))} [{form.format(min(values))}-{form.format(max(values))}]"


def _per_push(run: dict, *names: str) -> float:
    return 1e3 * sum(run["stats"][name] for name in names) / run["stats"]["pushes"]


def _step(run: dict) -> float:
    """A worker's wall time per step over the training loop (as the counters: both epochs)."""
    return 1e3 * run["train"] * WORKERS / run["stats"]["pushes"]


PHASES = [
    ("a worker's step (wall)", _step),
    ("push: send, the server's check and update, the answer", lambda r: _per_push(r, "push_seconds")),
    ("- server: NaN/infinity check", lambda r: _per_push(r, "check_seconds")),
    ("- server: the optimizer's update (under the lock)", lambda r: _per_push(r, "apply_seconds")),
    ("pull: request, the server's read, receiving", lambda r: _per_push(r, "pull_seconds")),
    ("- server: reading the weights (under the lock)", lambda r: _per_push(r, "read_seconds")),
    (
        "the rest of the step: forward, backward, fusing, assigning",
        lambda r: _step(r) - _per_push(r, "push_seconds", "pull_seconds"),
    ),
    ("MB on the wire per step (push + pull)", lambda r: r["stats"]["bytes"] / r["stats"]["pushes"] / 1e6),
]


if __name__ == "__main__":
    main()
