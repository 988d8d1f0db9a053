"""sparkdl and its jobs over Spark Connect, against a real Connect server (``connect_server`` below).

The client runs in a child process: PySpark refuses a Connect session in a process that already
holds a classic SparkContext (``SESSION_ALREADY_EXIST``, and the suite's shared ``spark`` fixture is
one), and creating one sets ``SPARK_CONNECT_MODE_ENABLED`` for the whole process, which turns every
later ``pyspark.sql.functions`` call into a Connect expression. The child runs every scenario once
(``python tests/test_connect.py <url> <out.json>``), records each one's result or traceback, and the
tests below check them; a scenario that fails fails only its own test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest
from connect_server import event_log_conf, read_event_log, spark_connect_server
from job_runs import (
    PIXELS,
    PREDICT_JOB,
    TRAIN_JOB,
    check_scored,
    run_job,
    spark_master,
    train_digits_model,
    write_digit_rows,
)

# A real Spark Connect server and a client process: the slow command. The first test waits for the server (up to
# connect_server.START_SECONDS) and the client's every scenario (up to _CLIENT_SECONDS).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

try:  # PySpark's Connect client needs gRPC and protobuf: the `cpu`/`gpu` extras bring them (the Horovod stack has none)
    import pyspark.sql.connect  # noqa: F401
except ImportError as missing:
    pytest.skip(
        f"Spark Connect's client dependencies are missing ({missing}): pip install -e '.[cpu]' (its pyspark[connect])",
        allow_module_level=True,
    )

_CLIENT_SECONDS = 540
_MODES = ("sync", "sharded", "async", "hogwild", "ssp", "average", "pipeline", "gossip", "sharded-weights", "sync_ps")
_ROWS, _WORKERS, _EPOCHS, _BATCH = 320, 2, 2, 32
_STEPS = -(-_ROWS // (_WORKERS * _BATCH))  # per epoch


# ---------------------------------------------------------------------------------------------
# The client (child process)


def _ancestors() -> list[int]:
    """This process's parent, grandparent, ... (from /proc), to show whose child a task's process is."""
    chain, pid = [], os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


def _digits(rows: int = _ROWS):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x[:rows] / 16.0).astype(np.float32), y[:rows].astype(np.int64)


def _model(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10, activation="softmax")]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _where_callback():
    """A Keras callback that prints where it runs; its output reaches the client through sparkdl's relay."""
    import keras

    class Where(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            from pyspark import TaskContext

            context = TaskContext.get()
            print(
                f"sparkdl-where {json.dumps({'pid': os.getpid(), 'ancestors': _ancestors(), 'partition': context.partitionId() if context else -1})}",
                flush=True,
            )

    return Where()


def _captured_fit(df, mode: str) -> dict:
    """``sparkdl.fit`` in ``mode``, with the relayed worker output captured."""
    import io

    import sparkdl

    options = {"max_staleness": 1} if mode == "ssp" else {}
    if mode == "average":
        # One round per epoch; with held-out rows the evaluation-only job after the last round runs too.
        options.update(validation_split=0.25, sync_every=_STEPS)
    elif mode == "pipeline":  # its stages run their own loop: no Keras callbacks
        options.update(validation_split=0.25, num_stages=2)
    elif mode == "sharded-weights":  # sharded with the weights sharded too: its own loop, no Keras callbacks
        options.update(validation_split=0.25, shard_weights=True)
    else:
        options["callbacks"] = [_where_callback()]
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    output, original = io.StringIO(), sys.stdout
    sys.stdout = output  # the relay prints the tasks' lines to sys.stdout as it is when the job starts
    try:
        result = sparkdl.fit(
            df,
            model,
            features_col="features",
            label_col="label",
            num_workers=_WORKERS,
            epochs=_EPOCHS,
            batch_size=_BATCH,
            mode="sharded" if mode == "sharded-weights" else mode,
            seed=0,
            progress=False,
            **options,
        )
    finally:
        sys.stdout = original
    changed = any(not np.array_equal(a, b) for a, b in zip(before, result.model.get_weights()))
    where = [
        json.loads(line.split("sparkdl-where ", 1)[1])
        for line in output.getvalue().splitlines()
        if "sparkdl-where" in line
    ]
    return {
        "history": result.history,
        "stats": {k: v for k, v in result.stats.items() if isinstance(v, (int, float, dict))},
        "weights_changed": changed,
        "where": where,
    }


def _run_scenario() -> dict:
    import sparkdl
    from sparkdl import collective

    def task(scale):
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        values = collective.allreduce(np.full(2, float(scale * (collective.rank() + 1))))
        return {
            "values": values.tolist(),
            "pid": os.getpid(),
            "ancestors": _ancestors(),
            "partition": context.partitionId(),
            "ranks": collective.size(),
        }

    return sparkdl.run(task, num_workers=2, args=(10,))


def _worker_error_scenario() -> dict:
    import sparkdl

    def fails():
        from sparkdl import collective

        if collective.rank() == 1:
            raise KeyError("rank one gave up")
        return collective.rank()

    try:
        sparkdl.run(fails, num_workers=2, timeout=60)
    except sparkdl.WorkerError as exc:
        return {"worker_error": True, "is_key_error": isinstance(exc, KeyError), "message": str(exc)}
    return {"worker_error": False}


def _too_many_workers(df) -> dict:
    import sparkdl

    try:
        sparkdl.fit(
            df, _model(), features_col="features", label_col="label", num_workers=3, mode="async", progress=False
        )
    except ValueError as exc:
        return {"message": str(exc)}
    return {"message": None}


def _ml_scenario(spark, df, path: str) -> dict:
    from sparkdl.ml import KerasEstimator, KerasModel

    estimator = KerasEstimator(
        model=_model(),
        featuresCol="features",
        labelCol="label",
        numWorkers=2,
        mode="sync",
        epochs=1,
        batchSize=32,
        seed=0,
    )
    fitted = estimator.fit(df)
    scored = fitted.transform(df).select("label", "prediction", "probability").orderBy("label").collect()
    fitted.write().save(path)
    fitted.write().overwrite().save(path)  # overwrite works without the JVM
    loaded = KerasModel.load(path)
    rescored = loaded.transform(df).select("label", "prediction", "probability").orderBy("label").collect()
    estimator.write().save(path + "-estimator")
    reloaded_estimator = KerasEstimator.load(path + "-estimator")
    try:
        fitted.write().save(path)
        saved_twice = "no error"
    except Exception as exc:  # Spark's own "path already exists" for a save without overwrite()
        saved_twice = type(exc).__name__
    return {
        "rows": len(scored),
        "same_predictions": [r.prediction for r in scored] == [r.prediction for r in rescored],
        "max_probability_difference": float(
            max(np.abs(np.array(a.probability) - np.array(b.probability)).max() for a, b in zip(scored, rescored))
        ),
        "history": fitted.history,
        "files": sorted(os.listdir(path)),
        "weights": [w.tolist() for w in loaded.keras_model.get_weights()],
        "estimator_params": {
            "numWorkers": reloaded_estimator.getOrDefault("numWorkers"),
            "mode": reloaded_estimator.getOrDefault("mode"),
        },
        "saved_twice": saved_twice,
    }


def _message_limit(spark) -> dict:
    from sparkdl.launch import session

    try:
        session.check_message_size(spark, 200 << 20, "the model")
    except ValueError as exc:
        return {"message": str(exc)}
    return {"message": None}


def _client(url: str, out: str) -> None:
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(url).getOrCreate()
    x, y = _digits()
    df = spark.createDataFrame(
        [(row.tolist(), int(label)) for row, label in zip(x, y)], "features array<float>, label long"
    )
    scenarios = {"run": _run_scenario}  # first: it starts the server's Python workers without TensorFlow
    scenarios.update({f"fit-{mode}": (lambda mode=mode: _captured_fit(df, mode)) for mode in _MODES})
    scenarios.update(
        {
            "worker-error": _worker_error_scenario,
            "too-many-workers": lambda: _too_many_workers(df),
            "ml": lambda: _ml_scenario(spark, df, os.path.join(os.path.dirname(out), "saved-model")),
            "message-limit": lambda: _message_limit(spark),
        }
    )
    from sparkdl.launch import session

    results = {
        "client_pid": os.getpid(),
        "is_connect": session.is_connect(spark),
        "slots": session.task_slots(spark),
        "driver_host": session.driver_host(spark),
    }
    for name, scenario in scenarios.items():
        started = time.perf_counter()
        try:
            results[name] = {"ok": True, "value": scenario()}
        except BaseException:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - started, 1)
        with open(out, "w") as f:
            json.dump(results, f)
    spark.stop()


