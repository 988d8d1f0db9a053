"""Large payloads between the driver and the tasks travel over sparkdl's relay or Spark's file server, never
through a JVM's heap; where Spark's own path must carry them (average mode), a model too large is refused first.

The model tests run their own Spark (this file, run once as a script for all of them: one child process, one
JVM) with a driver JVM heap smaller than the model: in local mode that JVM also runs the executor, so
neither the model going to the task nor the trained model coming back may pass
through it. The models' weights are random, so that no compression (a broadcast's
lz4) could shrink them below the heap either.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

# A child Spark moving a model larger than its JVM heap: the slow command.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(960)]  # the first test waits for the child (up to 900 s)

import sparkdl
from sparkdl.launch import payloads, rendezvous, run_tasks, stage
from sparkdl.launch.errors import ResultLost

# The smallest sizes that prove the point: a 256 MB driver heap (below Spark's own floor, hence
# spark.testing.memory) and a 4500 x 20000 Dense layer, a ~360 MB .keras archive each way.
_HEAP, _INPUTS, _UNITS = "256m", 4500, 20000


def _pattern(size: int, period: int) -> np.ndarray:
    return ((np.arange(size) % period + 1) / period).astype(np.float32)


def _child_spark(heap: str):
    """The child process's own Spark: one task slot, a driver JVM heap of ``heap``."""
    os.environ["KERAS_BACKEND"] = "tensorflow"
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[1]")
        .appName("sparkdl-large-results")
        .config("spark.driver.memory", heap)
        .config("spark.testing.memory", str(512 << 20))
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _dense(inputs: int, units: int, learning_rate: float = 0.01):
    """A Dense layer with a random kernel (seeded: 4 incompressible bytes a weight) and a zero bias, under SGD."""
    import keras

    model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(units, bias_initializer="zeros")])
    model.layers[0].kernel.assign(np.random.default_rng(0).standard_normal((inputs, units), np.float32) * 0.01)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=learning_rate), loss="mse")
    return model


def _heap_bytes(spark) -> int:
    return spark.sparkContext._jvm.java.lang.Runtime.getRuntime().maxMemory()


