"""Large models on the shared session: files Spark's file server streams to the executors, average mode's limits.

The end-to-end checks with a driver heap smaller than the model are in test_large_results.py (slow).
"""

import hashlib
import os

import numpy as np
import pytest
from pyspark import SparkFiles

from sparkdl.keras.serialization import model_to_bytes
from sparkdl.launch import session
from sparkdl.ml.inference import predict
from sparkdl.modes.average import capacity

_MB = 1 << 20


def test_bytes_shipped_as_a_file_are_added_once_and_read_by_the_tasks_from_their_own_copy(spark):
    data = np.random.default_rng(0).integers(0, 256, 3 * _MB, dtype=np.uint8).tobytes()
    digest = hashlib.sha256(data).hexdigest()
    before = list(spark.sparkContext.listFiles)
    shipped = session.ship_file(spark, data, digest, suffix=".bin", what="the test bytes")
    again = session.ship_file(spark, data, digest, suffix=".bin", what="the test bytes")
    added = [path for path in spark.sparkContext.listFiles if path not in before]
    assert len(added) == 1 and added[0].endswith(f"/sparkdl-{digest}.bin"), added
    assert again.name == shipped.name

    def read(rows):
        path = SparkFiles.get(shipped.name)  # where this task's executor keeps its copy
        yield os.path.dirname(path) == SparkFiles.getRootDirectory(), hashlib.sha256(shipped.value).hexdigest()

    assert spark.sparkContext.parallelize(range(2), 2).mapPartitions(read).collect() == [(True, digest)] * 2


def test_a_scored_dataframe_still_evaluates_after_many_other_models_were_shipped(spark):
    """transform is lazy: a model's file stays for the session, however many models are scored after it."""
    import keras

    df = spark.createDataFrame([([float(i), 1.0],) for i in range(4)], "features array<float>")

    def scored(bias: float):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, bias_initializer="zeros")])
        model.layers[0].set_weights([np.ones((2, 1), np.float32), np.array([bias], np.float32)])
        model.compile(optimizer="sgd", loss="mse")
        return predict(df, model_to_bytes(model), features_col="features", prediction_col="y")

    first = scored(100.0)
    for bias in range(5):  # more models than any driver-side cache of shipped models would keep
        scored(float(bias)).collect()
    assert sorted(row.y for row in first.collect()) == [101.0, 102.0, 103.0, 104.0]


def test_average_mode_needs_a_heap_for_its_deltas_and_the_max_result_size_for_their_sum():
    assert capacity.shortfalls(60 * _MB, 1, heap=512 * _MB, max_result=1024 * _MB) == []
    assert capacity.shortfalls(100 * _MB, 1, heap=512 * _MB, max_result=1024 * _MB) == [
        "spark.driver.memory of at least 550 MB (the heap is 512 MB)"
    ]
    assert capacity.shortfalls(300 * _MB, 4, heap=8192 * _MB, max_result=1024 * _MB) == [
        "spark.driver.maxResultSize of at least 1200 MB (it is 1024 MB; 0 for no limit)"
    ]
    assert capacity.shortfalls(300 * _MB, 4, heap=8192 * _MB, max_result=0) == []  # 0: Spark's "no limit"
    assert capacity.shortfalls(300 * _MB, 4, heap=None, max_result=None) == []  # neither known (Spark Connect)


def test_average_mode_refuses_on_the_driver_what_this_sessions_driver_cannot_carry(spark):
    capacity.check(spark, 1 * _MB, 2)  # a small model: nothing to refuse
    with pytest.raises(ValueError) as refused:
        capacity.check(spark, 2048 * _MB, 2)
    message = str(refused.value)
    assert message.startswith("Expected a driver that can carry the rounds of mode='average'"), message
    assert "spark.driver.memory of at least 18432 MB" in message, message  # 2 GB x (2 + 3.5 x 2 workers)
    assert "spark.driver.maxResultSize of at least 4096 MB (it is 1024 MB" in message, message  # the default, 1g
