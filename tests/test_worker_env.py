"""The executors' Python is checked before any training stage, and local modes run the driver's own Python.

Each wrong interpreter gets its own short-lived Spark session in a subprocess (the suite's shared
session keeps its Python), on ``local[2,4]``: a failing task would be retried up to 4 times there,
so the event log shows whether anything failed or was retried, and whether a training stage began.
"""

import glob
import json
import os
import re
import stat
import subprocess
import sys
import textwrap

import pytest

# Most tests start a short-lived Spark with a wrong worker Python: the slow command.
pytestmark = pytest.mark.slow

import sparkdl
from sparkdl.launch import probe, worker_python

# Runs in a fresh Python: trains (sparkdl.fit) or launches (sparkdl.run) on local[2,4], prints one JSON line.
_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "tensorflow"
    from pyspark.sql import SparkSession
    import sparkdl

    what, event_dir, conf_python, daemon = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    builder = (SparkSession.builder.master("local[2,4]").config("spark.driver.host", "127.0.0.1")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.eventLog.enabled", "true").config("spark.eventLog.dir", event_dir)
               .config("spark.eventLog.compress", "false").config("spark.eventLog.rolling.enabled", "false"))
    if conf_python:
        builder = builder.config("spark.pyspark.python", conf_python)
    if daemon:
        builder = builder.config("spark.python.daemon.module", daemon)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    outcome = {}
    try:
        if what in ("fit", "fit-twice"):
            import keras, logging
            if what == "fit-twice":  # fit's phase lines, on stderr
                logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
                logging.getLogger("sparkdl").setLevel(logging.INFO)
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
            df = spark.createDataFrame([([float(i), 1.0], float(i)) for i in range(8)], "features array<float>, label float")
            for _ in range(2 if what == "fit-twice" else 1):
                sparkdl.fit(df, model, num_workers=2, epochs=1, batch_size=4, progress=False,
                            timeout=float(os.environ["FIT_TIMEOUT"]))
            outcome["result"] = "trained"
        else:
            def where():
                import gc, os, sys
                with open(f"/proc/{os.getppid()}/cmdline", "rb") as parent:
                    forked_by = parent.read().replace(b"\\0", b" ").decode()
                return sys.executable, os.getpid(), "tensorflow" in sys.modules, forked_by, gc.get_freeze_count()
            if what == "run-after-probe":  # as fit does: check (and load TensorFlow) first
                from sparkdl.launch import probe
                probe.check_workers(spark, 2, 120.0)
            outcome["result"] = sparkdl.run(where, num_workers=2)
    except Exception as exc:
        outcome.update(type=type(exc).__name__, message=str(exc), mro=[c.__name__ for c in type(exc).__mro__])
    spark.stop()
    print("OUTCOME " + json.dumps(outcome))
""")


def _run_script(
    tmp_path, what, *, env_python=None, conf_python=None, daemon=None, path_python=sys.executable, fit_timeout=600
):
    """Runs ``_SCRIPT`` in a fresh Python with ``path_python`` as the ``python3`` of its ``PATH``; its fits take
    ``timeout=fit_timeout``."""
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    events = tmp_path / "events"
    events.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env["FIT_TIMEOUT"] = str(fit_timeout)
    if env_python is not None:
        env["PYSPARK_PYTHON"] = env_python
    on_path = tmp_path / "path"
    on_path.mkdir()
    (on_path / "python3").write_text(f'#!/bin/sh\nexec "{path_python}" "$@"\n')  # a link would lose a venv
    (on_path / "python3").chmod(0o755)
    env["PATH"] = f"{on_path}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        [sys.executable, str(script), what, f"file://{events}", conf_python or "", daemon or ""],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(lines[-1][len("OUTCOME ") :]), _spark_events(events), done.stdout + done.stderr


def _spark_events(directory) -> dict:
    """The jobs, stages and task attempts of the subprocess's application, from its event log."""
    (path,) = glob.glob(f"{directory}/*")
    events = [json.loads(line) for line in open(path)]
    jobs = [e for e in events if e["Event"] == "SparkListenerJobStart"]
    stages = [e["Stage Info"] for e in events if e["Event"] == "SparkListenerStageSubmitted"]
    tasks = [e for e in events if e["Event"] == "SparkListenerTaskEnd"]
    probe_stages = [
        set(j["Stage IDs"]) for j in jobs if "sparkdl-probe" in (j.get("Properties") or {}).get("spark.job.tags", "")
    ]
    return {
        "job_tags": [(j.get("Properties") or {}).get("spark.job.tags", "") for j in jobs],
        "probe_tasks": [sum(t["Stage ID"] in stages for t in tasks) for stages in probe_stages],  # per probe job
        "barrier_stages": [s["Stage Name"] for s in stages if any(r.get("Barrier") for r in s["RDD Info"])],
        "attempts": [t["Task Info"]["Attempt"] for t in tasks],
        "failed_tasks": [t["Task End Reason"] for t in tasks if t["Task End Reason"]["Reason"] != "Success"],
    }