def _train_large_model(heap: str, mode: str, inputs: int, units: int) -> dict:
    """The child process: one SGD step on a Dense layer, in ``mode`` on one worker.

    With x and y of one row, MSE and learning rate units/2, the step takes the kernel from W0 to
    W0 - outer(x, x W0 - y) and the bias to y - x W0 exactly (up to float32 rounding): the whole
    model is checked, not a sample.
    """
    spark = _child_spark(heap)
    x, y = _pattern(inputs, 97), _pattern(units, 89)
    df = spark.createDataFrame([(x.tolist(), y.tolist())], "features array<float>, label array<float>")
    model = _dense(inputs, units, learning_rate=units / 2)
    start = model.layers[0].kernel.numpy()
    blocks = range(0, inputs, 500)
    error = sum(x[b : b + 500].astype(np.float64) @ start[b : b + 500].astype(np.float64) for b in blocks) - y
    result = sparkdl.fit(df, model, num_workers=1, epochs=1, batch_size=1, shuffle=False, progress=False, mode=mode)
    kernel, bias = (variable.numpy() for variable in result.model.layers[0].weights)
    worst = max(
        float(np.max(np.abs(kernel[b : b + 500] - (start[b : b + 500] - np.outer(x[b : b + 500], error)))))
        for b in blocks
    )
    return {
        "heap_bytes": _heap_bytes(spark),
        "weight_bytes": int(kernel.nbytes + bias.nbytes),
        "kernel_error": worst,
        "bias_error": float(np.max(np.abs(bias + error))),
        "initial_epoch": result.initial_epoch,
        "jvm_alive_count": spark.range(1000).count(),
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_model_larger_than_the_driver_jvm_heap_goes_to_the_task_and_back_intact(child_reports, mode):
    """sync: the model goes to rank 0 and back over the relay. async: every task fetches it from the relay,
    and the trained model is the parameter server's, on the driver."""
    report = _report(child_reports, f"train-{mode}")
    assert report["weight_bytes"] > 1.3 * report["heap_bytes"], report  # the model cannot fit in the JVM's heap
    assert report["kernel_error"] < 1e-5 and report["bias_error"] < 1e-5, report
    assert report["initial_epoch"] == 0 and report["jvm_alive_count"] == 1000, report


def _score_with_large_model(heap: str, inputs: int, units: int) -> dict:
    """The child process: ``KerasModel.transform`` with a model larger than the heap, against in-process predict."""
    from sparkdl.ml import KerasModel

    spark = _child_spark(heap)
    x = np.random.default_rng(1).random((3, inputs), np.float32)
    df = spark.createDataFrame([(i, row.tolist()) for i, row in enumerate(x)], "id int, features array<float>")
    model = _dense(inputs, units)
    scored = KerasModel.from_keras(model, featuresCol="features").transform(df).orderBy("id").collect()
    predicted = np.array([row.prediction for row in scored])
    expected = np.asarray(model.predict_on_batch(x), np.float64)
    return {
        "heap_bytes": _heap_bytes(spark),
        "weight_bytes": 4 * model.count_params(),
        "shape": list(predicted.shape),
        "worst_error": float(np.max(np.abs(predicted - expected))),
        "scale": float(np.max(np.abs(expected))),
        "jvm_alive_count": spark.range(1000).count(),
    }


def test_keras_model_transform_scores_with_a_model_larger_than_the_driver_jvm_heap(child_reports):
    """The model reaches the executor as a file Spark's file server streams (no broadcast in the heap)."""
    report = _report(child_reports, "score")
    assert report["weight_bytes"] > 1.3 * report["heap_bytes"], report
    assert report["shape"] == [3, _UNITS], report
    assert report["worst_error"] < 1e-5 * report["scale"], report
    assert report["jvm_alive_count"] == 1000, report


def _average_in_a_small_heap(heap: str, inputs: int, units: int) -> dict:
    """The child process: average mode trains a model its heap can carry, and refuses a larger one before its jobs."""
    spark = _child_spark(heap)
    rng = np.random.default_rng(2)
    rows = [(rng.random(inputs).tolist(), rng.random(units).tolist()) for _ in range(4)]
    df = spark.createDataFrame(rows, "features array<float>, label array<float>")
    settings = dict(num_workers=1, epochs=1, batch_size=2, mode="average", progress=False)
    small = sparkdl.fit(
        df.selectExpr("slice(features, 1, 64) AS features", "slice(label, 1, 8) AS label"), _dense(64, 8), **settings
    )
    tracker = spark.sparkContext.statusTracker()
    jobs_before = set(tracker.getJobIdsForGroup())
    try:
        sparkdl.fit(df, _dense(inputs, units), **settings)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    jobs = sorted(set(tracker.getJobIdsForGroup()) - jobs_before)
    return {
        "heap_bytes": _heap_bytes(spark),
        "weight_bytes": 4 * inputs * units,
        "small_loss": small.history["loss"],
        "small_rounds": small.stats["rounds"],
        "refusal": refusal,
        "stages_of_the_refused_fit": [
            tracker.getStageInfo(stage).name for job in jobs for stage in tracker.getJobInfo(job).stageIds
        ],
        "jvm_alive_count": spark.range(1000).count(),
    }


def test_average_mode_refuses_a_model_its_driver_heap_cannot_carry_before_its_jobs_and_trains_one_it_can(
    child_reports,
):
    """Average mode's state goes out by broadcast and its deltas come back in task results, through the driver
    JVM's heap: a model too large for it is refused, naming the setting and the size; a small one trains."""
    report = _report(child_reports, "average")
    assert report["weight_bytes"] > 1.3 * report["heap_bytes"], report
    assert report["small_rounds"] >= 1 and np.isfinite(report["small_loss"]).all(), report
    needed = re.search(r"spark\.driver\.memory of at least (\d+) MB", report["refusal"] or "")
    assert needed and int(needed.group(1)) << 20 > report["weight_bytes"], report  # the setting and the size it needs
    # refused before any job: the rows are checked in the training stage, which never started
    assert report["stages_of_the_refused_fit"] == [], report
    assert report["jvm_alive_count"] == 1000, report


#: The child's scenarios, in the order it runs them: each one's report, or its traceback.
_SCENARIOS = {
    "train-sync": lambda: _train_large_model(_HEAP, "sync", _INPUTS, _UNITS),
    "train-async": lambda: _train_large_model(_HEAP, "async", _INPUTS, _UNITS),
    "score": lambda: _score_with_large_model(_HEAP, _INPUTS, _UNITS),
    "average": lambda: _average_in_a_small_heap(_HEAP, _INPUTS, _UNITS),
}


@pytest.fixture(scope="module")
def child_reports(tmp_path_factory) -> dict:
    """Runs this file as a script in a fresh process (its own Spark, one JVM for every scenario) and returns its
    JSON reports by scenario; a scenario that fails there fails only its own test."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    child = subprocess.run(
        [sys.executable, __file__],
        cwd=tmp_path_factory.mktemp("large-results"),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def _report(reports: dict, scenario: str) -> dict:
    outcome = reports[scenario]
    assert "report" in outcome, f"scenario {scenario!r} failed in the child:\n{outcome['error']}"
    return outcome["report"]


class _OnRecord(logging.Handler):
    """Creates ``path`` when the driver logs a record containing ``text``, then holds the logging thread ``pause``
    seconds (the relay's: the upload's acknowledgement waits)."""

    def __init__(self, text: str, path: str, pause: float = 0.0):
        super().__init__(logging.DEBUG)
        self.text, self.path, self.pause = text, path, pause

    def emit(self, record):
        if self.text in record.getMessage():
            open(self.path, "w").close()
            time.sleep(self.pause)


@contextlib.contextmanager
def _on_records(caplog, *handlers):
    logger = logging.getLogger(payloads.__name__)
    caplog.set_level(logging.INFO, logger=stage.__name__)
    caplog.set_level(logging.DEBUG, logger=payloads.__name__)  # the last: caplog's handler takes this level
    for handler in handlers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for handler in handlers:
            logger.removeHandler(handler)


def test_a_retried_attempts_result_never_mixes_with_the_kept_one(spark, tmp_path, caplog):
    """Partition 0's first attempt uploads its result; partition 1 then dies without raising, so Spark retries: the
    driver must return each partition's result from the attempt Spark kept. Spark runs the whole barrier stage
    again (the retry's result for partition 0, the first one's dropped) or, where partition 0's first attempt's
    success reached the scheduler after partition 1's failure, partition 1 alone (partition 0's first result kept),
    which cannot train without partition 0: its rerun runs nothing, and its result, which never reached the driver,
    is lost (``ResultLost`` where the caller asks for it). Which one depends on that race."""
    uploaded, died = str(tmp_path / "partition-0-uploaded"), str(tmp_path / "partition-1-died")

    def task(batches, reporter):
        from pyspark import TaskContext

        for _ in batches:
            pass
        partition = TaskContext.get().partitionId()
        if partition == 1 and not os.path.exists(died):
            deadline = time.monotonic() + 120
            while not os.path.exists(uploaded) and time.monotonic() < deadline:
                time.sleep(0.1)
            open(died, "w").close()
            os._exit(1)  # a lost task: no error report, Spark's retry of the stage is the remedy
        return f"partition {partition}, {'retry' if os.path.exists(died) else 'first try'}".encode()

    with _on_records(caplog, _OnRecord("result of partition 0,", uploaded)):
        results = run_tasks(spark.range(2, numPartitions=2), 2, task, barrier=True, timeout=60)
    assert os.path.exists(died)  # the first attempt's result reached the driver before the stage failed
    messages = [record.getMessage() for record in caplog.records]
    dropped = [message for message in messages if "dropped" in message]
    uploads = [message for message in messages if message.startswith("sparkdl: received") and "partition 0," in message]
    if len(uploads) == 1:  # partition 0's first attempt had finished: Spark kept it and ran partition 1 alone again
        assert results[0] == b"partition 0, first try" and not dropped, (results, dropped)
        assert any("ran rank 1 of the barrier stage again alone" in message for message in messages), messages
        with pytest.raises(ResultLost, match="Rank 1's result was lost: Spark ran rank 1 of the barrier stage again"):
            results[1]
    else:  # Spark ran the whole stage again: the driver dropped the first attempt's result for the retry's
        assert len(uploads) == 2 and results[0] == b"partition 0, retry", (results, uploads)
        assert len(dropped) == 1 and "the 22-byte result of partition 0," in dropped[0], dropped
        assert results[1] == b"partition 1, retry"


def test_a_rank_run_again_alone_after_its_result_reached_the_driver_gets_that_result_back(spark, tmp_path, caplog):
    """Partition 1 uploads its result and dies before its task can report success (its executor lost at the
    stage's very end); partition 0 finishes just after. Where Spark then runs partition 1 alone again (partition
    0's success reached the scheduler after partition 1's failure), the rerun trains nothing and the driver hands
    back the result of partition 1's task that met partition 0's at the rendezvous; where Spark runs the whole stage
    again, both results are the retry's. Every run of the task is counted: partition 1 alone never runs the task."""
    uploaded, died, runs = (str(tmp_path / name) for name in ("partition-1-uploaded", "partition-1-died", "runs"))
    os.mkdir(runs)

    def task(batches, reporter):
        import threading

        from pyspark import TaskContext

        for _ in batches:
            pass
        context = TaskContext.get()
        partition = context.partitionId()
        open(os.path.join(runs, f"{partition}-{context.taskAttemptId()}"), "w").close()
        rendezvous.join(reporter, partition, context.taskAttemptId(), "a record", 60)  # as every barrier task does
        first = not os.path.exists(died)
        if partition == 0 and first:  # finishes right after partition 1 dies: its success races the failure
            deadline = time.monotonic() + 120
            while not os.path.exists(died) and time.monotonic() < deadline:
                time.sleep(0.005)
        if partition == 1 and first:

            def die_once_uploaded():
                deadline = time.monotonic() + 120
                while not os.path.exists(uploaded) and time.monotonic() < deadline:
                    time.sleep(0.005)
                open(died, "w").close()
                os._exit(1)  # the result reached the driver; the task never reports success

            threading.Thread(target=die_once_uploaded, daemon=True).start()
        return f"partition {partition}, {'first try' if first else 'retry'}".encode()

    with _on_records(caplog, _OnRecord("result of partition 1,", uploaded, pause=3.0)):
        results = run_tasks(spark.range(2, numPartitions=2), 2, task, barrier=True, timeout=60)
    assert os.path.exists(died)
    ran = sorted(os.listdir(runs))
    messages = [record.getMessage() for record in caplog.records]
    if len(ran) == 2:  # partition 1 alone again: its rerun ran no task, and its first result came back
        assert dict(results) == {0: b"partition 0, first try", 1: b"partition 1, first try"}, (results, ran)
        assert any(
            "ran rank 1 of the barrier stage again alone, after the others had finished: the result of its attempt "
            "that met the others is kept" in message
            for message in messages
        ), messages
    else:  # the whole stage again
        assert len(ran) == 4 and dict(results) == {0: b"partition 0, retry", 1: b"partition 1, retry"}, (results, ran)