# ---------------------------------------------------------------------------------------------
# The server and the tests (pytest process)


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory):
    """One Spark Connect server on ``local[2]`` (its own JVM and Python workers) for every test of this file (the
    only one that starts one, so that a run starts one), stopped after them; ``events``: its event log (one plain
    JSON file)."""
    directory = tmp_path_factory.mktemp("connect")
    events = directory / "events"
    conf = ("spark.sql.shuffle.partitions=4", *event_log_conf(events))
    with spark_connect_server(directory, conf=conf) as server:
        yield {**server, "events": events}


@pytest.fixture(scope="module")
def results(connect_server, tmp_path_factory):
    """Every scenario's outcome, from one client process connected to the server."""
    out = str(tmp_path_factory.mktemp("connect-client") / "results.json")
    client = subprocess.run(
        [sys.executable, os.path.abspath(__file__), connect_server["url"], out],
        capture_output=True,
        text=True,
        timeout=_CLIENT_SECONDS,
    )
    if not os.path.exists(out):
        pytest.fail(f"The Connect client wrote no results (exit {client.returncode}):\n{client.stderr[-4000:]}")
    with open(out) as f:
        outcome = json.load(f)
    outcome["out"] = out
    return outcome


def _value(results: dict, name: str):
    scenario = results.get(name)
    assert scenario is not None, f"scenario {name!r} did not run (the client stopped before it)"
    assert scenario["ok"], f"scenario {name!r} failed on the Connect client:\n{scenario['error']}"
    return scenario["value"]


