"""Live progress on the driver, Keras callbacks in the workers, TensorBoard and MLflow, on real Spark."""

import io
import json
import logging
import re
import threading

import numpy as np
import pytest

import sparkdl
from models import RecordEpochs, make_mlp
from spark_jobs import no_spark_job
from sparkdl.collective.transport import connect_authenticated
from sparkdl.launch.relay import _HEADER, _PROGRESS, _RELAY_ID, OutputRelay
from sparkdl.progress import ProgressMonitor

_EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+): (.*) - (\d+) samples/s$")


class _Lines(logging.Handler):
    """Collects the ``sparkdl.progress`` log lines; calls ``on_line`` with each as it arrives."""

    def __init__(self, on_line=lambda line: None):
        super().__init__(logging.INFO)
        self.lines = []
        self._on_line = on_line

    def emit(self, record):
        line = record.getMessage()
        self.lines.append(line)
        self._on_line(line)

    def epochs(self):
        """{epoch number: (metrics, samples/s)} from the per-epoch lines."""
        found = {}
        for line in self.lines:
            if match := _EPOCH_LINE.match(line):
                metrics = dict(item.split("=") for item in match.group(3).split())
                found[int(match.group(1))] = ({k: float(v) for k, v in metrics.items()}, int(match.group(4)))
        return found


@pytest.fixture
def progress_lines():
    logger = logging.getLogger("sparkdl.progress")
    handlers = []

    def attach(on_line=lambda line: None):
        handler = _Lines(on_line)
        logger.addHandler(handler)
        handlers.append(handler)
        return handler

    previous = logger.level
    logger.setLevel(logging.INFO)
    yield attach
    logger.setLevel(previous)
    for handler in handlers:
        logger.removeHandler(handler)


def test_epoch_progress_reaches_the_driver_while_workers_train_and_callbacks_run_on_every_rank(
        digits_df, tmp_path, progress_lines):
    """Every rank's callback waits before its second epoch until the driver has logged the first: the
    fit can only finish if progress arrives live. The callbacks see the metrics averaged over ranks."""
    flag = tmp_path / "driver-logged-epoch-1"
    lines = progress_lines(lambda line: line.startswith("epoch 1/3:") and flag.touch())

    result = sparkdl.fit(digits_df, make_mlp(), num_workers=2, epochs=3, batch_size=16, seed=0,
                         validation_split=0.2, callbacks=[RecordEpochs(str(tmp_path), wait_for=str(flag))])

    seen = {(rank, epoch): json.loads((tmp_path / f"rank{rank}-epoch{epoch}.json").read_text())
            for rank in (0, 1) for epoch in range(3)}
    for epoch in range(3):
        assert seen[0, epoch] == seen[1, epoch]  # the same global values on both ranks
        assert seen[0, epoch]["val_accuracy"] == pytest.approx(result.history["val_accuracy"][epoch])
    logged = lines.epochs()
    assert sorted(logged) == [1, 2, 3]
    for epoch, (metrics, samples_per_second) in logged.items():
        for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert metrics[name] == pytest.approx(result.history[name][epoch - 1], rel=1e-3)
        assert samples_per_second > 0


