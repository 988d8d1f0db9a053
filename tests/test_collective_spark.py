"""The communicator as Spark tasks get it: shared memory between tasks of one host, chosen without being asked, and gone after the job."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import sparkdl
from sparkdl import collective


def _memfds_held() -> list[str]:
    """Every sparkdl shared-memory segment some process on this host still holds (descriptors and mappings)."""
    held = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("/memfd:sparkdl-"):
                    held.append(f"{pid}: {link}")
            with open(f"/proc/{pid}/maps") as maps:
                held += [f"{pid}: {line.split()[-2]}" for line in maps if "/memfd:sparkdl-" in line]
        except OSError:
            continue  # the process ended, or is not ours to read
    return held


def _memfds_left(seconds: float = 20.0) -> list[str]:
    """The segments still held once the job's tasks have had ``seconds`` to end (a cancelled task ends late)."""
    deadline = time.monotonic() + seconds
    while (held := _memfds_held()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


def _allreduce_through_the_default_path():
    comm = collective.communicator()
    data = np.arange(1 << 18, dtype=np.float32) * (comm.rank + 1)
    before = sum(sent + received for sent, received in comm.traffic().values())
    total = collective.allreduce(data)
    tcp_bytes = sum(sent + received for sent, received in comm.traffic().values()) - before
    return {
        "pid": os.getpid(),
        "chosen": comm._algorithm("allreduce", None, data.nbytes).name,
        "segment": _own_memfds(),
        "tcp_bytes": tcp_bytes,
        "correct": bool(np.array_equal(total, np.arange(1 << 18, dtype=np.float32) * 3)),
        "mean": collective.allreduce(np.full(3, float(comm.rank)), collective.ReduceOp.MEAN).tolist(),
    }


def _own_memfds() -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the descriptor listdir itself used
    return [link for link in links if link.startswith("/memfd:sparkdl-")]


def test_tasks_of_one_host_reduce_through_shared_memory_unasked_and_leave_nothing_behind(spark):
    result = sparkdl.run(_allreduce_through_the_default_path, num_workers=2, spark=spark, timeout=120)
    assert result["correct"] and result["mean"] == [0.5, 0.5, 0.5]
    assert result["chosen"] == "hierarchical"
    assert result["segment"], "the task held no shared-memory segment"
    assert result["tcp_bytes"] == 0, "a 1 MB allreduce between tasks of one host went over TCP"
    assert result["pid"] != os.getpid()
    assert not _memfds_left(), "a shared-memory segment outlived its job"


def _fail_on_rank_1_inside_an_allreduce_sequence():
    collective.allreduce(np.ones(1000, np.float32))
    if collective.rank() == 1:
        raise RuntimeError("rank 1 gives up")
    collective.allreduce(np.ones(1000, np.float32))


def test_a_failed_job_leaves_no_segment_behind(spark):
    with pytest.raises(sparkdl.WorkerError, match="rank 1 gives up"):
        sparkdl.run(_fail_on_rank_1_inside_an_allreduce_sequence, num_workers=2, spark=spark, timeout=60)
    assert not _memfds_left(), "a shared-memory segment outlived its failed job"