def test_the_client_sees_a_connect_session(results):
    assert results["is_connect"] is True
    assert results["slots"] == 2  # read from the server's master, local[2]: no JVM in the client
    assert results["driver_host"] == "127.0.0.1"  # the server's spark.driver.host: it runs on this machine


def test_run_executes_on_the_servers_python_workers(results, connect_server):
    value = _value(results, "run")
    assert value["values"] == [30.0, 30.0]  # 10 * 1 + 10 * 2 over the ring
    assert value["ranks"] == 2 and value["partition"] == 0
    assert value["pid"] not in (os.getpid(), results["client_pid"])
    # The task's process descends from the Connect server's JVM (its Python daemon), not from the client.
    assert connect_server["pid"] in value["ancestors"] and results["client_pid"] not in value["ancestors"]


@pytest.mark.parametrize("mode", _MODES)
def test_fit_over_connect(results, connect_server, mode):
    value = _value(results, f"fit-{mode}")
    assert value["weights_changed"]
    assert len(value["history"]["loss"]) == _EPOCHS and all(np.isfinite(value["history"]["loss"]))
    assert value["history"]["loss"][-1] < value["history"]["loss"][0] + 0.5  # trained, not diverged
    if mode == "average":  # deltas and counters came back as result rows: one per worker and round
        stats = value["stats"]
        assert stats["contributions"] == _WORKERS * stats["rounds"] and stats["samples"] > 0
        assert "val_loss" in value["history"]
        return
    if mode == "pipeline":  # two stage tasks on the server, each measuring the part of the model it held
        stages = value["stats"]["pipeline"]["stages"]
        assert len(stages) == 2 and all(stage["weight_bytes"] > 0 for stage in stages)
        assert "val_loss" in value["history"]
        return
    if mode == "sharded-weights":  # two ranks on the server, each measuring the half of the weights it held
        ranks = value["stats"]["fully_sharded"]["ranks"]
        assert len(ranks) == 2 and all(r["weight_bytes"] < 0.6 * r["whole_weight_bytes"] for r in ranks)
        assert "val_loss" in value["history"]
        return
    # The callback ran inside Spark tasks on the server (partitions 0 and 1, or rank 0 alone), not in the client.
    assert value["where"], "no task output reached the client through the relay"
    for where in value["where"]:
        assert connect_server["pid"] in where["ancestors"] and results["client_pid"] not in where["ancestors"]
    partitions = {where["partition"] for where in value["where"]}
    assert partitions == {0, 1}  # every rank runs the callbacks, in sync mode too
    if mode == "sharded":  # each rank held half of the optimizer's state
        held = value["stats"]["sharded"]["optimizer_state_bytes"]
        assert len(held) == _WORKERS and max(held) < 0.6 * value["stats"]["sharded"]["replicated_optimizer_state_bytes"]
    if mode == "gossip":  # the replicas' spread, measured on the server's ranks at every epoch's end
        assert len(value["stats"]["gossip"]["spread"]) == _EPOCHS
    if mode not in ("sync", "sharded", "gossip"):  # parameter-server counters travel in the tasks' payloads: once each
        stats = value["stats"]
        assert stats["samples"] == _EPOCHS * _ROWS  # every row once per epoch
        # Each worker runs its own partition's steps: _STEPS for an even split, one more for a larger partition.
        assert _WORKERS * _EPOCHS * _STEPS <= stats["pushes"] <= _WORKERS * _EPOCHS * (_STEPS + 1)
        assert stats["pulls"] == stats["pushes"] + _WORKERS


