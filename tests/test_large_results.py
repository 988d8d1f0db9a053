"""Large payloads between the driver and the tasks travel over sparkdl's relay, never through a JVM's heap.

The model test runs its own Spark (this file, run as a script) with a driver JVM
heap smaller than the model: in local mode that JVM also runs the executor, so
neither the model going to the task nor the trained model coming back may pass
through it.
"""

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

# A child Spark moving a model larger than its JVM heap: the slow command.
pytestmark = pytest.mark.slow

import sparkdl
from sparkdl.launch import payloads, run_tasks

# The smallest sizes that prove the point: a 256 MB driver heap (below Spark's own floor, hence
# spark.testing.memory) and a 4500 x 20000 Dense layer, a ~360 MB .keras archive each way.
_HEAP, _INPUTS, _UNITS = "256m", 4500, 20000


def _pattern(size: int, period: int) -> np.ndarray:
    return ((np.arange(size) % period + 1) / period).astype(np.float32)


def _train_large_model(heap: str, inputs: int, units: int) -> dict:
    """The child process: one SGD step on a zero-initialised Dense layer, in sync mode on one worker.

    With x and y of one row, MSE and learning rate units/2, the step sets the kernel to outer(x, y)
    and the bias to y exactly (up to float32 rounding): the whole model is checked, not a sample.
    """
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras
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
    x, y = _pattern(inputs, 97), _pattern(units, 89)
    df = spark.createDataFrame([(x.tolist(), y.tolist())], "features array<float>, label array<float>")
    model = keras.Sequential(
        [keras.Input((inputs,)), keras.layers.Dense(units, kernel_initializer="zeros", bias_initializer="zeros")]
    )
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=units / 2), loss="mse")
    result = sparkdl.fit(df, model, num_workers=1, epochs=1, batch_size=1, shuffle=False, progress=False)
    kernel, bias = (variable.numpy() for variable in result.model.layers[0].weights)
    worst = max(
        float(np.max(np.abs(kernel[start : start + 500] - np.outer(x[start : start + 500], y))))
        for start in range(0, inputs, 500)
    )
    return {
        "heap_bytes": spark.sparkContext._jvm.java.lang.Runtime.getRuntime().maxMemory(),
        "weight_bytes": int(kernel.nbytes + bias.nbytes),
        "kernel_error": worst,
        "bias_error": float(np.max(np.abs(bias - y))),
        "initial_epoch": result.initial_epoch,
        "jvm_alive_count": spark.range(1000).count(),
    }


def test_a_model_larger_than_the_driver_jvm_heap_goes_to_the_task_and_back_intact(tmp_path):
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    child = subprocess.run(
        [sys.executable, __file__, _HEAP, str(_INPUTS), str(_UNITS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["weight_bytes"] > 1.3 * report["heap_bytes"], report  # the model cannot fit in the JVM's heap
    assert report["kernel_error"] < 1e-5 and report["bias_error"] < 1e-5, report
    assert report["initial_epoch"] == 0 and report["jvm_alive_count"] == 1000, report


class _OnRecord(logging.Handler):
    """Creates ``path`` when the driver logs a record containing ``text``."""

    def __init__(self, text: str, path: str):
        super().__init__(logging.DEBUG)
        self.text, self.path = text, path

    def emit(self, record):
        if self.text in record.getMessage():
            open(self.path, "w").close()


def test_a_retried_attempts_result_never_mixes_with_the_kept_one(spark, tmp_path, caplog):
    """Partition 0's first attempt uploads its result; partition 1 then dies without raising, so Spark
    retries the whole barrier stage: the driver must return the retry's result for partition 0."""
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

    handler = _OnRecord("result of partition 0,", uploaded)
    logger = logging.getLogger(payloads.__name__)
    logger.addHandler(handler)
    caplog.set_level(logging.DEBUG, logger=payloads.__name__)
    try:
        results = run_tasks(spark.range(2, numPartitions=2), 2, task, barrier=True, timeout=60)
    finally:
        logger.removeHandler(handler)
    assert os.path.exists(died)  # the first attempt's result reached the driver before the stage failed...
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and "the 22-byte result of partition 0," in dropped[0], dropped  # ...and was dropped
    assert results == {0: b"partition 0, retry", 1: b"partition 1, retry"}


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
    from sparkdl.collective.transport import connect_authenticated
    from sparkdl.launch.frames import HEADER, RELAY_ID
    from sparkdl.launch.relay import OutputRelay

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
    print(json.dumps(_train_large_model(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
