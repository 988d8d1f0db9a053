"""Live progress on the driver, Keras callbacks in the workers, TensorBoard and MLflow, on real Spark;
and what a user's console shows: one line per epoch, the bar where it can be seen, no TensorFlow start-up lines."""

import io
import json
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from fcntl import ioctl

import pytest
from models import RecordEpochs, make_mlp
from spark_jobs import no_spark_job

import sparkdl
from sparkdl.launch.relay import OutputRelay
from sparkdl.launch.relay_frames import HEADER, PROGRESS, RELAY_ID
from sparkdl.net.auth import connect_authenticated
from sparkdl.progress import ProgressMonitor

_EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)  (.*)  \((\d+) samples/s\)$")


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
                metrics = dict(item.split("=") for item in match.group(3).split("  "))
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
    digits_df, tmp_path, progress_lines
):
    """Every rank's callback waits before its second epoch until the driver has logged the first: the
    fit can only finish if progress arrives live. The callbacks see the metrics averaged over ranks."""
    flag = tmp_path / "driver-logged-epoch-1"
    lines = progress_lines(lambda line: line.startswith("epoch 1/3 ") and flag.touch())

    result = sparkdl.fit(
        digits_df,
        make_mlp(),
        num_workers=2,
        epochs=3,
        batch_size=16,
        seed=0,
        validation_split=0.2,
        callbacks=[RecordEpochs(str(tmp_path), wait_for=str(flag))],
    )

    seen = {
        (rank, epoch): json.loads((tmp_path / f"rank{rank}-epoch{epoch}.json").read_text())
        for rank in (0, 1)
        for epoch in range(3)
    }
    for epoch in range(3):
        assert seen[0, epoch] == seen[1, epoch]  # the same global values on both ranks
        assert seen[0, epoch]["val_accuracy"] == pytest.approx(result.history["val_accuracy"][epoch])
    logged = lines.epochs()
    assert sorted(logged) == [1, 2, 3]
    for epoch, (metrics, samples_per_second) in logged.items():
        for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert metrics[name] == pytest.approx(result.history[name][epoch - 1], rel=1e-3)
        assert samples_per_second > 0


def test_parameter_server_progress_tensorboard_and_mlflow_agree_with_the_history(
    digits_df, tmp_path, progress_lines, monkeypatch
):
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store: no server, nothing to install
    mlflow.set_tracking_uri(f"file:{tmp_path / 'mlruns'}")
    lines = progress_lines()
    result = sparkdl.fit(
        digits_df,
        make_mlp(),
        num_workers=2,
        mode="async",
        epochs=2,
        batch_size=16,
        seed=0,
        validation_split=0.2,
        tensorboard_dir=str(tmp_path / "tb"),
        log_to_mlflow=True,
    )

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


def test_progress_bar_shows_steps_metrics_and_throughput_and_the_epoch_line_above_it(capsys, monkeypatch):
    monkeypatch.setattr("sparkdl.progress.bar_is_visible", lambda: True)  # as in a terminal
    monitor = ProgressMonitor(epochs=2, steps_per_epoch=10, reporting_ranks=2, console=True, description="demo")
    with monitor:
        monitor.on_event(0, {"event": "start", "initial_epoch": 0})
        monitor.on_event(0, {"event": "step", "epoch": 0, "step": 4, "logs": {"loss": 1.5}, "samples_per_second": 100})
        print("a worker's line")  # other console output goes above the bar too
        for rank in (0, 1):
            monitor.on_event(
                rank,
                {
                    "event": "epoch",
                    "epoch": 0,
                    "logs": {"loss": 1.0 + rank},
                    "samples_per_second": 150,
                    "validation_rows": 0,
                },
            )
    out, bar = capsys.readouterr()
    assert "demo" in bar and "loss=1.5000 100 samples/s" in bar
    assert "loss=1.5000 300 samples/s" in bar  # the epoch: the workers' mean loss, their summed throughput
    assert "10/20" in bar
    assert out == "a worker's line\nepoch 1/2  loss=1.5000  (300 samples/s)\n"


def _report_two_epochs(monitor):
    with monitor:
        for epoch in range(2):
            monitor.on_event(
                0,
                {
                    "event": "epoch",
                    "epoch": epoch,
                    "logs": {"val_loss": 0.5, "loss": 2.0 - epoch, "accuracy": 0.25},
                    "samples_per_second": 99.6,
                    "validation_rows": 3,
                },
            )


