"""Every update is exact: sync's steps on uneven partitions are one process's, and each row and its weight make the
update once per epoch in the modes whose pushes race or whose rounds average. (That every mode trains every row once
per epoch on uneven partitions is tests/test_every_mode.py's.)

What is counted is what reached the workers' train steps: a layer of the model records the row ids of every
training batch it sees, inside the Spark tasks.
"""

from collections import Counter
from pathlib import Path

import keras
import numpy as np
import pytest
from models import RecordIds, make_mlp, recorded_ids
from partitions import partitions_as_fit_sees_them, training_stream

import sparkdl
from sparkdl import data


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


TARGET, LEARNING_RATE = 1000.0, 1e-3  # far above any prediction of the model below


def _gradient_model(directory: Path):
    """Inputs ``a`` and ``b`` by name, the ids recorded in the train step, and a loss whose gradient does not depend
    on the weights: MAE summed over the batch, against targets far above every prediction, so that each row adds
    exactly ``-w * (a, 1, b)`` to the gradient of (``from_a``'s kernel and bias, ``from_b``'s kernel) at any weights."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((1,), name="id", dtype="int64")
    a, b = keras.Input((3,), name="a"), keras.Input((3,), name="b")
    recorded = RecordIds(str(directory))([ids, a])
    output = keras.layers.Add()(
        [keras.layers.Dense(1, name="from_a")(recorded), keras.layers.Dense(1, use_bias=False, name="from_b")(b)]
    )
    model = keras.Model({"id": ids, "a": a, "b": b}, output)
    model.compile(keras.optimizers.SGD(LEARNING_RATE), keras.losses.MeanAbsoluteError(reduction="sum"))
    return model


@pytest.mark.parametrize(
    "mode, options", [("hogwild", {"num_servers": 2}), ("ssp", {"max_staleness": 0}), ("average", {"sync_every": 3})]
)
def test_every_row_and_its_weight_make_the_update_once_per_epoch(spark, tmp_path, mode, options):
    """Plain SGD, two workers, inputs by name and a weight per row: since each row's gradient is fixed (see
    ``_gradient_model``), the trained weights are exact whatever order the workers' pushes race in (hogwild, ssp) or
    how the rounds fall (average): the start plus ``learning rate * epochs * sum(w * (a, 1, b))`` over the rows as
    collected from the DataFrame (average: half of it, the mean of the two workers' equal-rows deltas). A push
    applied twice or lost, a row trained twice or never, a weight on another row, or ``a`` fed from ``b``'s column
    changes the weights by far more than the float32 rounding allowed."""
    rng = np.random.default_rng(7)
    size, epochs = 64, 2
    left, right, weights = rng.uniform(0, 1, (size, 3)), rng.uniform(1, 2, (size, 3)), rng.uniform(0, 3, size)
    df = spark.createDataFrame(
        [(i, l.tolist(), r.tolist(), TARGET, float(w)) for i, (l, r, w) in enumerate(zip(left, right, weights))],
        "row long, left array<float>, right array<float>, target double, w double",
    ).coalesce(1)  # Spark's round-robin repartition then splits it 32/32, checked below from the recorded ids
    start = _gradient_model(tmp_path)
    # Crossed, and not in the model's input order (id, a, b): matched by position, `a` would get "left"
    features = {"id": "row", "b": "left", "a": "right"}

    result = sparkdl.fit(
        df,
        start,
        features_col=features,
        label_col="target",
        sample_weight_col="w",
        num_workers=2,
        mode=mode,
        epochs=epochs,
        batch_size=8,
        seed=3,
        custom_objects={"RecordIds": RecordIds},
        **options,
    )

    records = recorded_ids(tmp_path)
    assert sorted(records) == [0, 1] and len(records[0]) == len(records[1])  # both workers, equal rows
    assert Counter(row for rows in records.values() for row in rows) == {row: epochs for row in range(size)}
    collected = df.collect()  # the reference rows: the DataFrame's, not what the library prepared
    a = np.array([row.right for row in collected], np.float64)
    b = np.array([row.left for row in collected], np.float64)
    w = np.array([row.w for row in collected], np.float64)
    scale = LEARNING_RATE * epochs / (2 if mode == "average" else 1)
    (kernel_a, bias), (kernel_b,) = start.get_layer("from_a").get_weights(), start.get_layer("from_b").get_weights()
    expected = {
        "from_a": [kernel_a + scale * (w @ a)[:, None], bias + scale * w.sum()],
        "from_b": [kernel_b + scale * (w @ b)[:, None]],
    }
    for name, wanted in expected.items():
        for got, want in zip(result.model.get_layer(name).get_weights(), wanted, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5, err_msg=name)