def test_parameter_server_progress_tensorboard_and_mlflow_agree_with_the_history(digits_df, tmp_path,
                                                                                 progress_lines, monkeypatch):
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store: no server, nothing to install
    mlflow.set_tracking_uri(f"file:{tmp_path / 'mlruns'}")
    lines = progress_lines()
    result = sparkdl.fit(digits_df, make_mlp(), num_workers=2, mode="async", epochs=2, batch_size=16, seed=0,
                         validation_split=0.2, tensorboard_dir=str(tmp_path / "tb"), log_to_mlflow=True)

    logged = lines.epochs()  # each epoch logged once, when both workers have finished it
    assert sorted(logged) == [1, 2]
    for epoch, (metrics, _) in logged.items():
        assert metrics["loss"] == pytest.approx(result.history["loss"][epoch - 1], rel=1e-3)
        assert metrics["val_accuracy"] == pytest.approx(result.history["val_accuracy"][epoch - 1], rel=1e-3)

    def scalars(subdir, tag):
        events = EventAccumulator(str(tmp_path / "tb" / subdir))
        events.Reload()
        import tensorflow as tf

        return [float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)]

    assert scalars("train", "epoch_loss") == pytest.approx(result.history["loss"], rel=1e-5)
    assert scalars("validation", "epoch_accuracy") == pytest.approx(result.history["val_accuracy"], rel=1e-5)
    assert all(v > 0 for v in scalars("train", "epoch_samples_per_second"))

    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    client = mlflow.MlflowClient()
    assert run.data.params["mode"] == "async" and run.data.params["num_workers"] == "2"
    assert run.info.status == "FINISHED"  # the run fit started was ended by it
    history = sorted(client.get_metric_history(run.info.run_id, "val_loss"), key=lambda m: m.step)
    assert [m.step for m in history] == [0, 1]
    assert [m.value for m in history] == pytest.approx(result.history["val_loss"], rel=1e-6)


def test_progress_bar_shows_steps_metrics_and_throughput(capsys):
    monitor = ProgressMonitor(epochs=2, steps_per_epoch=10, reporting_ranks=2, show_bar=True, description="demo")
    with monitor:
        monitor.on_event(0, {"event": "start", "initial_epoch": 0})
        monitor.on_event(0, {"event": "step", "epoch": 0, "step": 4, "logs": {"loss": 1.5}, "samples_per_second": 100})
        for rank in (0, 1):
            monitor.on_event(rank, {"event": "epoch", "epoch": 0, "logs": {"loss": 1.0 + rank},
                                    "samples_per_second": 150, "validation_rows": 0})
    bar = capsys.readouterr().err
    assert "demo" in bar and "loss=1.5" in bar and "100 samples/s" in bar
    assert "loss=1.5 300 samples/s" in bar  # the epoch: the workers' mean loss, their summed throughput
    assert "10/20" in bar


def test_relay_hands_progress_events_over_and_ignores_a_bad_one():
    events, out = [], io.StringIO()
    relay = OutputRelay("127.0.0.1", b"s" * 32, num_workers=2, on_progress=lambda rank, event: events.append((rank, event)),
                        stdout=out, stderr=io.StringIO())
    with relay:
        sock = connect_authenticated(relay.address, 1, _RELAY_ID, b"s" * 32, timeout=10)
        for payload in (b'{"event": "epoch", "epoch": 0}', b"not json", b"[1, 2]"):
            sock.sendall(_HEADER.pack(_PROGRESS, len(payload)) + payload)
        sock.sendall(_HEADER.pack(1, 6) + b"after\n")  # the connection survives the bad events
        sock.close()
        relay.wait_until_quiet(10)
    assert events == [(1, {"event": "epoch", "epoch": 0})]
    assert out.getvalue() == "[rank 1] after\n"


@pytest.mark.parametrize("kwargs, message", [
    ({"callbacks": ["not a callback"]}, "Expected `callbacks` to hold keras.callbacks.Callback instances"),
    ({"callbacks": [RecordEpochs("/tmp")], "mode": "average"}, "mode='average' does not use"),
    ({"callbacks": RecordEpochs("/tmp")}, "Expected `callbacks` to be a list"),
    ({"progress": "yes"}, "Expected `progress` to be True or False"),
    ({"log_to_mlflow": 1}, "Expected `log_to_mlflow` to be True or False"),
    ({"tensorboard_dir": ""}, "Expected `tensorboard_dir` to be a directory path"),
])
def test_bad_progress_and_callback_settings_fail_before_any_job(spark, digits_df, kwargs, message):
    with no_spark_job(spark), pytest.raises(ValueError, match=re.escape(message)):
        sparkdl.fit(digits_df, make_mlp(), **kwargs)


def test_unpicklable_callback_is_refused_before_any_job(spark, digits_df):
    callback = RecordEpochs("/tmp")
    callback.lock = threading.Lock()
    with no_spark_job(spark), pytest.raises(ValueError, match="cannot be sent to the workers"):
        sparkdl.fit(digits_df, make_mlp(), callbacks=[callback])