def test_epoch_lines_are_printed_once_by_sparkdl_or_once_by_the_users_logging(capsys, progress_lines):
    """Unconfigured logging: sparkdl prints the line. Logging that shows INFO: the line comes from it alone."""
    logger = logging.getLogger("sparkdl.progress")
    logger.setLevel(logging.NOTSET)  # as after import: INFO records are not shown by Python's defaults
    _report_two_epochs(ProgressMonitor(epochs=2, steps_per_epoch=5, reporting_ranks=1, console=True))
    assert capsys.readouterr().out == (
        "epoch 1/2  loss=2.0000  accuracy=0.2500  val_loss=0.5000  (100 samples/s)\n"
        "epoch 2/2  loss=1.0000  accuracy=0.2500  val_loss=0.5000  (100 samples/s)\n"
    )

    lines = progress_lines()  # a handler and the INFO level: the user's logging shows the records
    logger.setLevel(logging.INFO)
    _report_two_epochs(ProgressMonitor(epochs=2, steps_per_epoch=5, reporting_ranks=1, console=True))
    assert capsys.readouterr().out == ""
    assert sorted(lines.epochs()) == [1, 2]

    _report_two_epochs(ProgressMonitor(epochs=2, steps_per_epoch=5, reporting_ranks=1, console=False))
    assert capsys.readouterr().out == ""  # progress=False: sparkdl prints nothing; the records are still logged
    assert len(lines.lines) == 4


def test_relay_hands_progress_events_over_and_ignores_a_bad_one():
    events, out = [], io.StringIO()
    relay = OutputRelay(
        "127.0.0.1",
        b"s" * 32,
        num_workers=2,
        on_progress=lambda rank, event: events.append((rank, event)),
        stdout=out,
        stderr=io.StringIO(),
    )
    with relay:
        sock = connect_authenticated(relay.address, 1, RELAY_ID, b"s" * 32, timeout=10)
        for payload in (b'{"event": "epoch", "epoch": 0}', b"not json", b"[1, 2]"):
            sock.sendall(HEADER.pack(PROGRESS, len(payload)) + payload)
        sock.sendall(HEADER.pack(1, 6) + b"after\n")  # the connection survives the bad events
        sock.close()
        relay.wait_until_quiet(10)
    assert events == [(1, {"event": "epoch", "epoch": 0})]
    assert out.getvalue() == "[rank 1] after\n"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"callbacks": ["not a callback"]}, "Expected `callbacks` to hold keras.callbacks.Callback instances"),
        ({"callbacks": [RecordEpochs("/tmp")], "mode": "average"}, "mode='average' does not use"),
        ({"callbacks": RecordEpochs("/tmp")}, "Expected `callbacks` to be a list"),
        ({"progress": "yes"}, "Expected `progress` to be True or False"),
        ({"log_to_mlflow": 1}, "Expected `log_to_mlflow` to be True or False"),
        ({"tensorboard_dir": ""}, "Expected `tensorboard_dir` to be a directory path"),
    ],
)
def test_bad_progress_and_callback_settings_fail_before_any_job(spark, digits_df, kwargs, message):
    with no_spark_job(spark), pytest.raises(ValueError, match=re.escape(message)):
        sparkdl.fit(digits_df, make_mlp(), **kwargs)


def test_unpicklable_callback_is_refused_before_any_job(spark, digits_df):
    callback = RecordEpochs("/tmp")
    callback.lock = threading.Lock()
    with no_spark_job(spark), pytest.raises(ValueError, match="cannot be sent to the workers"):
        sparkdl.fit(digits_df, make_mlp(), callbacks=[callback])


# A user's script, run as its own process: sparkdl imported first, a tiny fit (2 epochs), and with
# "logging" a second fit (3 epochs) after the script configured logging at INFO, as jobs/train.py does.
_SCRIPT = """
import sparkdl  # first: its import keeps TensorFlow's start-up lines out, here and in the tasks

import json, logging, sys
import keras
import numpy as np
from pyspark.sql import SparkSession

spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
rng = np.random.default_rng(0)
x = rng.normal(size=(200, 4)).astype("float32")
df = spark.createDataFrame([(row.tolist(), int(row.sum() > 0)) for row in x], "features array<float>, label int")


def fit(epochs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    result = sparkdl.fit(df, model, num_workers=2, epochs=epochs, batch_size=16, seed=0, validation_split=0.2)
    print("history", json.dumps(result.history), flush=True)


fit(2)
if sys.argv[1:] == ["logging"]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fit(3)
spark.stop()
"""
_TENSORFLOW_START_UP = (
    "absl::InitializeLog",
    "oneDNN",
    "cpu_feature_guard",
    "TF_ENABLE_ONEDNN_OPTS",
    "Unable to register",
    "cuda drivers",
)
_SCRIPT_TIMEOUT = 540


@pytest.fixture(scope="module")
def bare_import(tmp_path_factory):
    """What a bare ``import sparkdl, keras`` prints here, in a fresh interpreter: none of TensorFlow's start-up
    lines, as tests/test_start_up_output.py checks."""
    bare = subprocess.run(
        [sys.executable, "-c", "import sparkdl, keras"],
        capture_output=True,
        text=True,
        env=_script_env(),
        cwd=tmp_path_factory.mktemp("bare"),
        timeout=_SCRIPT_TIMEOUT,
        check=True,
    )
    return bare.stdout + bare.stderr


