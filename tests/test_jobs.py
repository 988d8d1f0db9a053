"""The jobs, run the way users run them: through the real spark-submit (on a cluster of separate executor processes,
and on too few slots), with plain python, and with their TOML config files; their checks before Spark starts."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from connect_server import event_log_conf, read_event_log
from job_runs import (
    JOBS,
    PIXELS,
    PREDICT_JOB,
    ROOT,
    TRAIN_JOB,
    check_scored,
    run_job,
    spark_master,
    spark_property,
    train_digits_model,
    write_digit_rows,
)

# Each test starts its own Spark (spark-submit, local-cluster, a Connect server): the slow command.
pytestmark = pytest.mark.slow

CONFIGS = ROOT / "conf" / "jobs"
SPARK_SUBMIT = os.path.join(os.path.dirname(sys.executable), "spark-submit")

# The jobs import their helpers as top-level modules, as they do when spark-submit runs them.
sys.path.insert(0, str(JOBS))
import _spark  # noqa: E402
import predict  # noqa: E402
import train  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl import MODES  # noqa: E402


def spark_submit(master, job, *job_args, conf=()):
    """A spark-submit command line with this virtualenv's spark-submit, the driver on loopback."""
    confs = [item for pair in conf for item in ("--conf", pair)]
    return [
        SPARK_SUBMIT,
        "--master",
        master,
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.ui.enabled=false",
        *confs,
        job,
        *job_args,
    ]


def task_executors(events, *, barrier):
    """The executor ids that ran the tasks of the barrier stages (barrier=True) or of all other stages, by Spark's
    own record of where each task ran."""
    barrier_stages = {
        e["Stage Info"]["Stage ID"]
        for e in events
        if e["Event"] == "SparkListenerStageSubmitted"
        and any(rdd.get("Barrier") for rdd in e["Stage Info"]["RDD Info"])
    }
    return [
        e["Task Info"]["Executor ID"]
        for e in events
        if e["Event"] == "SparkListenerTaskEnd" and (e["Stage ID"] in barrier_stages) == barrier
    ]


def epoch_losses(output, epochs):
    """The loss of each epoch line (``epoch N/E ... loss=...``, step lines excluded); each epoch must appear once."""
    lines = re.findall(rf"\bepoch (\d+)/{epochs}\b(?!\s+step)[^\n]*?\bloss=([\d.e+-]+)", output)
    assert [int(epoch) for epoch, _ in lines] == list(range(1, epochs + 1)), output[-6000:]
    return [float(loss) for _, loss in lines]


def saved_model_accuracy(path, x, y):
    import keras

    model = keras.models.load_model(path)
    return float(np.mean(model.predict(x, verbose=0).argmax(axis=1) == y))


def test_spark_submit_on_local_cluster_trains_on_the_executors(tmp_path, digits):
    """spark-submit's --master reaches the job: Spark's event log shows the barrier stage's tasks on the two
    executor processes, never on the driver. --verbose shows each epoch once and the job's phase times."""
    events = tmp_path / "events"
    out = run_job(
        spark_submit(
            "local-cluster[2,1,1024]",
            TRAIN_JOB,
            "--epochs",
            "3",
            "--output",
            "model.keras",
            "--verbose",
            conf=event_log_conf(events),
        ),
        tmp_path,
    )
    log = read_event_log(events)
    assert spark_master(log) == "local-cluster[2,1,1024]"
    # Executors on this machine run this Python: their workers fork from sparkdl's daemon, TensorFlow loaded once.
    assert spark_property(log, "spark.python.daemon.module") == "sparkdl.launch.worker_daemon"
    ran_on = task_executors(log, barrier=True)
    assert sorted(set(ran_on)) == ["0", "1"] and len(ran_on) >= 2, ran_on
    assert "driver" not in task_executors(log, barrier=False)

    losses = epoch_losses(out, 3)
    assert losses[-1] < losses[0], losses
    assert re.search(r"trained on 2 workers .*\(sync mode", out), out
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.85, out
    phases = dict(re.findall(r"sparkdl-job phase (\w+): ([\d.]+)s", out))
    assert {"checks", "session", "data", "fit", "test", "save"} <= set(phases), out
    _, x_test, _, y_test = digits
    assert saved_model_accuracy(tmp_path / "model.keras", x_test, y_test) > 0.85