def test_worker_error_reaches_the_client(results):
    value = _value(results, "worker-error")
    assert value["worker_error"] and value["is_key_error"]
    assert "rank one gave up" in value["message"]


def test_too_many_workers_in_async_mode_is_refused_without_barrier_wording(results):
    message = _value(results, "too-many-workers")["message"]
    assert message is not None and "num_workers=3, but the cluster runs 2 tasks at once" in message
    assert "barrier" not in message and "parameter server" in message


def test_estimator_fit_transform_save_load(results, spark):
    value = _value(results, "ml")
    assert value["rows"] == _ROWS and value["same_predictions"] and value["max_probability_difference"] < 1e-6
    assert value["files"] == ["metadata", "model.keras"]
    assert value["estimator_params"] == {"numWorkers": 2, "mode": "sync"}
    assert value["saved_twice"] != "no error"
    # The same layout as a classic save: the suite's classic session loads what the Connect client wrote.
    from sparkdl.ml import KerasModel

    path = os.path.join(os.path.dirname(results["out"]), "saved-model")
    loaded = KerasModel.load(path)
    assert loaded.history == value["history"]
    for classic, connect in zip(loaded.keras_model.get_weights(), value["weights"]):
        np.testing.assert_array_equal(classic, np.array(connect, classic.dtype))


def test_a_model_over_the_message_limit_fails_on_the_driver(results):
    message = _value(results, "message-limit")["message"]
    assert message is not None and "spark.connect.grpc.maxInboundMessageSize" in message


# ---------------------------------------------------------------------------------------------
# The jobs as Spark Connect clients (jobs/train.py and jobs/predict.py with --remote)


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory, digits):
    return train_digits_model(tmp_path_factory.mktemp("model"), digits)


def test_train_job_over_spark_connect(tmp_path, connect_server):
    """--remote makes the job a Spark Connect client: it trains on the server's executors and never starts a JVM."""
    out = run_job(
        [
            sys.executable,
            TRAIN_JOB,
            "--remote",
            connect_server["url"],
            "--epochs",
            "2",
            "--output",
            "model.keras",
            "--verbose",
        ],
        tmp_path,
    )
    assert re.search(r"trained on 2 workers", out) and (tmp_path / "model.keras").exists(), out
    assert "Running Spark version" not in out and "log4j" not in out, out  # no Spark driver in the job's process


def test_predict_job_over_spark_connect(tmp_path, digits, digits_model, connect_server):
    """--remote makes predict.py a Spark Connect client: the server's application scores the rows (its event log
    has the Arrow UDF's stage, whose tasks ran on its executor) and writes them; the job never starts a JVM."""
    model, model_path = digits_model
    _, x_test, _, _ = digits
    table = write_digit_rows(tmp_path / "rows.parquet", x_test)
    out = run_job(
        [
            sys.executable,
            PREDICT_JOB,
            "--remote",
            connect_server["url"],
            "--model",
            str(model_path),
            "--data",
            str(tmp_path / "rows.parquet"),
            "--output",
            str(tmp_path / "scored.parquet"),
            "--features-col",
            ",".join(PIXELS),
            "--verbose",
        ],
        tmp_path,
    )
    log = read_event_log(connect_server["events"])  # the server's (shared by this file's tests)
    assert f"scored {len(x_test)} rows" in out, out
    assert "Running Spark version" not in out and "log4j" not in out, out  # no Spark driver in the job's process
    check_scored(tmp_path / "scored.parquet", table, model, x_test)
    # The one SQL execution that ran the UDF and wrote the output: its tasks, one per input file, on the server.
    (write,) = [
        e["executionId"]
        for e in log
        if e["Event"].endswith("SparkListenerSQLExecutionStart")
        and "ArrowEvalPython" in e["physicalPlanDescription"]
        and f"file:{tmp_path / 'scored.parquet'}" in e["physicalPlanDescription"]
    ]
    stages = {
        stage
        for e in log
        if e["Event"] == "SparkListenerJobStart" and e["Properties"].get("spark.sql.execution.id") == str(write)
        for stage in e["Stage IDs"]
    }
    tasks = [e for e in log if e["Event"] == "SparkListenerTaskEnd" and e["Stage ID"] in stages]
    assert [(e["Task End Reason"]["Reason"], e["Task Info"]["Executor ID"]) for e in tasks] == [
        ("Success", "driver")
    ] * 2
    assert spark_master(log) == "local[2]"  # the server's application: the job gave no master


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    _client(sys.argv[1], sys.argv[2])
