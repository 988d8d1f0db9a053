"""Checks, before any training stage, that the executors' Python can run sparkdl, and starts its workers early.

A wrong worker interpreter (``python3`` from the executors' ``PATH``, without pyarrow or
TensorFlow) otherwise surfaces as a barrier stage retried several times and a page of Java
frames ending in ``ModuleNotFoundError``. Here one small job of plain Python UDF tasks
(``useArrow=False``: it needs nothing but what Spark ships) imports what the training tasks
import and reports the executor's interpreter; every exception is caught inside the task,
so no task fails and nothing is retried, and the driver raises one
:class:`WorkerEnvironmentError` naming the module, the interpreter and the fix.

Where no GPU is in sight, the probe also imports TensorFlow in the executors' Python workers,
which Spark keeps for later tasks (``spark.python.worker.reuse``, on by default): the training
stage then starts without paying for that import. With sparkdl's worker daemon
(``worker_python.WORKER_DAEMON``, which forks every worker with TensorFlow loaded) in local mode, one task
checks them all. Run in a background thread (:func:`start_check`), the probe overlaps what the
driver prepares meanwhile (the model's bytes, the settings).

In local modes the executors are threads of the driver's JVM, on this machine: with neither
``PYSPARK_PYTHON`` nor ``spark.pyspark.python`` set, PySpark would start ``python3`` from the
``PATH``; ``worker_python`` makes it the driver's own interpreter instead, and in ``local[...]``
mode makes the workers fork from sparkdl's worker daemon. A passing probe is remembered per session
and interpreter.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable

from sparkdl.launch import session, slots
from sparkdl.launch.worker_python import (
    STARTUP_SECONDS,
    classic_context,
    forks_from_worker_daemon,
    use_driver_python,
    use_worker_daemon,
)

_log = logging.getLogger(__name__)

# What the tasks import: sparkdl's launcher (``sparkdl.run``), and training or inference on top of it.
LAUNCH_MODULES = ("numpy", "pyarrow", "sparkdl")
TRAINING_MODULES = ("numpy", "pyarrow", "keras", "tensorflow", "sparkdl")
_SUBMIT_WAIT_SECONDS = 10.0  # the longest start_check waits for the probe's job to be on its way
_HINT_SECONDS = 1.0  # a fit that started a check this long is told how to start it earlier
_checks: dict = {}  # (session, interpreter, modules) -> its PendingCheck, running or passed
_checks_lock = threading.Lock()


class WorkerEnvironmentError(RuntimeError):
    """The executors' Python cannot run sparkdl: a module is missing, or the interpreter does not start."""


def check_executors(spark, num_workers: int, *, timeout: float = 600.0, wait: bool = True) -> PendingCheck:
    """Checks that the executors' Python can run sparkdl's training tasks, and loads TensorFlow there.

    ``fit`` runs this check itself; calling it first, right after the session starts, overlaps it
    with the driver's own work (``wait=False`` returns at once: ``fit``, or ``.wait()``, waits for
    this same check). A missing module raises :class:`WorkerEnvironmentError` naming it, the
    executors' interpreter and the fix::

        spark = SparkSession.builder.getOrCreate()
        sparkdl.check_executors(spark, num_workers=2, wait=False)
        ...  # read the data, build the model
        sparkdl.fit(df, model, num_workers=2)
    """
    pending = start_check(spark, num_workers, timeout)
    if wait:
        pending.wait()
    return pending


def check_workers(spark, num_workers: int, timeout: float, modules: tuple = TRAINING_MODULES) -> None:
    """Runs the probe (unless it already passed for this session and interpreter) and waits; raises if it fails."""
    start_check(spark, num_workers, timeout, modules).wait()


def startup_timeout(job_timeout: float) -> float:
    """How long a job whose network waits take up to ``job_timeout`` waits for its check: at least
    ``worker_python.STARTUP_SECONDS``, since starting the executors' Python is not a network wait."""
    return max(job_timeout, STARTUP_SECONDS)


def start_check(spark, num_workers: int, timeout: float, modules: tuple = TRAINING_MODULES) -> PendingCheck:
    """Starts the probe in a background thread; ``wait()`` for it.

    The probe imports ``modules`` in ``num_workers`` tasks; TensorFlow, when among them, stays
    loaded in those Python workers (unless GPUs are about, see the module's docstring). A check
    already running or passed for this session, interpreter and modules is returned instead of a
    new one, so a job can start it as soon as its session exists and ``fit`` waits for that one.
    """
    use_driver_python(spark)
    if "tensorflow" in modules:  # the tasks import it: once in the daemon, not in every worker
        use_worker_daemon(spark)
    key = (*_session_key(spark), modules)
    with _checks_lock:
        existing = _checks.get(key)
        if existing is not None:
            return existing
        _check_local_python(spark)
        pending = _checks[key] = PendingCheck(spark, key, timeout)
    pending.start(num_workers, modules)
    return pending


