"""Which Python the executors' workers run, and whether they fork from sparkdl's worker daemon (local modes).

In local modes the executors are threads of the driver's JVM, on this machine: with neither
``PYSPARK_PYTHON`` nor ``spark.pyspark.python`` set, PySpark would start ``python3`` from the
``PATH``; :func:`use_driver_python` makes it the driver's own interpreter instead (classic
sessions: ``SparkContext.pythonExec``, which PySpark reads whenever it builds a Python UDF or
``mapInArrow`` function). In ``local[...]`` mode the workers also fork from :data:`WORKER_DAEMON`,
which imports TensorFlow once, unless the session names a daemon of its own, or an interpreter its
Python code may start cannot import sparkdl (:func:`use_worker_daemon`).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import weakref

from sparkdl.launch import session

_log = logging.getLogger(__name__)

_DEFAULT_PYTHON = "python3"  # what PySpark starts on the executors when nothing says otherwise
# spark.python.daemon.module that forks the workers with TensorFlow loaded (a name: importing it here would
# make ``python -m`` run a module that is already imported).
WORKER_DAEMON = "sparkdl.launch.worker_daemon"
_DAEMON_SETTING = "spark.python.daemon.module"
#: The longest an executor may take to start a Python worker for a task and import what the task imports, however
#: short the job's ``timeout`` (a network wait's): a new executor on a busy two-core machine took more than 20 s for
#: its Python daemon and TensorFlow, and fits with ``timeout=10`` or ``20`` failed there before training began. The
#: executors' check (``probe``) waits this long at least, and the ranks of a barrier stage wait this long for a rank
#: whose task Spark runs but whose Python has not started (``stage.StageWatch``).
STARTUP_SECONDS = 300.0
# The SparkContexts whose workers use_driver_python moved off ``python3``: Python code the session made before
# (a DataFrame of local rows, a UDF) keeps the interpreter it was made with, and still starts ``python3``.
_moved_off_default: weakref.WeakSet = weakref.WeakSet()
_declined: weakref.WeakSet = weakref.WeakSet()  # the SparkContexts whose workers cannot fork from WORKER_DAEMON


def classic_context(spark):
    """The SparkContext of a classic session; None over Spark Connect, which has none."""
    return None if session.is_connect(spark) else spark.sparkContext


def forks_from_worker_daemon(sc) -> bool:
    """Whether the SparkContext ``sc`` starts its Python workers from :data:`WORKER_DAEMON`."""
    return sc.getConf().get(_DAEMON_SETTING, "") == WORKER_DAEMON


def use_driver_python(spark) -> None:
    """Classic sessions: the executors run ``spark.pyspark.python`` if set, else, in local modes, this Python.

    ``PYSPARK_PYTHON`` (the environment variable) always wins: PySpark read it when the
    SparkContext started. Spark Connect sessions are left alone (their server decides).
    """
    sc = classic_context(spark)
    if sc is None or os.environ.get("PYSPARK_PYTHON"):
        return
    configured = sc.getConf().get("spark.pyspark.python", None)
    wanted = configured or (sys.executable if sc.master.startswith("local") else None)
    if wanted and sc.pythonExec == _DEFAULT_PYTHON:
        # PySpark reads spark.pyspark.python only under spark-submit; as a builder setting it is ignored.
        _log.info(
            "sparkdl: Python workers run %s (%s)",
            wanted,
            "spark.pyspark.python" if configured else "the driver's Python; local mode",
        )
        sc.pythonExec = wanted
        _moved_off_default.add(sc)


def use_worker_daemon(spark) -> None:
    """``local[...]`` classic sessions: Python workers fork from :data:`WORKER_DAEMON` (TensorFlow imported once,
    before the forks) unless the session names a daemon module (``spark.python.daemon.module``) of its own.

    Spark reads that setting whenever it starts Python code for a task (``BasePythonRunner``), from the
    configuration the local executors share with the driver: set here, it applies from the next Python
    worker on (workers already started stay as they are), for every interpreter the session's Python code
    starts: so only where each of them imports sparkdl (``python3`` too, where :func:`use_driver_python` moved
    the workers off it). Executors of other masters (``local-cluster`` too) read their own copy when they
    start: there it must be given where the session is built.
    """
    sc = classic_context(spark)
    if sc is None or not session.is_local_mode(sc.master):
        return
    live = sc._conf  # the SparkContext's own configuration (``getConf()`` returns a copy)
    forks = (live.get("spark.python.use.daemon", "true") or "true").strip().lower() != "false"
    if not forks or live.get(_DAEMON_SETTING, None) is not None or sc in _declined:
        return
    pythons = [sc.pythonExec] + ([_DEFAULT_PYTHON] if sc in _moved_off_default else [])
    lacking = [python for python in pythons if not _finds_sparkdl(python)]
    if lacking:
        _declined.add(sc)
        _log.info(
            "sparkdl: local Python workers do not fork from %s: %s, which Python code of this session may start, "
            "cannot import sparkdl",
            WORKER_DAEMON,
            lacking[0],
        )
        return
    _log.info("sparkdl: local Python workers fork from %s, which imports TensorFlow once", WORKER_DAEMON)
    live.set(_DAEMON_SETTING, WORKER_DAEMON)


@functools.cache
def _finds_sparkdl(python: str) -> bool:
    """Whether the local interpreter ``python`` imports the worker daemon's module (sparkdl, numpy, PySpark): one
    that cannot would start no Python worker at all, and the probe, run by Spark's own daemon, names what it lacks.
    Another interpreter than the driver's is asked once per process (a second or so)."""
    found = shutil.which(python)
    if found is None:
        return False
    if os.path.abspath(found) == os.path.abspath(sys.executable):
        return True
    try:
        imports = subprocess.run([found, "-c", f"import {WORKER_DAEMON}"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return imports.returncode == 0
