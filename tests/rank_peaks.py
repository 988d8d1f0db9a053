"""Each rank's peak resident memory in a sync, a sharded and a shard_weights=True fit of one model, measured once
per test run by benchmarks/zero_memory.py in a Spark of its own (fresh Python workers for every task)."""

import functools
import json
import os
import sys
import tempfile
from pathlib import Path

from process_groups import run_in_own_group

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "zero_memory.py"


@functools.cache
def rank_peaks() -> dict:
    """``{"weight_bytes": W, "sync": [rank peaks, highest first], "sharded": [...], "shard_weights": [...]}``: 8
    Dense(1024) layers with Adam (W about 30 MB), 2 workers, one epoch of 4 steps."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_GATEWAY_PORT", "SPARK_REMOTE")}
    with tempfile.TemporaryDirectory(prefix="rank-peaks-") as directory:
        log = Path(directory) / "log"
        status = run_in_own_group(
            [sys.executable, str(BENCHMARK), "--json"], cwd=BENCHMARK.parent, env=env, log=log, timeout=540
        )
        output = log.read_text()
    assert status == 0, output[-6000:]
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))