class PendingCheck:
    """A probe running in a background thread; ``wait()`` returns when it passed and raises when it did not."""

    def __init__(self, spark, key: tuple, timeout: float):
        self._spark = spark
        self._key = key
        self._timeout = timeout
        self._tag = session.JobTag(spark, "sparkdl-probe")
        self._reports: list[dict] = []
        self._failure: BaseException | None = None
        self._submitting = threading.Event()  # the probe's job is about to be submitted (or the probe ended)
        self.started = time.perf_counter()
        self.seconds = 0.0  # the probe job's duration

    def start(self, num_workers: int, modules: tuple) -> None:
        # The probe's job carries the job tags of the thread starting it (a fit's slot claim, ``slots``):
        # a classic session's tags are the local properties of the thread, which a new thread does not inherit.
        sc = classic_context(self._spark)
        properties = sc._jsc.sc().getLocalProperties().clone() if sc is not None else None
        self._thread = threading.Thread(
            target=self._run, args=(num_workers, modules, properties), name="sparkdl-probe", daemon=True
        )
        self._thread.start()
        # Its job goes first: jobs the caller starts next (fit's checks) would otherwise take the task slots, and
        # its task (with sparkdl's daemon, the only one: its Python worker imports TensorFlow) would wait for them.
        self._submitting.wait(_SUBMIT_WAIT_SECONDS)

    def _run(self, num_workers: int, modules: tuple, properties) -> None:
        started = time.perf_counter()
        try:
            if properties is not None:
                self._spark.sparkContext._jsc.sc().setLocalProperties(properties)
            with self._tag, slots.probing(self._tag.name):
                self._reports = _run_probe(self._spark, num_workers, modules, self._submitting)
        except BaseException as exc:  # raised to the caller of wait(), in its thread
            self._failure = exc
        finally:
            self._submitting.set()
            self.seconds = time.perf_counter() - started

    def wait(self) -> float:
        """Returns how long it blocked (concurrent fits may wait for the same check)."""
        started = time.perf_counter()
        self._thread.join(self._timeout)
        waited = time.perf_counter() - started
        try:
            if self._thread.is_alive():
                self._tag.cancel()
                raise WorkerEnvironmentError(
                    "sparkdl's check of the executors' Python environment did not finish within "
                    f"timeout={self._timeout}s (its job was cancelled): the cluster may be busy, or its Python "
                    "workers fail to start."
                )
            if self._failure is not None:
                raise WorkerEnvironmentError(_job_failure_message(self._spark, self._failure)) from None
            _raise_for(self._reports)
        except WorkerEnvironmentError:
            with _checks_lock:  # not remembered: the next fit checks again (after the environment is fixed)
                if _checks.get(self._key) is self:
                    del _checks[self._key]
            raise
        _log.debug(
            "sparkdl: worker check %s",
            "; ".join(
                f"{r['host']} pid {r['pid']} {r['python']} (Python {r['version']}): imports {r['seconds']:.2f}s"
                + (", TensorFlow loaded" if r.get("warmed") else "")
                for r in self._reports
            ),
        )
        return waited

    def summary(self, waited: float, asked: float) -> str:
        """What the check cost a caller that asked for it at ``asked`` (``time.perf_counter()``) and ``waited`` for
        it, in words (for ``fit``'s phase line); where that caller started it, how to start it earlier."""
        warmed = sum(bool(r.get("warmed")) for r in self._reports or ())
        slowest = max((r["seconds"] for r in self._reports or ()), default=0.0)
        hint = (
            "; sparkdl.check_executors(spark, num_workers, wait=False) right after the session starts would have "
            "run it beside the driver's own work"
            if self.started >= asked and self.seconds >= _HINT_SECONDS
            else ""
        )
        return (
            f"worker check {self.seconds:.2f}s in the background, waited for {waited:.2f}s (imports "
            f"{slowest:.2f}s" + (f", TensorFlow loaded in {warmed} Python worker(s)" if warmed else "") + ")" + hint
        )


def _run_probe(spark, num_workers: int, modules: tuple, submitting: threading.Event | None = None) -> list[dict]:
    """Every executor Python's report; ``submitting`` is set just before the probe's job is submitted."""
    from pyspark.sql import functions as F

    tasks = 1 if _one_preloading_python(spark) else num_workers
    probe = F.udf(_probe_function(modules), "string", useArrow=False)
    frame = spark.range(tasks, numPartitions=tasks).select(probe("id"))
    if submitting is not None:
        submitting.set()
    rows = frame.collect()
    return [json.loads(row[0]) for row in rows]


def _one_preloading_python(spark) -> bool:
    """Local mode with sparkdl's worker daemon: every task's Python is forked from one that loads TensorFlow.

    One probe task then checks (and warms) them all: ``num_workers`` tasks would hold every slot of
    a small machine while the daemon imports TensorFlow, for nothing.
    """
    sc = classic_context(spark)
    return sc is not None and session.is_local_mode(sc.master) and forks_from_worker_daemon(sc)


