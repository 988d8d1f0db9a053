"""Every training row is trained on exactly once per epoch, on uneven partitions, in every mode.

What is counted is what reached the workers' train steps: a layer of the model records the row ids of every
training batch it sees, inside the Spark tasks.
"""

from collections import Counter
from pathlib import Path

import keras
import numpy as np
import pytest
from models import RecordIds, make_mlp
from partitions import partitions_as_fit_sees_them, training_stream
from pyspark.sql import functions as F

import sparkdl
from sparkdl import data

ROWS = 101  # one row per input partition: Spark's round-robin repartition then splits them unevenly


def _uneven_frame(spark):
    return spark.range(0, ROWS, numPartitions=ROWS).select(
        F.col("id"),
        F.array(*[F.rand(i) for i in range(4)]).cast("array<float>").alias("x"),
        (F.col("id") % 2).cast("int").alias("label"),
    )


def _recording_model(directory: Path):
    keras.utils.set_random_seed(0)
    ids = keras.Input((1,), name="id", dtype="int64")
    x = keras.Input((4,), name="x")
    hidden = RecordIds(str(directory))([ids, x])
    model = keras.Model({"id": ids, "x": x}, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


def _records(directory: Path) -> dict[int, list[int]]:
    """Row ids each partition trained on, in order (one process per partition in sync and async modes)."""
    by_partition: dict[int, list[int]] = {}
    for file in sorted(directory.glob("*.txt")):
        for line in file.read_text().splitlines():
            partition, row = map(int, line.split())
            by_partition.setdefault(partition, []).append(row)
    return by_partition


@pytest.mark.parametrize("mode", ["sync", "async", "average"])
def test_each_row_once_per_epoch_on_uneven_partitions(spark, tmp_path, mode):
    df = _uneven_frame(spark)
    epochs, b = 3, 8
    features = {"id": "id", "x": "x"}
    parts = partitions_as_fit_sees_them(data.prepare(df, _recording_model(tmp_path), features, "label", 2), 2)
    sizes = [len(y) for _, y in parts]
    assert sum(sizes) == ROWS and sizes[0] != sizes[1], sizes  # uneven, and ROWS is odd: no even split exists
    options = {"sync_every": 4} if mode == "average" else {}

    result = sparkdl.fit(
        df,
        _recording_model(tmp_path),
        features_col=features,
        num_workers=2,
        mode=mode,
        epochs=epochs,
        batch_size=b,
        custom_objects={"RecordIds": RecordIds},
        **options,
    )

    records = _records(tmp_path)
    assert sorted(records) == [0, 1]  # both workers trained, in the Spark tasks
    every = Counter(row for rows in records.values() for row in rows)
    assert every == {row: epochs for row in range(ROWS)}, "a row trained more or less than once per epoch"
    if mode != "average":  # each partition's records are in order: one epoch is its rows, once each
        for partition, rows in records.items():
            n = sizes[partition]
            assert len(rows) == epochs * n
            for epoch in range(epochs):
                assert sorted(rows[epoch * n : (epoch + 1) * n]) == sorted(set(rows[:n])), (partition, epoch)
    expected_steps = -(-max(sizes) // b)
    assert result.steps_per_epoch == expected_steps
    if mode == "async":  # each worker runs its own rows' steps
        assert result.stats["pushes"] == epochs * sum(-(-n // b) for n in sizes)
    assert result.stats.get("samples", epochs * ROWS) == epochs * ROWS


def test_sync_on_uneven_partitions_is_one_process_on_each_steps_rows(spark, digits):
    """Plain SGD: the ranks' gradients weighed by their rows make each step the mean over all its rows."""
    x_train, _, y_train, _ = digits
    df = spark.createDataFrame(
        [(r.tolist(), int(label)) for r, label in zip(x_train[:101], y_train[:101])],
        "features array<float>, label long",
    ).repartition(101)
    make = lambda: make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(0.1), seed=5)  # noqa: E731
    epochs, b, seed = 2, 8, 4
    parts = partitions_as_fit_sees_them(data.prepare(df, make(), "features", "label", 2), 2)
    assert len(parts[0][0]) != len(parts[1][0])

    result = sparkdl.fit(df, make(), num_workers=2, epochs=epochs, batch_size=b, seed=seed)

    steps = -(-max(len(p[0]) for p in parts) // b)
    assert result.steps_per_epoch == steps
    x, y, sizes = training_stream(parts, steps=steps, epochs=epochs, seed=seed)
    assert len(set(sizes)) > 1  # the global batches differ in size: the rows weigh in, not the ranks
    reference = make()
    position = 0
    for size in sizes:
        reference.train_on_batch(x[position : position + size], y[position : position + size])
        position += size
    for got, want in zip(result.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