def test_tasks_fetch_what_the_driver_offers_and_return_it_over_the_relay(spark):
    offered = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()  # five frames and a bit

    def task(batches, reporter):
        for _ in batches:
            pass
        data = payloads.fetch(reporter, "blob")
        return hashlib.sha256(data).digest() + bytes(data[-1000:])

    results = run_tasks(spark.range(2, numPartitions=2), 2, task, barrier=False, offered={"blob": offered})
    expected = hashlib.sha256(offered).digest() + offered[-1000:]
    assert results == {0: expected, 1: expected}


def test_fetching_a_name_the_driver_does_not_offer_fails_on_the_driver_naming_it(spark):
    def task(batches, reporter):
        return bytes(payloads.fetch(reporter, "modle"))

    with pytest.raises(ValueError, match=r"no payload named 'modle'; it offers \['model'\]"):
        run_tasks(spark.range(1, numPartitions=1), 1, task, barrier=True, offered={"model": b"x"})


def test_the_relay_keeps_only_results_of_exactly_the_announced_size():
    """A task's connection that sends more than it announced, or stops short, is dropped; nothing is kept."""
    from sparkdl.launch.relay import OutputRelay
    from sparkdl.launch.relay_frames import HEADER, RELAY_ID
    from sparkdl.net.auth import connect_authenticated

    exchange = payloads.PayloadExchange()
    with OutputRelay("127.0.0.1", b"s" * 32, 3, exchange=exchange) as relay:
        for rank, announced, sent in ((0, 4, b"12345"), (1, 4, b"123"), (2, 3, b"123")):
            sock = connect_authenticated(relay.address, rank, RELAY_ID, b"s" * 32, timeout=10)
            header = json.dumps({"attempt": 7, "size": announced}).encode()
            sock.sendall(HEADER.pack(payloads._RESULT, len(header)) + header)
            sock.sendall(HEADER.pack(payloads._CHUNK, len(sent)) + sent)
            if rank == 2:  # the one honest upload is acknowledged
                sock.settimeout(10)
                kind, length = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
                assert kind == payloads._REPLY and json.loads(sock.recv(length, socket.MSG_WAITALL)) == {
                    "received": True
                }
            sock.close()
        relay.wait_until_quiet(10)
    assert exchange.take(2, 7, 3) == b"123"
    for rank in (0, 1):
        with pytest.raises(
            RuntimeError,
            match=f"Partition {rank}'s task .attempt 7. finished, but its 4-byte result "
            "never reached the driver's relay",
        ):
            exchange.take(rank, 7, 4)


if __name__ == "__main__":
    reports = {}
    for name, scenario in _SCENARIOS.items():
        try:
            reports[name] = {"report": scenario()}
        except Exception:
            reports[name] = {"error": traceback.format_exc()}
    print(json.dumps(reports))
