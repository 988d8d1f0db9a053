"""A partition larger than the worker's memory limit trains and validates: the worker streams it to disk and
reads it back a batch at a time, its training rows and its held-out rows alike.

The limit is real: the test makes a memory cgroup (v1 or v2, as root: tests/memory_cgroups.py) and starts
the job's PySpark daemon in it through a wrapper script, so the daemon and the worker it forks are held to
``LIMIT`` bytes of memory (swap included); an in-memory partition of ``ROWS`` x 100 float32 values
(``PARTITION`` bytes, more than ``LIMIT``) could not fit, nor could its training rows alone, nor its held-out
rows beside TensorFlow. The cgroup's own counters show the limit was reached and held. Where no memory
cgroup can be made (not root, no memory controller) the test skips, and fails under CI (``SPARKDL_CI``).
"""

import json
import subprocess
import sys
from pathlib import Path

import memory_cgroups
import pytest
from process_groups import own_spark_environment

pytestmark = pytest.mark.slow

ROWS = 4_000_000
PARTITION = ROWS * 100 * 4  # 1.6 GB as float32
VALIDATION_SPLIT = 0.25  # about 1.2 GB of training rows and 0.4 GB held out
TENSORFLOW = 800 << 20  # what a TensorFlow worker takes before any data
LIMIT = 1_100 << 20
HERE = Path(__file__).resolve().parent


@pytest.fixture
def memory_cgroup():
    try:
        group = memory_cgroups.create(LIMIT)
    except memory_cgroups.Unavailable as missing:
        group, message = None, f"needs a memory cgroup it can write, v1 or v2, as root: {missing}"
    if group is None:
        pytest.skip(message)  # a failure under CI (tests/conftest.py): CI runs as root with a memory cgroup
    try:
        yield group
    finally:
        group.remove()


def test_partition_larger_than_the_memory_limit_trains(memory_cgroup, tmp_path):
    assert (1 - VALIDATION_SPLIT) * PARTITION > LIMIT and VALIDATION_SPLIT * PARTITION > LIMIT - TENSORFLOW
    wrapper = tmp_path / "python-in-cgroup"
    wrapper.write_text(f'#!/bin/sh\necho $$ > {memory_cgroup.procs}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = own_spark_environment()
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
    peak, reached = memory_cgroup.peak(), memory_cgroup.limit_reached()
    print(f"cgroup v{memory_cgroup.version}: peak {peak} bytes (limit {LIMIT}), limit reached: {reached}")
    # Reached: the group's processes (the worker, TensorFlow, its spilled rows in the page cache) needed more than
    # LIMIT and the kernel reclaimed to hold them under it. A worker outside the group would leave it near 0.
    assert reached, f"the cgroup's limit was never reached (peak {peak} bytes): the worker did not run under it"
    if peak is not None:  # v2 kernels before 5.19 keep no peak
        assert peak > 600 << 20, f"the worker did not run in the cgroup (peak {peak} bytes)"  # it held TensorFlow
        assert peak <= LIMIT
