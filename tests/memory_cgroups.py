"""A memory cgroup that holds a test's processes to a limit, on cgroup v1 or v2 (as root), and its counters.

Used by tests/test_partition_memory.py. ``create(limit)`` makes a group at the root of whichever memory
hierarchy this machine lets root write: v1's memory controller (``memory.limit_in_bytes``, and
``memory.memsw.limit_in_bytes`` where swap is accounted) or a cgroup2 mount whose root offers the
memory controller (``memory.max``, ``memory.swap.max`` 0). A process joins it by writing its pid to
``procs``. The counters then show that the limit was real and reached: the peak usage (v1's
``memory.max_usage_in_bytes``, v2's ``memory.peak``, which kernels before 5.19 lack), and on v2 how
many times usage reached the limit (the ``max`` line of ``memory.events``; v1's ``memory.failcnt``
stays 0 on recent kernels, 6.18 here, so on v1 a peak at the limit is what shows it was reached).
Where neither hierarchy can be used, ``create`` raises ``Unavailable`` saying what is missing.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MOUNTS = Path("/proc/self/mounts")
REMOVE_SECONDS = 30.0  # for the killed processes to leave the group
REACHED_SLACK = 8 << 20  # bytes: more than the 64 pages (4 KB, or 64 KB on arm64) a charge takes at once


class Unavailable(Exception):
    """No memory cgroup can be made here; the message says what is missing."""


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: int  # 1 or 2
    limit: int  # bytes, swap included

    @property
    def procs(self) -> Path:
        """Writing a pid here moves that process (and the children it starts later) into the group."""
        return self.path / "cgroup.procs"

    def peak(self) -> int | None:
        """The highest memory usage the group reached, in bytes (None on a v2 kernel without memory.peak)."""
        peak = self.path / ("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        return int(peak.read_text()) if peak.exists() else None

    def limit_reached(self) -> bool:
        """Whether the group's usage reached its limit, so that the kernel had to reclaim to hold it there.

        v2 counts those times (``memory.events``). On v1 the peak comes within the kernel's charge batch
        (64 pages) of the limit when usage reaches it: within ``REACHED_SLACK``.
        """
        if self.version == 1:
            return int((self.path / "memory.max_usage_in_bytes").read_text()) >= self.limit - REACHED_SLACK
        events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        return int(events["max"]) > 0

    def remove(self) -> None:
        """Kills the processes left in the group, waits for them to leave it, and removes it."""
        deadline = time.monotonic() + REMOVE_SECONDS
        while pids := self.procs.read_text().split():
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} were still in {self.path} {REMOVE_SECONDS:.0f}s after SIGKILL")
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self.path.rmdir()


def create(limit: int) -> MemoryCgroup:
    """A new group held to ``limit`` bytes of memory, swap included: on cgroup v1 if it can, else on v2."""
    v1, v2 = _memory_hierarchies()
    reasons = []
    if v1 is None:
        reasons.append("no cgroup v1 memory hierarchy is mounted")
    elif not os.access(v1, os.W_OK):
        reasons.append(f"cgroup v1's memory hierarchy at {v1} is not writable (needs root, mounted read-write)")
    else:
        group = _new_group(v1, 1, limit)
        _write(group, "memory.limit_in_bytes", limit)
        if (group.path / "memory.memsw.limit_in_bytes").exists():  # memory and swap together
            _write(group, "memory.memsw.limit_in_bytes", limit)
        return group
    if v2 is None:
        reasons.append("no cgroup2 mount offers the memory controller (cgroup.controllers)")
    elif not os.access(v2, os.W_OK):
        reasons.append(f"the cgroup2 mount at {v2} is not writable (needs root, mounted read-write)")
    else:
        _enable_memory_for_children(v2)
        group = _new_group(v2, 2, limit)
        _write(group, "memory.max", limit)
        if (group.path / "memory.swap.max").exists():  # swap is limited apart from memory in v2: none at all
            _write(group, "memory.swap.max", 0)
        return group
    raise Unavailable("; ".join(reasons))


def _memory_hierarchies() -> tuple[Path | None, Path | None]:
    """The mount points of cgroup v1's memory controller and of a cgroup2 mount offering it (each or None)."""
    v1 = v2 = None
    for line in MOUNTS.read_text().splitlines():
        _, mount_point, kind, options = line.split()[:4]
        if kind == "cgroup" and "memory" in options.split(","):
            v1 = Path(mount_point)
        elif kind == "cgroup2" and "memory" in (Path(mount_point) / "cgroup.controllers").read_text().split():
            v2 = Path(mount_point)
    return v1, v2


def _enable_memory_for_children(root: Path) -> None:
    """A v2 group has the memory controller only where its parent's cgroup.subtree_control lists it."""
    control = root / "cgroup.subtree_control"
    if "memory" in control.read_text().split():
        return
    try:
        control.write_text("+memory")
    except OSError as e:  # EBUSY: the mount's root is a container's, with processes of its own in it
        raise Unavailable(f"the memory controller cannot be enabled in {control}: {e}") from None


def _new_group(root: Path, version: int, limit: int) -> MemoryCgroup:
    path = root / f"sparkdl-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return MemoryCgroup(path, version, limit)


def _write(group: MemoryCgroup, name: str, value: int) -> None:
    try:
        (group.path / name).write_text(str(value))
    except OSError:
        group.remove()
        raise
