"""What sparkdl left behind on the emulated cluster after a fit: shared-memory segments still held, temporary files.

sparkdl's shared-memory segments are memfds named ``sparkdl-...`` (nothing in /dev/shm by design: one there is a
defect too); its temporary files and folders start with ``sparkdl-`` (models saved on the way, spilled partitions),
a checkpoint's not yet moved into place with ``.tmp-``. Every process of the cluster writes its temporary files
under the cluster's scratch folder (``SparkCluster``), so a walk of it sees the cluster's and no other program's.
"""

from __future__ import annotations

import contextlib
import os
import time

from hostnet.spark_cluster import SparkCluster

SEGMENT = "/memfd:sparkdl-"
TEMPORARY_PREFIXES = ("sparkdl-", ".tmp-")


def segments_held(pids: list[int]) -> list[str]:
    """``pid: /memfd:sparkdl-...`` for each sparkdl segment these processes hold (a descriptor or a mapping)."""
    held = []
    for pid in pids:
        with contextlib.suppress(OSError):  # the process ended
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith(SEGMENT):
                        held.append(f"{pid}: {link}")
            with open(f"/proc/{pid}/maps") as maps:
                held += sorted({f"{pid}: {line.split()[-2]} (mapped)" for line in maps if SEGMENT in line})
    return held


def temporary_files(folders: list[str]) -> list[str]:
    """The paths under ``folders`` whose names start with one of :data:`TEMPORARY_PREFIXES`."""
    found = []
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                if name.startswith(TEMPORARY_PREFIXES):
                    found.append(os.path.join(root, name))
    return found


def left_behind(cluster: SparkCluster, *checkpoint_dirs: str, wait: float = 20.0) -> list[str]:
    """Every segment still held by a process of the cluster (or this one), every sparkdl file in /dev/shm and every
    temporary file of the cluster or in ``checkpoint_dirs``, once they have had ``wait`` seconds to go (a cancelled
    task ends a moment after its job); [] when nothing is left."""
    deadline = time.monotonic() + wait
    while True:
        pids = [*cluster.network.processes(), os.getpid()]
        found = segments_held(pids)
        found += [f"/dev/shm/{name}" for name in os.listdir("/dev/shm") if "sparkdl" in name]
        found += temporary_files([cluster.scratch, *checkpoint_dirs])
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
