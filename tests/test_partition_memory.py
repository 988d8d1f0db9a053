"""A partition larger than the worker's memory limit trains and validates: the worker streams it to disk and
reads it back a batch at a time, its training rows and its held-out rows alike.

The limit is real: the test makes a memory cgroup (v1, as root) and starts the job's PySpark daemon in it
through a wrapper script, so the daemon and the worker it forks are held to ``LIMIT`` bytes of memory
(swap included); an in-memory partition of ``ROWS`` x 100 float32 values (``PARTITION`` bytes, more
than ``LIMIT``) could not fit, nor could its training rows alone, nor its held-out rows beside TensorFlow.
The cgroup's own counters show the limit was reached and held.
"""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROWS = 4_000_000
PARTITION = ROWS * 100 * 4  # 1.6 GB as float32
VALIDATION_SPLIT = 0.25  # about 1.2 GB of training rows and 0.4 GB held out
TENSORFLOW = 800 << 20  # what a TensorFlow worker takes before any data
LIMIT = 1_100 << 20
CGROUPS = Path("/sys/fs/cgroup/memory")
HERE = Path(__file__).resolve().parent


@pytest.fixture
def memory_cgroup():
    if not os.access(CGROUPS, os.W_OK):
        pytest.skip(f"needs a writable cgroup v1 memory hierarchy at {CGROUPS} (root)")
    group = CGROUPS / f"sparkdl-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(LIMIT))
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(LIMIT))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            subprocess.run(["kill", "-9", pid], check=False)
        group.rmdir()


def test_partition_larger_than_the_memory_limit_trains(memory_cgroup, tmp_path):
    assert (1 - VALIDATION_SPLIT) * PARTITION > LIMIT and VALIDATION_SPLIT * PARTITION > LIMIT - TENSORFLOW
    wrapper = tmp_path / "python-in-cgroup"
    wrapper.write_text(f'#!/bin/sh\necho $$ > {memory_cgroup / "cgroup.procs"}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_GATEWAY_PORT", "SPARK_REMOTE")}
    done = subprocess.run(
        [sys.executable, str(HERE / "memory_job.py"), str(ROWS), str(wrapper), str(VALIDATION_SPLIT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    held_out = result["validation_rows"]
    assert abs(held_out / ROWS - VALIDATION_SPLIT) < 0.01 and result["steps"] == -(-(ROWS - held_out) // 4096)
    assert result["metrics"] == ["loss", "val_loss"]
    peak = int((memory_cgroup / "memory.max_usage_in_bytes").read_text())
    print(f"cgroup peak {peak >> 20} MB, limit hit {(memory_cgroup / 'memory.failcnt').read_text().strip()} times")
    assert peak > 600 << 20, f"the worker did not run in the cgroup (peak {peak} bytes)"  # it held TensorFlow
    assert peak <= LIMIT