def test_async_config_on_local_cluster_with_the_shipped_spark_conf_is_quiet(tmp_path, digits):
    """The shipped async config and conf/spark-local.conf (run from the repository, as the docs show), on separate
    executor processes, a flag overriding the file's epochs: the tasks run on the executors; Spark says nothing
    below WARN and draws no progress bar; the job prints no epoch line of its own."""
    events = tmp_path / "events"
    out = run_job(
        [
            SPARK_SUBMIT,
            "--properties-file",
            "conf/spark-local.conf",
            "--master",
            "local-cluster[2,1,1024]",
            *[item for pair in event_log_conf(events) for item in ("--conf", pair)],
            TRAIN_JOB,
            "--config",
            str(CONFIGS / "train-async.toml"),
            "--epochs",
            "3",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--output",
            str(tmp_path / "output" / "model.keras"),
            "--test-output",
            str(tmp_path / "output" / "test.parquet"),
        ],
        ROOT,
    )
    log = read_event_log(events)
    assert spark_master(log) == "local-cluster[2,1,1024]"
    assert sorted(set(task_executors(log, barrier=False))) == ["0", "1"]

    assert not re.search(r" INFO |\[Stage \d+|log4j profile|NativeCodeLoader", out), out
    for epoch in (1, 2, 3):  # sparkdl's one line per epoch, never a second one from the job
        assert len(re.findall(rf"\bepoch {epoch}/3\b(?!\s+step).*\bloss=[\d.]+", out)) == 1, out
    assert re.search(r"trained on 2 workers .*\(async mode, \d+ steps/epoch of 16 rows per worker\)", out), out
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.85, out
    _, x_test, _, y_test = digits
    assert saved_model_accuracy(tmp_path / "output" / "model.keras", x_test, y_test) > 0.85
    test_rows = pq.read_table(tmp_path / "output" / "test.parquet")
    assert test_rows.column_names == ["features", "label"] and 250 < test_rows.num_rows < 470
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.json")) == [f"epoch-00000{e}.json" for e in (1, 2, 3)]


def test_spark_submit_on_too_few_slots_is_refused_before_training(tmp_path):
    """--master local[1] has one task slot: two workers are refused with the slot error, naming the job's flag,
    before sparkdl launches anything (no training line, no epoch, no barrier stage)."""
    events = tmp_path / "events"
    out = run_job(
        spark_submit(
            "local[1]", TRAIN_JOB, "--num-workers", "2", "--epochs", "2", "--verbose", conf=event_log_conf(events)
        ),
        tmp_path,
        expect_rc=2,
    )
    assert re.search(
        r"train\.py: error: Expected --num-workers <= the cluster's task slots\. "
        r"Received --num-workers 2, but the cluster runs 1 tasks at once \(master='local\[1\]'",
        out,
    ), out
    assert "sparkdl-job phase fit" not in out and "training on" not in out and "trained on" not in out, out
    assert not re.search(r"\bepoch 1/2\b", out), out
    log = read_event_log(events)
    assert spark_master(log) == "local[1]" and task_executors(log, barrier=True) == []


def test_spark_submits_conf_wins_over_the_jobs_defaults(tmp_path):
    """The job sets its defaults only where spark-submit left a setting unset: a user's --conf for each one that
    train.py fills in (the progress bar, the log level, the Python workers' daemon) is the running application's
    setting (its environment in the event log), and two show in its output: Spark's progress bar is drawn, and its
    INFO lines after start-up are printed."""
    events = tmp_path / "events"
    users = {
        "spark.ui.showConsoleProgress": "true",
        "spark.log.level": "INFO",
        "spark.python.daemon.module": "pyspark.daemon",
    }
    out = run_job(
        spark_submit(
            "local[2]",
            TRAIN_JOB,
            "--epochs",
            "2",
            conf=(*event_log_conf(events), *(f"{name}={value}" for name, value in users.items())),
        ),
        tmp_path,
    )
    log = read_event_log(events)
    assert {name: spark_property(log, name) for name in users} == users
    assert re.search(r"\[Stage \d+:", out), out[-6000:]  # the console progress bar (the job's default: none)
    assert re.search(r" INFO DAGScheduler: Job \d+ finished", out), out[-6000:]  # (the job's default: WARN)
    assert re.search(r"trained on 2 workers", out), out[-6000:]


