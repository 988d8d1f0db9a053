"""A fit that goes on with fewer workers: a Spark standalone cluster of two workers (separate JVMs on loopback) loses
one for good, mid-epoch; with ``min_workers=1`` the fit starts again from its newest step checkpoint on the worker
left, its batch doubled to keep the global batch, and every row is trained once per epoch; without it the fit fails
within its timeout, saying why (never a hang)."""

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pyspark
import pytest
from test_step_checkpoints import EPOCHS, ROWS, _attempts

SPARK_HOME = os.path.dirname(pyspark.__file__)

DRIVER = """
import json, sys, time
sys.path[:0] = {paths!r}
import keras
from pyspark.sql import SparkSession
from test_step_checkpoints import _fit, _ids_frame, _model

class Slow(keras.callbacks.Callback):  # time for the test to see a step checkpoint and take a worker away
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.3)

spark = (
    SparkSession.builder.master({master!r}).config("spark.executor.cores", "1").config("spark.executor.memory", "1g")
    .config("spark.driver.host", "127.0.0.1").config("spark.ui.enabled", "false").getOrCreate()
)
try:
    result = _fit(_ids_frame(spark), _model({log_dir!r}, marker={marker!r}), num_workers=2, checkpoint_dir={ckpt!r},
                  checkpoint_every=2, callbacks=[Slow()], timeout=20, {extra})
    print("RESULT " + json.dumps({{"stats": result.stats, "num_workers": result.num_workers}}))
except Exception as error:
    print("ERROR " + json.dumps(str(error)))
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def standalone(tmp_path):
    """A standalone master and two workers of one core each, every JVM in a process group of its own."""
    env = {**os.environ, "SPARK_HOME": SPARK_HOME, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    port = _free_port()
    master = f"spark://127.0.0.1:{port}"
    spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
    processes = [
        subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port)]
            + ["--webui-port", str(_free_port())],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    for index in range(2):
        work = tmp_path / f"work{index}"
        work.mkdir()
        processes.append(
            subprocess.Popen(
                [spark_class, "org.apache.spark.deploy.worker.Worker", master, "--cores", "1", "--memory", "2g"]
                + ["--host", "127.0.0.1", "--webui-port", str(_free_port()), "--work-dir", str(work)],
                env=env,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        yield master, processes[1:]
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def _run_driver(tmp_path, master, workers, extra):
    """Runs the driver; once epoch 1 has a step checkpoint, kills worker 1 (its JVM and executor) for good."""
    ckpt, log_dir, marker = tmp_path / "ckpt", tmp_path / "rows", tmp_path / "second-run"
    log_dir.mkdir()
    script = DRIVER.format(
        paths=[os.path.dirname(__file__)],
        master=master,
        log_dir=str(log_dir),
        marker=str(marker),
        ckpt=str(ckpt),
        extra=extra,
    )
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300  # bounds on waits, not timing claims
    while not (ckpt.exists() and any(n.startswith("epoch-000001-step-") for n in os.listdir(ckpt))):
        assert driver.poll() is None, "the driver ended before a step checkpoint of epoch 1"
        assert time.monotonic() < deadline, "no step checkpoint of epoch 1 within 300 s"
        time.sleep(0.05)
    marker.touch()  # attempts from here on are the second run's
    os.killpg(workers[1].pid, signal.SIGKILL)  # the worker and its executor: the slot never comes back
    out, _ = driver.communicate(timeout=300)
    line = next(line for line in out.splitlines() if line.startswith(("RESULT ", "ERROR ")))
    kind, payload = line.split(" ", 1)
    return kind, json.loads(payload), log_dir


@pytest.mark.slow
def test_a_fit_goes_on_with_the_workers_left_when_one_does_not_come_back(standalone, tmp_path):
    master, workers = standalone
    kind, result, log_dir = _run_driver(tmp_path, master, workers, "min_workers=1")

    assert kind == "RESULT", result
    assert result["num_workers"] == 1
    assert result["stats"]["workers_lost"] == [
        {"num_workers": [2, 1], "batch_size": [16, 32], "global_batch": [32, 32]}
    ]
    at = result["stats"]["resumed_at"]
    (shards, planned, _), *_ = at["segments"]
    assert at["epoch"] == 1 and shards == 2
    kept = at["epoch"] * planned + at["step"]  # the first run's global steps that its checkpoint holds
    attempts = _attempts(log_dir)
    counted = collections.Counter(
        row for (_, second), calls in attempts.items() for call, row in calls if second or call < kept
    )
    assert counted == collections.Counter({row: EPOCHS for row in range(ROWS)})


@pytest.mark.slow
def test_without_min_workers_a_lost_slot_fails_the_fit_within_its_timeout(standalone, tmp_path):
    master, workers = standalone
    started = time.monotonic()
    kind, message, _ = _run_driver(tmp_path, master, workers, "")

    assert kind == "ERROR"
    assert "Expected 2 task slots for the training stage" in message and "min_workers=1" in message
    assert "since an executor was lost on 127.0.0.1," in message  # the host that lost it
    assert time.monotonic() - started < 240


@pytest.mark.slow
def test_a_sync_ps_fit_whose_lost_worker_cannot_run_again_fails_within_its_timeout(standalone, tmp_path):
    """sync_ps's rounds need every worker: the lost worker's retry waits for a slot while the other waits for its
    push. The fit watches the slots as a barrier stage does and fails, naming the host (was: the two waited for
    each other through Spark's retries of the other worker's timeouts)."""
    master, workers = standalone
    started = time.monotonic()
    kind, message, _ = _run_driver(tmp_path, master, workers, "mode='sync_ps'")

    assert kind == "ERROR", message
    assert "Expected 2 task slots for the training stage" in message
    assert "since an executor was lost on 127.0.0.1," in message
    assert time.monotonic() - started < 240


@pytest.mark.slow
def test_an_ssp_fit_with_min_workers_goes_on_without_its_lost_worker(standalone, tmp_path):
    """ssp with min_workers=1: the worker left sets the silent one aside after timeout and finishes its epochs;
    then the lost worker's task, retried by Spark on the slot that freed, resumes at its own step and finishes its
    own."""
    master, workers = standalone
    kind, result, _ = _run_driver(tmp_path, master, workers, "mode='ssp', max_staleness=1, min_workers=1")

    assert kind == "RESULT", result
    assert len(result["stats"]["workers_set_aside"]) == 1  # the worker whose executor was killed, set aside once
    assert result["num_workers"] == 2