def _assert_no_start_up_lines_but_the_scripts_own_import(text, bare_import):
    """TensorFlow's start-up lines in ``text`` are at most those of ``bare_import``; anything beyond it (a worker's
    import, a line the level hides) is sparkdl's noise."""
    for noise in _TENSORFLOW_START_UP:
        assert text.count(noise) <= bare_import.count(noise), (noise, text)


def _script_env():
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # set by conftest: the script must show what sparkdl does on its own
    return env


def _epoch_lines(text, epochs):
    """{epoch: [metrics dict, ...]} of every line holding sparkdl's epoch line for a fit of ``epochs`` epochs."""
    found = {}
    for segment in re.split(r"[\r\n]+", text):
        if match := re.search(rf"epoch (\d+)/{epochs}  (.*)  \((\d+) samples/s\)$", segment):
            metrics = dict(item.split("=") for item in match.group(2).split("  "))
            found.setdefault(int(match.group(1)), []).append((segment, {k: float(v) for k, v in metrics.items()}))
    return found


def _histories(text):
    return [json.loads(line.split(" ", 1)[1]) for line in re.split(r"[\r\n]+", text) if line.startswith("history ")]


def _assert_one_true_line_per_epoch(text, epochs, history):
    lines = _epoch_lines(text, epochs)
    assert sorted(lines) == list(range(1, epochs + 1)), text
    for epoch, found in lines.items():
        assert len(found) == 1, found  # exactly one line per epoch
        _, metrics = found[0]
        assert list(metrics) == ["loss", "accuracy", "val_loss", "val_accuracy"]
        for name, value in metrics.items():
            assert value == pytest.approx(history[name][epoch - 1], abs=1e-4)
    return lines


@pytest.mark.slow  # its own Python process and Spark: the slow command
def test_a_piped_script_prints_one_line_per_epoch_and_no_tensorflow_start_up_lines(tmp_path, bare_import):
    """stdout and stderr are files (no terminal): no bar, one epoch line per epoch printed by sparkdl itself;
    once the script configures logging at INFO, the line comes through its logging alone, not twice."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        subprocess.run(
            [sys.executable, str(script), "logging"],
            stdout=out,
            stderr=err,
            env=_script_env(),
            cwd=tmp_path,
            timeout=_SCRIPT_TIMEOUT,
            check=True,
        )
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    first, second = _histories(stdout)

    printed = _assert_one_true_line_per_epoch(stdout + stderr, 2, first)
    assert all(segment.startswith("epoch ") for ((segment, _),) in printed.values())  # sparkdl's own line, on stdout
    assert all(f"epoch {e}/2 " in stdout for e in (1, 2))
    logged = _assert_one_true_line_per_epoch(stdout + stderr, 3, second)
    assert all(" INFO sparkdl.progress: epoch " in segment for ((segment, _),) in logged.values()), logged
    assert "%|" not in stderr  # no bar in a file
    _assert_no_start_up_lines_but_the_scripts_own_import(stdout + stderr, bare_import)


def _run_in_terminal(command, env, cwd, timeout):
    """Runs ``command`` with a pseudo-terminal (120 columns) as stdin, stdout and stderr; returns what it wrote."""
    controller, terminal = pty.openpty()
    ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(
        command, stdin=terminal, stdout=terminal, stderr=terminal, env=env, cwd=cwd, start_new_session=True
    )
    os.close(terminal)
    output, deadline = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([controller], [], [], 1.0)[0]:
                try:
                    chunk = os.read(controller, 1 << 16)
                except OSError:  # the process and its children closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
        else:
            raise AssertionError(f"the script ran past {timeout} s:\n{output.decode(errors='replace')[-3000:]}")
    finally:
        os.close(controller)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
    assert process.returncode == 0, output.decode(errors="replace")[-3000:]
    return output.decode(errors="replace")


@pytest.mark.slow  # its own Python process and Spark: the slow command
def test_in_a_terminal_the_bar_is_drawn_and_every_epoch_line_stands_whole_above_it(tmp_path, bare_import):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    text = _run_in_terminal([sys.executable, str(script)], _script_env(), tmp_path, _SCRIPT_TIMEOUT)
    (history,) = _histories(text)
    assert re.search(r"sparkdl sync x2: +\d+%\|", text), text  # tqdm's text bar
    assert re.search(r"sparkdl sync x2: 100%\|.*\| (\d+)/\1 ", text), text  # ... run to its last step
    lines = _assert_one_true_line_per_epoch(text, 2, history)
    # each epoch line is a line of its own: the bar was cleared before it and redrawn after it
    assert all(segment.startswith("epoch ") for ((segment, _),) in lines.values()), lines
    _assert_no_start_up_lines_but_the_scripts_own_import(text, bare_import)


def test_the_estimators_progress_param_reaches_fit():
    from sparkdl.ml import KerasEstimator

    assert KerasEstimator(model=make_mlp(), progress=False).fit_arguments()["progress"] is False
    assert "progress" not in KerasEstimator(model=make_mlp()).fit_arguments()  # fit's default: shown
