"""Running the jobs (jobs/train.py, jobs/predict.py) as users do, and checking what they leave: shared by the tests
that run them on Spark of their own (tests/test_jobs.py) and against a Spark Connect server (tests/test_connect.py)."""

import signal
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from process_groups import own_spark_environment

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
TRAIN_JOB = str(JOBS / "train.py")
PREDICT_JOB = str(JOBS / "predict.py")


def run_job(command, cwd, expect_rc=0, timeout=600):
    """Runs a job as a user would (this virtualenv's bin first on PATH, as after `source .venv/bin/activate`);
    returns its output, stdout and stderr together (spark-submit merges the job's stderr into stdout anyway).

    A job still running after ``timeout`` seconds gets SIGABRT, so that a Python job prints every thread's stack
    (PYTHONFAULTHANDLER); the failure shows that, and the log of a server the test started in ``cwd``.
    """
    # the jobs find their workers' Python and their session without the test suite's settings
    env = {**own_spark_environment(virtualenv_on_path=True), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.send_signal(signal.SIGABRT)
            stdout, stderr = job.communicate(timeout=60)
            server_log = Path(cwd, "server.log")
            server = server_log.read_text()[-6000:] if server_log.exists() else ""
            pytest.fail(f"the job ran past {timeout}s:\n{(stdout + stderr)[-12000:]}\n--- server.log ---\n{server}")
    output = stdout + stderr
    assert job.returncode == expect_rc, output[-6000:]
    return output


def spark_property(events, name):
    (environment,) = [e for e in events if e["Event"] == "SparkListenerEnvironmentUpdate"]
    return environment["Spark Properties"].get(name)


def spark_master(events):
    return spark_property(events, "spark.master")


def train_digits_model(directory: Path, digits):
    """A small classifier trained in-process and saved in ``directory`` as train.py saves its model: (model, path)."""
    from models import make_mlp

    x_train, _, y_train, _ = digits
    model = make_mlp(hidden=(32,))
    model.fit(x_train, y_train, epochs=3, batch_size=32, verbose=0)
    path = directory / "digits.keras"
    model.save(path)
    return model, path


PIXELS = [f"pixel{i}" for i in range(64)]


def write_digit_rows(path, x):
    """``x`` as a Parquet dataset at ``path``: an ``id`` and a double column per pixel, in two files (two tasks)."""
    table = pa.table({"id": np.arange(len(x)), **{name: x[:, i].astype(np.float64) for i, name in enumerate(PIXELS)}})
    path.mkdir()
    half = len(x) // 2
    pq.write_table(table.slice(0, half), path / "part-0.parquet")
    pq.write_table(table.slice(half), path / "part-1.parquet")
    return table


def check_scored(path, table, model, x):
    """The predict job's output at ``path``: every row of ``table`` once, its columns kept, and the class and the
    probabilities of in-process ``model.predict(x)``."""
    scored = pq.read_table(path).sort_by("id")
    assert scored.column_names == ["id", *PIXELS, "prediction", "probability"]
    np.testing.assert_array_equal(scored["id"].to_numpy(), np.arange(len(x)))  # every row, once
    np.testing.assert_array_equal(scored["pixel5"].to_numpy(), table["pixel5"].to_numpy())
    expected = model.predict(x, verbose=0)
    np.testing.assert_array_equal(scored["prediction"].to_numpy(), expected.argmax(axis=1))
    probability = np.array(scored["probability"].to_pylist())
    np.testing.assert_allclose(probability, expected, atol=1e-5)
