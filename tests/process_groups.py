"""A test's child process that starts a Spark of its own: its environment, without the suite's Spark settings,
and a run in its own process group, so that the JVM and the Python workers it started end with it, also when it
runs past its time."""

import os
import signal
import subprocess
import sys
from pathlib import Path

#: What the suite's own Spark leaves in this process's environment (tests/conftest.py, PySpark's gateway, Spark
#: Connect), which a child starting a Spark of its own must not inherit.
SUITES_SPARK = ("PYSPARK_PYTHON", "PYSPARK_GATEWAY_PORT", "SPARK_REMOTE")


def own_spark_environment(*, virtualenv_on_path: bool = False) -> dict[str, str]:
    """This process's environment without ``SUITES_SPARK``, for a child that starts a Spark of its own; with
    ``virtualenv_on_path``, this virtualenv's ``bin`` first on ``PATH``, as after ``source .venv/bin/activate``."""
    env = {name: value for name, value in os.environ.items() if name not in SUITES_SPARK}
    if virtualenv_on_path:
        env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"
    return env


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