@pytest.fixture(scope="module")
def python_without_packages(tmp_path_factory):
    """A Python 3.11 virtualenv with nothing installed: no pyarrow, numpy, TensorFlow or sparkdl."""
    target = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True, timeout=120)
    python = target / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import pyarrow"], capture_output=True).returncode != 0
    return str(python)


@pytest.mark.parametrize("setting", ["PYSPARK_PYTHON", "spark.pyspark.python"])
def test_fit_names_the_missing_modules_before_training(tmp_path, python_without_packages, setting):
    outcome, events, output = _run_script(
        tmp_path,
        "fit",
        **(
            {"env_python": python_without_packages}
            if setting == "PYSPARK_PYTHON"
            else {"conf_python": python_without_packages}
        ),
    )

    assert outcome.get("type") == "WorkerEnvironmentError" and "RuntimeError" in outcome["mro"], outcome
    message = outcome["message"]
    assert python_without_packages in message  # the executor's interpreter, as the executor reported it
    for module in ("numpy", "pyarrow", "tensorflow", "sparkdl"):
        assert module in message
    assert "No module named 'numpy'" in message
    assert "PYSPARK_PYTHON" in message and "spark.archives" in message and sys.executable in message
    # One small job ran (the probe, tagged), nothing failed or was retried, and no training stage began.
    assert events["barrier_stages"] == []
    assert events["failed_tasks"] == [] and set(events["attempts"]) == {0}
    assert any("sparkdl-probe" in tags for tags in events["job_tags"])
    assert "Traceback" not in output.split("OUTCOME")[0]


def test_a_python_that_does_not_start_is_one_clear_error(tmp_path):
    # Present on the driver (so only the executors find out), but it cannot start a Python worker.
    broken = tmp_path / "python"
    broken.write_text('#!/bin/sh\nexec /no/such/python "$@"\n')
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    outcome, events, _ = _run_script(tmp_path, "run", env_python=str(broken))

    assert outcome.get("type") == "WorkerEnvironmentError", outcome
    message = outcome["message"]
    assert str(broken) in message and "before any training started" in message
    assert "PYSPARK_PYTHON" in message and "spark.archives" in message
    assert len(message.splitlines()) <= 3 and "\tat " not in message  # no Java stack in the message
    assert events["barrier_stages"] == []


def test_a_missing_interpreter_fails_before_any_spark_job(tmp_path):
    outcome, events, _ = _run_script(tmp_path, "run", env_python="/no/such/python")

    assert outcome.get("type") == "WorkerEnvironmentError", outcome
    assert "'/no/such/python' does not exist" in outcome["message"]
    assert events["job_tags"] == []


def test_local_mode_workers_run_the_driver_python_forked_with_tensorflow_loaded(tmp_path):
    """No PYSPARK_PYTHON, no daemon module named: the tasks run this Python, forked from sparkdl's worker daemon,
    which the training check (the first to need TensorFlow) set for the local session, with TensorFlow loaded."""
    outcome, events, _ = _run_script(tmp_path, "run-after-probe")

    ranks = outcome.get("result")
    assert ranks is not None, outcome
    executable, pid, tensorflow_loaded, forked_by, _ = ranks  # rank 0's
    assert executable == sys.executable
    assert f"-m {worker_python.WORKER_DAEMON}" in forked_by, forked_by
    assert tensorflow_loaded, "the barrier task's Python worker did not start with TensorFlow loaded"
    assert len(events["barrier_stages"]) == 1
    # Every worker comes from the one daemon: the training check and run's own check run one task each.
    assert events["probe_tasks"] == [1, 1]


