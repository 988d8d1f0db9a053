"""One SparkSession for the whole test run: local[2,2] (two task slots, a failed task retried once), loopback only."""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers must see this virtualenv
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # keep every socket on loopback
# Workers import test-only Keras layers (tests/models.py) when they load a model.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))

import numpy as np
import pytest
from frames import digits_frame


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("sparkdl-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's handwritten digits (shipped with the package), scaled to [0, 1], 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int64), test_size=0.2, random_state=0, stratify=y)


@pytest.fixture(scope="session")
def digits_df(spark, digits):
    x_train, _, y_train, _ = digits
    return digits_frame(spark, x_train, y_train).cache()
