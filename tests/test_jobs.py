"""The jobs, run the way users run them: spark-submit (also on a cluster of separate executor processes) and python,
with their TOML config files."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

JOBS = Path(__file__).resolve().parent.parent / "jobs"
CONFIGS = JOBS.parent / "conf" / "jobs"
TRAIN_JOB = str(JOBS / "train.py")
PREDICT_JOB = str(JOBS / "predict.py")

# The jobs import their helpers as top-level modules, as they do when spark-submit runs them.
sys.path.insert(0, str(JOBS))
import predict  # noqa: E402
import train  # noqa: E402
from sparkdl.api import MODES  # noqa: E402


def run_job(command, tmp_path):
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def spark_submit(master, job, *job_args):
    """A spark-submit command line with this virtualenv's spark-submit, the driver on loopback."""
    return [os.path.join(os.path.dirname(sys.executable), "spark-submit"), "--master", master,
            "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.ui.enabled=false", job, *job_args]


def saved_model_accuracy(path, x, y):
    import keras

    model = keras.models.load_model(path)
    return float(np.mean(model.predict(x, verbose=0).argmax(axis=1) == y))


def test_spark_submit_on_local_cluster(tmp_path, digits):
    """Two executors in separate JVMs and Python processes: the ring really crosses process boundaries."""
    out = run_job(spark_submit("local-cluster[2,1,1024]", TRAIN_JOB, "--epochs", "4", "--output", "model.keras"),
                  tmp_path)
    epochs = re.findall(r"^epoch\s+(\d+)/4\s+accuracy=([\d.]+)\s+loss=([\d.]+)", out, re.M)
    assert [int(e) for e, _, _ in epochs] == [1, 2, 3, 4], out
    losses = [float(loss) for _, _, loss in epochs]
    assert losses[-1] < losses[0], losses
    accuracy = float(re.search(r"test accuracy: ([\d.]+)", out).group(1))
    assert accuracy > 0.85, out
    _, x_test, _, y_test = digits
    assert saved_model_accuracy(tmp_path / "model.keras", x_test, y_test) > 0.85


def test_python_job_on_user_parquet_with_column_list(tmp_path, spark, digits):
    x_train, _, y_train, _ = digits
    columns = {f"pixel{i}": x_train[:, i].astype(float).tolist() for i in range(64)}
    rows = [tuple(columns[c][r] for c in columns) + (int(y_train[r]),) for r in range(len(y_train))]
    spark.createDataFrame(rows, list(columns) + ["digit"]).write.parquet(str(tmp_path / "digits.parquet"))

    out = run_job([sys.executable, TRAIN_JOB, "--master", "local[2]", "--data", "digits.parquet",
                   "--features-col", ",".join(columns), "--label-col", "digit", "--epochs", "3",
                   "--output", "out/model.keras"], tmp_path)
    assert re.search(r"trained on 2 workers", out)
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.8, out
    assert (tmp_path / "out" / "model.keras").exists()


def test_async_training_from_its_config_file_on_local_cluster(tmp_path, digits):
    """The shipped async config on separate executor processes, with a flag overriding the file's epochs;
    the driver checkpoints the server after every epoch."""
    out = run_job(spark_submit("local-cluster[2,1,1024]", TRAIN_JOB, "--config", str(CONFIGS / "train-async.toml"),
                               "--epochs", "3", "--checkpoint-dir", "ckpt"), tmp_path)
    epochs = re.findall(r"^epoch\s+(\d+)/3\s+accuracy=([\d.]+)\s+loss=([\d.]+)", out, re.M)
    assert [int(e) for e, _, _ in epochs] == [1, 2, 3], out
    assert re.search(r"trained on 2 workers .*\(async mode, \d+ steps/epoch of 16 rows per worker\)", out), out
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.85, out
    _, x_test, _, y_test = digits
    assert saved_model_accuracy(tmp_path / "output" / "model.keras", x_test, y_test) > 0.85
    test_rows = pq.read_table(tmp_path / "output" / "test.parquet")
    assert test_rows.column_names == ["features", "label"] and 250 < test_rows.num_rows < 470
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.json")) == [f"epoch-00000{e}.json" for e in (1, 2, 3)]


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory, digits):
    """A small classifier trained in-process, saved as train.py saves its model."""
    from models import make_mlp

    x_train, _, y_train, _ = digits
    model = make_mlp(hidden=(32,))
    model.fit(x_train, y_train, epochs=3, batch_size=32, verbose=0)
    path = tmp_path_factory.mktemp("model") / "digits.keras"
    model.save(path)
    return model, path


def test_predict_job_scores_every_row_of_a_parquet_dataset(tmp_path, digits, digits_model):
    model, model_path = digits_model
    _, x_test, _, _ = digits
    pixels = [f"pixel{i}" for i in range(64)]
    table = pa.table({"id": np.arange(len(x_test)), **{name: x_test[:, i].astype(np.float64)
                                                        for i, name in enumerate(pixels)}})
    (tmp_path / "rows.parquet").mkdir()
    half = len(x_test) // 2  # two files: two tasks score them
    pq.write_table(table.slice(0, half), tmp_path / "rows.parquet" / "part-0.parquet")
    pq.write_table(table.slice(half), tmp_path / "rows.parquet" / "part-1.parquet")

    out = run_job(spark_submit("local[2]", PREDICT_JOB, "--config", str(CONFIGS / "predict.toml"),
                               "--model", str(model_path), "--data", "rows.parquet", "--output", "scored.parquet",
                               "--features-col", ",".join(pixels)), tmp_path)
    assert f"scored {len(x_test)} rows" in out, out

    scored = pq.read_table(tmp_path / "scored.parquet").sort_by("id")
    assert scored.column_names == ["id", *pixels, "prediction", "probability"]
    np.testing.assert_array_equal(scored["id"].to_numpy(), np.arange(len(x_test)))  # every row, once
    np.testing.assert_array_equal(scored["pixel5"].to_numpy(), table["pixel5"].to_numpy())
    expected = model.predict(x_test, verbose=0)
    np.testing.assert_array_equal(scored["prediction"].to_numpy(), expected.argmax(axis=1))
    probability = np.array(scored["probability"].to_pylist())
    np.testing.assert_allclose(probability, expected, atol=1e-5)


def test_predict_job_needs_data_and_an_existing_model_file_before_starting_spark(tmp_path, capsys):
    with pytest.raises(SystemExit):
        predict.main(["--model", "model.keras"])
    assert "Expected --data" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no-such-model.keras"):
        predict.main(["--model", str(tmp_path / "no-such-model.keras"), "--data", "rows.parquet"])


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


@pytest.mark.parametrize("text, expected", [
    ("num_worker = 4\n", ["Unknown key 'num_worker'", "num_workers"]),
    ('epochs = "five"\n', ["Expected 'epochs'", "an integer", "Received: 'five'"]),
    ("epochs = true\n", ["Expected 'epochs'", "an integer", "Received: True"]),
    ('mode = "sideways"\n', ["Expected 'mode'", "'hogwild'", "Received: 'sideways'"]),
    ("epochs =\n", ["not valid TOML"]),
])
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