def test_a_session_that_names_pysparks_daemon_keeps_it_and_the_probe_warms_every_worker(tmp_path):
    """spark.python.daemon.module given (here PySpark's own): sparkdl leaves it; the training check then runs one
    task per worker, each importing TensorFlow into a Python worker the barrier task reuses."""
    outcome, events, _ = _run_script(tmp_path, "run-after-probe", daemon="pyspark.daemon")

    ranks = outcome.get("result")
    assert ranks is not None, outcome
    _, _, tensorflow_loaded, forked_by, _ = ranks
    assert "-m pyspark.daemon" in forked_by, forked_by
    assert tensorflow_loaded, "the barrier task did not run in a Python worker the probe had warmed"
    assert events["probe_tasks"] == [2, 2]


def test_sparkdls_worker_daemon_forks_workers_with_tensorflow_loaded(tmp_path):
    """With spark.python.daemon.module set to sparkdl's, TensorFlow is imported once, before the workers fork.

    The probe then needs one task in local mode (all workers come from the same daemon), which leaves
    the other task slot free for the data checks that run beside it.
    """
    outcome, events, output = _run_script(tmp_path, "run-after-probe", daemon=worker_python.WORKER_DAEMON)

    ranks = outcome.get("result")
    assert ranks is not None, outcome
    executable, _, tensorflow_loaded, forked_by, frozen = ranks
    assert executable == sys.executable
    assert f"-m {worker_python.WORKER_DAEMON}" in forked_by, forked_by
    assert tensorflow_loaded
    # TensorFlow's objects came frozen from the daemon: the collection PySpark runs after every task skips them.
    assert frozen > 100_000, frozen
    assert events["probe_tasks"] == [1, 1] and events["failed_tasks"] == []
    assert "found in sys.modules" not in output  # runpy's warning when the daemon module was imported before it ran


def test_rows_made_before_the_first_fit_under_another_python3_train_without_the_worker_daemon(
    tmp_path, python_without_packages
):
    """The DataFrame of local rows is made while the session's workers are still PySpark's default, the ``python3`` of
    the PATH (here one without sparkdl), and reading it starts that Python. sparkdl's worker daemon cannot start
    there, so the fit does not name it for the session: the rows are read as PySpark reads them, and the fit trains
    on the driver's Python, with TensorFlow loaded by the probe in every worker."""
    outcome, events, output = _run_script(tmp_path, "fit-twice", path_python=python_without_packages)

    assert outcome.get("result") == "trained", outcome
    assert "python3, which Python code of this session may start, cannot import sparkdl" in output
    assert f"fork from {worker_python.WORKER_DAEMON}" not in output.replace("do not fork from", "")
    assert events["probe_tasks"] == [2] and events["failed_tasks"] == [] and len(events["barrier_stages"]) == 2


def test_a_fit_that_started_the_check_says_how_to_start_it_earlier(tmp_path):
    """A session's first fit starts the check of its executors' Python (which imports TensorFlow there) and waits
    for it; its phase line says how to run that beside the driver's work. The session's second fit, which finds
    the check passed, does not. That Python takes 8 s to start, the fits' network waits 3 s: the check waits for
    the start (``worker_python.STARTUP_SECONDS``), not for ``timeout`` (was: "did not finish within timeout=3s",
    as fits with timeout=10 and 20 failed on CI's machine while a new executor's Python imported TensorFlow)."""
    slow = tmp_path / "python"
    slow.write_text(f'#!/bin/sh\nsleep 8\nexec "{sys.executable}" "$@"\n')
    slow.chmod(slow.stat().st_mode | stat.S_IEXEC)
    outcome, events, output = _run_script(tmp_path, "fit-twice", env_python=str(slow), fit_timeout=3)

    assert outcome.get("result") == "trained", outcome
    assert events["failed_tasks"] == [] and len(events["barrier_stages"]) == 2
    first, second = [line for line in output.splitlines() if line.startswith("sparkdl.api: sparkdl: phases ")]
    checked = float(re.search(r"worker check ([0-9.]+)s", first).group(1))
    assert checked >= 8, first  # the Python's start, then TensorFlow's import
    assert "sparkdl.check_executors(spark, num_workers, wait=False) right after the session starts" in first
    assert "waited for 0.00s" in second and "check_executors" not in second, second


def test_probe_passes_once_per_session_on_the_shared_session(spark):
    """The suite's session: the probe reports this Python, then is remembered (no second job)."""
    pending = probe.start_check(spark, 2, 120.0)
    pending.wait()
    assert probe.start_check(spark, 2, 120.0) is pending  # remembered: no second job
    reports = probe._run_probe(spark, 2, probe.TRAINING_MODULES)
    assert {r["python"] for r in reports} == {sys.executable}
    assert all(not r["missing"] and r["sparkdl"] == sparkdl.__version__ for r in reports)
