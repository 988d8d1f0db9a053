"""Private scratch directories that do not outlive their process for long, however it dies.

A worker writes files on its way (a partition spilled as it arrives, a ``.keras`` archive Keras saves or loads by
path) and removes them when done; a process killed with SIGKILL (its executor preempted, lost, killed by YARN)
cannot. So each directory is named for the process that made it, ``sparkdl-<pid namespace>-<pid>-<random>``, and
every new one first removes those of the same folder whose process is gone: the next sparkdl task on the host (a
retried one, the next fit) clears what a dead one left. Only this user's directories are touched, and only those
made in this process's pid namespace (a folder shared across containers holds pids of other namespaces that mean
nothing here); a pid reused by another process keeps its directory until that one ends too.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator

_PREFIX = "sparkdl-"
_NAME = re.compile(r"^sparkdl-(\d+)-(\d+)-[0-9a-f]+$")


def make_directory(parent: str | None = None) -> str:
    """A new 0700 directory under ``parent`` (default: the system's temp directory), after removing those in
    ``parent`` left by processes that have died."""
    parent = parent or tempfile.gettempdir()
    remove_abandoned(parent)
    while True:
        path = os.path.join(parent, f"{_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:  # nearly impossible: 32 random bits
            continue


@contextlib.contextmanager
def directory(parent: str | None = None) -> Iterator[str]:
    """A scratch directory (:func:`make_directory`) for the ``with`` block, removed with its contents after it."""
    path = make_directory(parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_abandoned(parent: str) -> list[str]:
    """Removes the scratch directories in ``parent`` whose process has died (this user's, this pid namespace's);
    returns their paths."""
    namespace, uid = _pid_namespace(), os.getuid()
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or int(match[1]) != namespace or _is_alive(int(match[2])):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == uid:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _pid_namespace() -> int:
    """The inode of this process's pid namespace: pids are only comparable within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: one namespace as far as this process can tell
        return 0
