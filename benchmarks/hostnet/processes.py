"""The subprocess helpers every part of the emulated hosts uses: commands, lines with a timeout, dying with a parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import threading
import time

PR_SET_PDEATHSIG, PR_SET_TIMERSLACK = 1, 29


def run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=check)


def die_with_parent() -> None:
    """This process ends with the one that started it (``ip netns exec`` execs in place: that is the script)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Started:
    """Something that ``start()``s on entering a ``with`` block and ``close()``s at its end, also when starting failed
    half-way (``close`` removes whatever ``start`` had made)."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


_LINES: dict[int, queue.Queue] = {}  # by process id: the lines its reader thread has read so far ("" at the end)


def readline(process: subprocess.Popen, timeout: float) -> str:
    """The next line ``process`` writes ("" once it has ended), waiting at most ``timeout`` seconds.

    A thread per process reads its lines: ``select`` on the pipe would miss a second line that a
    ``readline`` already took into the file's buffer with the first.
    """
    lines = _LINES.get(process.pid)
    if lines is None:
        lines = _LINES[process.pid] = queue.Queue()

        def read() -> None:
            for line in process.stdout:
                lines.put(line)
            lines.put("")

        threading.Thread(target=read, name=f"lines of {process.pid}", daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"no answer from {process.args} within {timeout} s") from None


def namespace_processes(namespaces: list[str]) -> list[int]:
    """The ids of the processes in these network namespaces (``ip netns`` names)."""
    inodes = set()
    for name in namespaces:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(f"/run/netns/{name}").st_ino)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # ended meanwhile
            if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes:
                found.append(int(pid))
    return found


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state first); [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def gone(pid: int) -> bool:
    """The process has ended (a zombie counts as ended)."""
    fields = stat_fields(pid)
    return not fields or fields[0] == "Z"


def kill_all(pids: list[int], wait: float = 10.0) -> None:
    """SIGKILL (a stopped process too), then wait until they are gone (at most ``wait`` seconds)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
