"""A digits fit in ``mode="pipeline"`` (two stages, one replica) against ``mode="sync"`` (two workers), in one warm
session: the ratio issue 43 asks to bring to 2x or less.

    python benchmarks/pipeline_vs_sync.py [--repeats 2] [--baseline DIR]

Each repeat is a fresh process (``local[2]``): a first sync fit starts the Python workers and is not counted, then
sync and pipeline fit the digits workload (``benchmarks/workloads.py``: 20 epochs, batch 16, seed 0) one after the
other. ``--baseline DIR`` measures another source tree of sparkdl (a checkout of an earlier commit) as well, its
processes alternating with this tree's; each process's ratio is of two fits it timed itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child() -> None:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.path.insert(0, HERE)
    from workloads import WORKLOADS, local_session

    spark = local_session(2)
    workload = WORKLOADS["digits"]
    frame = workload.frame(spark)
    workload.fit(frame, 2, mode="sync")  # the Python workers start and import TensorFlow
    seconds = {}
    for mode, options in (("sync", {}), ("pipeline", {"num_stages": 2})):
        clock = time.monotonic()
        workload.fit(frame, 2, mode=mode, **options)
        seconds[mode] = time.monotonic() - clock
    print(json.dumps(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--baseline", help="another sparkdl source tree, measured alternately")
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + ([("baseline", os.path.abspath(args.baseline))] if args.baseline else [])
    seen: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for _ in range(args.repeats):
        for name, tree in trees:
            # The tree first on every process's path; run from elsewhere: `python -m` (the executors' Python
            # workers) puts the working directory before it, and this tree's would shadow a baseline's.
            path = [tree, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
            with tempfile.TemporaryDirectory(prefix="pipeline-vs-sync-") as elsewhere:
                done = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--child"],
                    env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
                    cwd=elsewhere,
                    capture_output=True,
                    text=True,
                    check=True,
                )
            seen[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'tree':<10} {'sync':>8} {'pipeline':>9} {'ratio':>6}")
    for name, runs in seen.items():
        for run in runs:
            print(f"{name:<10} {run['sync']:>7.1f}s {run['pipeline']:>8.1f}s {run['pipeline'] / run['sync']:>5.1f}x")


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
    else:
        main()
