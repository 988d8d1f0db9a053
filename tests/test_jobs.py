"""The main job, run the way users run it: spark-submit on a cluster of separate executor processes, and python."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

JOB = os.path.join(os.path.dirname(__file__), "..", "jobs", "train.py")


def run_job(command, tmp_path):
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def saved_model_accuracy(path, x, y):
    import keras

    model = keras.models.load_model(path)
    return float(np.mean(model.predict(x, verbose=0).argmax(axis=1) == y))


def test_spark_submit_on_local_cluster(tmp_path, digits):
    """Two executors in separate JVMs and Python processes: the ring really crosses process boundaries."""
    spark_submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    out = run_job([spark_submit, "--master", "local-cluster[2,1,1024]", "--conf", "spark.driver.host=127.0.0.1",
                   "--conf", "spark.ui.enabled=false", JOB, "--epochs", "4", "--output", "model.keras"], tmp_path)
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

    out = run_job([sys.executable, JOB, "--master", "local[2]", "--data", "digits.parquet",
                   "--features-col", ",".join(columns), "--label-col", "digit", "--epochs", "3",
                   "--output", "out/model.keras"], tmp_path)
    assert re.search(r"trained on 2 workers", out)
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.8, out
    assert (tmp_path / "out" / "model.keras").exists()