def test_a_missing_data_path_is_refused_before_spark_starts(tmp_path):
    """Under spark-submit (whose JVM exists already) and with plain python: one error line, exit status 2, and no
    SparkContext ever started (its first INFO line would show with --verbose)."""
    missing = tmp_path / "missing.parquet"
    for command in (
        spark_submit("local[1]", TRAIN_JOB, "--data", str(missing), "--verbose"),
        [sys.executable, TRAIN_JOB, "--data", f"file://{missing}", "--verbose"],
    ):
        out = run_job(command, tmp_path, expect_rc=2)
        assert re.search(rf"^train\.py: error: --data \S*{missing}: no such file or directory", out, re.M), out
        assert "Running Spark version" not in out and "sparkdl-job phase session" not in out, out


def test_mode_settings_are_checked_before_spark_starts_naming_the_flags(tmp_path):
    """The ssp mode without its setting fails at once, as argparse fails: exit status 2, one line, no trace."""
    done = subprocess.run(
        [sys.executable, TRAIN_JOB, "--mode", "ssp", "--verbose"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "train.py: error: --mode ssp needs --max-staleness: how many pushes a worker may run ahead of the slowest."
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--mode", "async", "--max-staleness", "2"],
            "--max-staleness applies to --mode ssp only. Received: --max-staleness 2 with --mode async",
        ),
        (
            ["--push-every", "2"],
            "--push-every applies to --mode async or hogwild or ssp only. Received: --push-every 2 with --mode sync",
        ),
        (
            ["--mode", "average", "--num-servers", "2"],
            "--num-servers applies to --mode async or hogwild or ssp or sync_ps only",
        ),
        (
            ["--mode", "ssp", "--max-staleness", "-1"],
            "Expected --max-staleness to be a non-negative integer. Received: --max-staleness -1",
        ),
        (["--epochs", "0"], "Expected --epochs to be a positive integer. Received: --epochs 0"),
        (
            ["--test-fraction", "1"],
            "Expected --test-fraction to be a fraction in (0, 1). Received: --test-fraction 1.0",
        ),
        (["--learning-rate", "0"], "Expected --learning-rate to be a positive number"),
    ],
)
def test_bad_settings_stop_the_job_naming_its_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        train.parse_args(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error, error


def test_master_flag_is_refused_under_spark_submit_and_over_connect(capsys, monkeypatch):
    """spark-submit's own --master wins: the job's --master (for plain python) is refused, not silently applied."""
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")  # what spark-submit sets for the Python it starts
    with pytest.raises(SystemExit):
        train.parse_args(["--master", "local[4]"])
    assert "--master is for plain python; under spark-submit" in capsys.readouterr().err
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT")
    with pytest.raises(SystemExit):
        predict.parse_args(["--data", "rows.parquet", "--master", "local[4]", "--remote", "sc://localhost:15002"])
    assert "--master cannot be used over Spark Connect" in capsys.readouterr().err


def test_spark_submit_remote_is_found(monkeypatch):
    """spark-submit --remote passes the server to the job in its init conf, not as SPARK_REMOTE."""
    args = train.parse_args([])
    assert _spark.remote_url(args) is None
    monkeypatch.setenv("PYSPARK_REMOTE_INIT_CONF_LEN", "1")
    monkeypatch.setenv("PYSPARK_REMOTE_INIT_CONF_0", json.dumps({"spark.remote": "sc://host:15002"}))
    assert _spark.remote_url(args) == "sc://host:15002"
    assert _spark.remote_url(train.parse_args(["--remote", "sc://other:1"])) == "sc://other:1"


def test_python_job_on_user_parquet_with_column_list(tmp_path, spark, digits):
    x_train, _, y_train, _ = digits
    columns = {f"pixel{i}": x_train[:, i].astype(float).tolist() for i in range(64)}
    rows = [tuple(columns[c][r] for c in columns) + (int(y_train[r]),) for r in range(len(y_train))]
    spark.createDataFrame(rows, list(columns) + ["digit"]).write.parquet(str(tmp_path / "digits.parquet"))

    out = run_job(
        [
            sys.executable,
            TRAIN_JOB,
            "--master",
            "local[2]",
            "--data",
            "digits.parquet",
            "--features-col",
            ",".join(columns),
            "--label-col",
            "digit",
            "--epochs",
            "3",
            "--output",
            "out/model.keras",
        ],
        tmp_path,
    )
    assert re.search(r"trained on 2 workers", out)
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.8, out
    assert (tmp_path / "out" / "model.keras").exists()
    assert not re.search(r" INFO |log4j profile|NativeCodeLoader", out), out  # plain python is quiet too


def test_python_job_trains_a_users_two_input_model_from_a_toml_mapping(tmp_path, spark):
    """--model with inputs by name (a TOML table), integer ids through an Embedding, and sample weights."""
    import keras

    rng = np.random.default_rng(0)
    ids = 2**40 + rng.integers(0, 30, 600)
    rows = [(int(i), rng.normal(size=3).tolist(), int(i % 3 == 0), 1.0) for i in ids]
    spark.createDataFrame(rows, "user_id long, numeric array<double>, clicked int, w double").write.parquet(
        str(tmp_path / "clicks.parquet")
    )
    numeric = keras.Input((3,), name="numeric")
    user = keras.Input((1,), name="user", dtype="int64")
    index = keras.layers.IntegerLookup(vocabulary=np.arange(2**40, 2**40 + 30, dtype=np.int64))(user)
    embedded = keras.layers.Flatten()(keras.layers.Embedding(31, 4)(index))
    joined = keras.layers.Concatenate()([numeric, embedded])
    model = keras.Model({"numeric": numeric, "user": user}, keras.layers.Dense(2, activation="softmax")(joined))
    model.compile(keras.optimizers.Adam(0.05), "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.save(tmp_path / "clicks.keras")
    (tmp_path / "clicks.toml").write_text(
        'model = "clicks.keras"\ndata = "clicks.parquet"\nlabel_col = "clicked"\nsample_weight_col = "w"\n'
        "epochs = 8\nbatch_size = 16\ntest_fraction = 0.2\n"
        '[features_col]\nnumeric = "numeric"\nuser = "user_id"\n'
    )

    out = run_job(
        [sys.executable, TRAIN_JOB, "--master", "local[2]", "--config", "clicks.toml", "--output", "out/m.keras"],
        tmp_path,
    )
    assert re.search(r"trained on 2 workers", out), out
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.95, out  # ids intact, else ~0.67
    assert (tmp_path / "out" / "m.keras").exists()


USER_LAYERS = """
import keras


class Halve(keras.layers.Layer):  # not registered with Keras: found through --custom-objects
    def call(self, x):
        return keras.ops.cast(x, "float32") * 0.5
"""


def test_the_jobs_train_and_score_string_columns_with_a_custom_layer_by_import_path(tmp_path, spark, monkeypatch):
    """A review (TextVectorization) and a city (StringLookup) by input name, and a layer of the user's own module,
    given to both jobs as --custom-objects; the test rows' strings are scored by predict.py."""
    import keras
    import pyarrow.parquet as pq

    (tmp_path / "user_layers.py").write_text(USER_LAYERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the jobs import it as a user's job would
    from user_layers import Halve

    rng = np.random.default_rng(0)
    words, cities = (
        ["très", "bien", "schön", "好", "gut", "mal", "plohо", "nul"],
        ["Zürich", "東京", "Kraków", "Москва"],
    )
    rows = []
    for _ in range(600):
        review, city = " ".join(rng.choice(words, 4)), str(rng.choice(cities))
        rows.append((review, city, int(("好" in review) != (city in cities[:2]))))
    spark.createDataFrame(rows, "review string, city string, liked int").write.parquet(str(tmp_path / "r.parquet"))
    review, city = keras.Input((1,), name="review", dtype="string"), keras.Input((1,), name="city", dtype="string")
    vectorize = keras.layers.TextVectorization(vocabulary=words, output_mode="multi_hot")
    counted = Halve()(keras.layers.Reshape((len(words) + 1,))(vectorize(review)))
    place = keras.layers.Flatten()(
        keras.layers.Embedding(len(cities) + 1, 4)(keras.layers.StringLookup(vocabulary=cities)(city))
    )
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([counted, place]))
    model = keras.Model({"review": review, "city": city}, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(keras.optimizers.Adam(0.03), "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.save(tmp_path / "reviews.keras")
    features = '{"review": "review", "city": "city"}'

    out = run_job(
        [
            sys.executable,
            TRAIN_JOB,
            "--master",
            "local[2]",
            "--model",
            "reviews.keras",
            "--data",
            "r.parquet",
            "--features-col",
            features,
            "--label-col",
            "liked",
            "--epochs",
            "10",
            "--custom-objects",
            "user_layers.Halve",
            "--output",
            "out/m.keras",
            "--test-output",
            "test.parquet",
        ],
        tmp_path,
    )
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.9, out  # both strings arrive intact
    out = run_job(
        [
            sys.executable,
            PREDICT_JOB,
            "--master",
            "local[2]",
            "--model",
            "out/m.keras",
            "--data",
            "test.parquet",
            "--output",
            "scored.parquet",
            "--features-col",
            features,
            "--custom-objects",
            "user_layers.Halve",
        ],
        tmp_path,
    )
    scored = pq.read_table(tmp_path / "scored.parquet").to_pandas()
    trained = keras.models.load_model(tmp_path / "out" / "m.keras", custom_objects={"Halve": Halve})
    expected = trained.predict({"review": tf_strings(scored["review"]), "city": tf_strings(scored["city"])}, verbose=0)
    assert np.array_equal(scored["prediction"].to_numpy(), expected.argmax(axis=1).astype(float)), out


def tf_strings(values):
    import tensorflow as tf

    return tf.constant([[value] for value in values])


def test_a_column_mapping_needs_the_users_model(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--features-col", '{"numeric": "x"}'])
    assert "--features-col maps model input/output names to columns: that needs your model, --model" in (
        capsys.readouterr().err
    )


def _jvm_maps_of(process, archive, timeout=120.0):
    """The files mapped by the JVM that ``process`` (a plain-python job) started with ``archive`` in its options."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                # The JVM itself, whose own option it is (spark-submit's launcher sees it inside a --conf).
                if f"-XX:SharedArchiveFile={archive}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(
                    b"\0"
                ):
                    time.sleep(1.0)  # the archive is mapped as the JVM initializes, well before Spark starts
                    return Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError("no JVM with the archive in its options was seen")


def test_plain_python_job_writes_a_class_archive_once_and_maps_it_after(tmp_path):
    """With plain python the job starts its own JVM: the first run writes the classes it loaded to an archive as
    that JVM exits (nothing printed about it), and the next run's JVM maps the archive instead of loading them."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("PYSPARK_PYTHON", None)
    command = [sys.executable, TRAIN_JOB, "--master", "local[2]", "--epochs", "1", "--output", "model.keras"]
    first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    archives = list((tmp_path / "cache" / "sparkdl" / "jvm").iterdir())
    assert [a.suffix for a in archives] == [".jsa"] and archives[0].stat().st_size > 10**7, archives  # no .tmp left
    assert "cds" not in first.stdout + first.stderr and "[warning]" not in first.stdout + first.stderr

    second = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        maps = _jvm_maps_of(second, archives[0])
        output = second.communicate(timeout=600)[0]
    finally:
        second.kill()
    assert str(archives[0]) in maps  # mapped: the JVM found the archive valid for its classpath
    assert second.returncode == 0 and "test accuracy" in output, output
    assert list((tmp_path / "cache" / "sparkdl" / "jvm").iterdir()) == archives


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory, digits):
    return train_digits_model(tmp_path_factory.mktemp("model"), digits)


def test_predict_job_scores_every_row_of_a_parquet_dataset(tmp_path, digits, digits_model):
    model, model_path = digits_model
    _, x_test, _, _ = digits
    table = write_digit_rows(tmp_path / "rows.parquet", x_test)

    out = run_job(
        spark_submit(
            "local[2]",
            PREDICT_JOB,
            "--config",
            str(CONFIGS / "predict.toml"),
            "--model",
            str(model_path),
            "--data",
            "rows.parquet",
            "--output",
            "scored.parquet",
            "--features-col",
            ",".join(PIXELS),
        ),
        tmp_path,
    )
    assert f"scored {len(x_test)} rows" in out, out
    check_scored(tmp_path / "scored.parquet", table, model, x_test)


def test_the_jobs_assemble_a_column_list_as_fit_does_and_name_a_bad_column(spark):
    """The jobs read `--features-col` through the public sparkdl.features_column, as fit reads `features_col`."""
    df = spark.createDataFrame([(1.5, 2, True, "a", [3, 4])], "x double, n int, b boolean, s string, a array<int>")
    (row,) = df.select(sparkdl.features_column(df, ["n", "x", "b"]).alias("f")).collect()
    assert row.f == [2.0, 1.5, 1.0]
    (row,) = df.select(sparkdl.features_column(df, "a").alias("f")).collect()
    assert row.f == [3.0, 4.0]
    with pytest.raises(ValueError, match=r"Column 'nope' given as `features_col` is not in the DataFrame"):
        sparkdl.features_column(df, ["x", "nope"])
    with pytest.raises(ValueError, match=r"Column 's' \(`features_col`\) holds strings"):
        sparkdl.features_column(df, ["x", "s"])


def test_predict_job_checks_data_model_and_output_before_starting_spark(tmp_path, capsys, digits_model):
    _, model_path = digits_model
    (tmp_path / "rows.parquet").mkdir()
    (tmp_path / "scored.parquet").mkdir()
    cases = [
        (["--model", str(model_path)], "Expected --data"),
        (
            ["--model", str(tmp_path / "no-such-model.keras"), "--data", str(tmp_path / "rows.parquet")],
            "--model " + str(tmp_path / "no-such-model.keras") + ": no such file",
        ),
        (
            ["--model", str(model_path), "--data", str(tmp_path / "none.parquet"), "--master", "local[1]"],
            "--data " + str(tmp_path / "none.parquet") + ": no such file or directory",
        ),
        (
            [
                "--model",
                str(model_path),
                "--data",
                str(tmp_path / "rows.parquet"),
                "--master",
                "local[1]",
                "--output",
                str(tmp_path / "scored.parquet"),
            ],
            "exists already. Use --mode overwrite",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exited:
            predict.main(argv)
        assert exited.value.code == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error


# --- config files --------------------------------------------------------------------------------------------------


def write_config(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_flags_override_the_config_file(tmp_path):
    config = write_config(tmp_path, 'mode = "ssp"\nmax_staleness = 1\nepochs = 7\nlearning_rate = 1\n')
    args = train.parse_args(["--epochs", "2", "--config", config, "--max-staleness", "3"])
    assert (args.mode, args.epochs, args.max_staleness) == ("ssp", 2, 3)
    assert args.learning_rate == 1.0 and isinstance(args.learning_rate, float)
    assert args.batch_size == 16 and args.push_every is None  # neither in the file nor given: the job's defaults


@pytest.mark.parametrize(
    "text, expected",
    [
        ("num_worker = 4\n", ["Unknown key 'num_worker'", "num_workers"]),
        ('epochs = "five"\n', ["Expected 'epochs'", "an integer", "Received: 'five'"]),
        ("epochs = true\n", ["Expected 'epochs'", "an integer", "Received: True"]),
        ('mode = "sideways"\n', ["Expected 'mode'", "'hogwild'", "Received: 'sideways'"]),
        ("epochs =\n", ["not valid TOML"]),
    ],
)
def test_a_bad_config_file_stops_the_job_naming_file_and_key(tmp_path, capsys, text, expected):
    config = write_config(tmp_path, text)
    with pytest.raises(SystemExit) as exited:
        train.parse_args(["--config", config])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    for fragment in [config, *expected]:
        assert fragment in error


def test_every_shipped_config_is_valid_for_its_job():
    modes = []
    for path in sorted(CONFIGS.glob("*.toml")):
        job = train if path.stem.startswith("train-") else predict
        args = job.parse_args(["--config", str(path)])
        if job is train:
            assert path.stem == f"train-{args.mode}"
            modes.append(args.mode)
        else:
            assert path.stem == "predict" and args.data
    assert sorted(modes) == sorted(MODES)  # one example per mode
