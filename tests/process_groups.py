"""A test's child process that starts a Spark of its own: run in its own process group, so that the JVM and the
Python workers it started end with it, also when it runs past its time."""

import os
import signal
import subprocess
from pathlib import Path


def run_in_own_group(command: list[str], *, cwd, env: dict, log: Path, timeout: float) -> int | None:
    """Runs ``command`` with stdout and stderr into ``log``; its exit status, or None when it ran past ``timeout``
    (then it and everything it started are killed)."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