def _probe_function(modules: tuple) -> Callable[[int], str]:
    """The task's code, self-contained: pickled by value, so an executor without sparkdl can run it."""

    def probe(_row: int) -> str:
        import importlib
        import importlib.util
        import json
        import os
        import platform
        import shutil
        import socket
        import sys
        import time

        report: dict = {
            "python": sys.executable,
            "version": platform.python_version(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "missing": {},
            "sparkdl": None,
            "warmed": False,
            "seconds": 0.0,
        }
        started = time.perf_counter()
        saved = []
        try:
            from pyspark import TaskContext

            context = TaskContext.get()
            gpus = context is not None and "gpu" in context.resources()
            # Importing TensorFlow before sparkdl pins a task's GPU would fix the devices it sees: check only.
            warm = "tensorflow" in modules and not gpus and shutil.which("nvidia-smi") is None
            # keras.runtime.use_tensorflow_backend, inlined: this code runs where sparkdl may not import.
            os.environ.setdefault("KERAS_BACKEND", "tensorflow")
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
            sys.stdout.flush()
            sys.stderr.flush()
            # TensorFlow's start-up lines go nowhere here (the training tasks, which no longer print them, relay theirs).
            sink = os.open(os.devnull, os.O_WRONLY)
            saved = [(fd, os.dup(fd)) for fd in (1, 2)]
            for fd, _ in saved:
                os.dup2(sink, fd)
            os.close(sink)
            for name in modules:
                try:
                    if name in ("keras", "tensorflow") and not warm:
                        if importlib.util.find_spec(name) is None:
                            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                        continue
                    module = importlib.import_module(name)
                    if name == "sparkdl":
                        report["sparkdl"] = getattr(module, "__version__", "unknown")
                except BaseException as exc:  # noqa: B036 -- nothing may fail the task
                    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
                    report["missing"][name] = {"module": missing or name, "error": f"{type(exc).__name__}: {exc}"}
            report["warmed"] = warm and "tensorflow" in sys.modules
        except BaseException as exc:  # noqa: B036
            report["missing"]["probe"] = {"module": "probe", "error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
        report["seconds"] = time.perf_counter() - started
        return json.dumps(report)

    return probe


def _raise_for(reports: list[dict]) -> None:
    import sparkdl

    for report in reports:
        where = f"the executors' Python ({report['python']}, Python {report['version']}, on host {report['host']})"
        if report["missing"]:
            names = ", ".join(dict.fromkeys(problem["module"] for problem in report["missing"].values()))
            first = next(iter(report["missing"].values()))["error"]
            raise WorkerEnvironmentError(
                f"sparkdl cannot run on the executors: {where} cannot import {names} ({first}). {_FIX}"
            )
        if report["sparkdl"] != sparkdl.__version__:
            raise WorkerEnvironmentError(
                f"sparkdl versions differ: the driver runs {sparkdl.__version__}, {where} has "
                f"{report['sparkdl']}. Install the same sparkdl release on the executors, or {_FIX_SHORT}"
            )


_FIX_SHORT = (
    "set PYSPARK_PYTHON (or spark.pyspark.python) to a Python that has sparkdl installed, "
    "or ship a packed virtualenv with spark.archives"
)
_FIX = (
    "The executors' Python must have sparkdl and its dependencies installed. Fix: set PYSPARK_PYTHON "
    f"(or spark.pyspark.python) to a Python with sparkdl installed (this driver runs {sys.executable}); "
    "or install sparkdl on every executor (pip install 'sparkdl[cpu]'); or ship a packed virtualenv "
    "with spark.archives (venv-pack, then --archives env.tar.gz#env and spark.pyspark.python=./env/bin/python)."
)


def _job_failure_message(spark, exc: BaseException) -> str:
    python = _configured_python(spark)
    return (
        f"The executors' Python{f' ({python})' if python else ''} failed to run sparkdl's environment check, "
        f"before any training started: {_root_cause(exc)}\n{_FIX}"
    )


def _root_cause(exc: BaseException) -> str:
    """The telling line of a Spark job failure (the deepest cause), not its pages of Java frames."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for marker in ("Cannot run program", "PYTHON_VERSION_MISMATCH", "Error: ", "Exception: "):
        found = [line for line in lines if marker in line and not line.startswith("at ")]
        if found:
            return found[-1][:500]
    return (lines[0] if lines else type(exc).__name__)[:500]


def _configured_python(spark) -> str | None:
    """The interpreter the executors were told to start (unknown over Spark Connect: the server decides)."""
    sc = classic_context(spark)
    return sc.pythonExec if sc is not None else None


def _check_local_python(spark) -> None:
    """Local modes run the workers on this machine: a missing interpreter is known before any job."""
    sc = classic_context(spark)
    if sc is None or not sc.master.startswith("local"):
        return
    relative = os.sep in sc.pythonExec and not os.path.isabs(sc.pythonExec)  # inside spark.archives, per executor
    if not relative and shutil.which(sc.pythonExec) is None:
        raise WorkerEnvironmentError(
            f"The executors' Python interpreter {sc.pythonExec!r} does not exist or is not executable on this "
            f"machine (local mode, master={sc.master!r}). {_FIX}"
        )


def _session_key(spark) -> tuple:
    sc = classic_context(spark)
    if sc is None:
        return ("connect", spark.session_id)
    return ("classic", sc.applicationId, sc.pythonExec)
