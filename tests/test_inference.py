"""Batch inference (sparkdl.ml.inference.predict) against in-process model.predict, on real Spark and Keras."""

from collections import Counter

import keras
import numpy as np
import pytest
from custom_layer import LoadLog, logged
from models import make_mlp
from pyspark.errors import PythonException
from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator
from pyspark.ml.functions import array_to_vector
from pyspark.ml.linalg import DenseVector
from pyspark.sql import functions as F
from spark_jobs import no_spark_job

from sparkdl.keras.serialization import model_to_bytes
from sparkdl.ml.inference import predict

WIDTH = 64
COLUMNS = [f"c{i}" for i in range(WIDTH)]


def _dense_model(units, activation=None, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((WIDTH,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(units, activation=activation),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.fixture(scope="module")
def test_rows(digits):
    _, x_test, _, y_test = digits
    return x_test, y_test


@pytest.fixture(scope="module")
def frames(spark, test_rows):
    """The digits test split as three DataFrames (Vector, array and column-list features), 3 partitions each."""
    x, y = test_rows
    rows = [(i, int(label), row.tolist(), *map(float, row)) for i, (row, label) in enumerate(zip(x, y))]
    base = (
        spark.createDataFrame(
            rows, ", ".join(["id long", "label long", "features array<float>"] + [f"{c} double" for c in COLUMNS])
        )
        .repartition(3, "id")
        .cache()
    )
    return {
        "array": (base.select("id", "label", "features"), "features"),
        "vector": (base.select("id", "label", array_to_vector("features").alias("features")), "features"),
        "columns": (base.select("id", "label", *COLUMNS), COLUMNS),
    }


@pytest.fixture(scope="module")
def classifier(digits):
    x_train, _, y_train, _ = digits
    model = make_mlp()
    model.fit(x_train, y_train, epochs=5, batch_size=64, verbose=0)
    return model


@pytest.fixture(scope="module")
def binary_classifier(digits):
    x_train, _, y_train, _ = digits
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((WIDTH,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1, activation="sigmoid")]
    )
    model.compile(optimizer="adam", loss="binary_crossentropy")
    model.fit(x_train, (y_train >= 5).astype(np.float32), epochs=3, batch_size=64, verbose=0)
    return model


def _by_id(df):
    return sorted(df.collect(), key=lambda r: r.id)


@pytest.mark.parametrize("kind", ["array", "vector", "columns"])
def test_softmax_classifier_matches_model_predict(spark, frames, test_rows, classifier, kind):
    df, features_col = frames[kind]
    x, _ = test_rows
    out = predict(df, model_to_bytes(classifier), features_col=features_col, prediction_col="prediction")

    assert out.columns == df.columns + ["prediction", "probability", "rawPrediction"]
    assert out.rdd.getNumPartitions() == 3
    rows = _by_id(out)
    assert [r.id for r in rows] == list(range(len(x)))
    expected = classifier.predict(x, verbose=0)
    assert all(isinstance(r.probability, DenseVector) and isinstance(r.rawPrediction, DenseVector) for r in rows)
    np.testing.assert_array_equal([r.prediction for r in rows], expected.argmax(axis=1).astype(float))
    np.testing.assert_allclose([r.probability.toArray() for r in rows], expected, atol=1e-6)
    np.testing.assert_allclose([r.rawPrediction.toArray() for r in rows], expected, atol=1e-6)
    original = _by_id(df)
    assert [r.label for r in rows] == [r.label for r in original]
    if kind != "columns":
        assert [list(r.features) for r in rows] == [list(r.features) for r in original]


def test_evaluators_match_numpy_and_sklearn(frames, test_rows, classifier, binary_classifier):
    from sklearn.metrics import roc_auc_score

    df, _ = frames["vector"]
    x, y = test_rows
    multi = predict(df, model_to_bytes(classifier), features_col="features", prediction_col="prediction")
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(multi)
    assert accuracy == pytest.approx(np.mean(classifier.predict(x, verbose=0).argmax(axis=1) == y), abs=1e-12)
    assert accuracy > 0.8  # a trained model, so that the comparison means something

    labels = df.withColumn("label", (F.col("label") >= 5).cast("double"))
    binary = predict(labels, model_to_bytes(binary_classifier), features_col="features", prediction_col="prediction")
    auc = BinaryClassificationEvaluator().evaluate(binary)
    assert auc == pytest.approx(roc_auc_score(y >= 5, binary_classifier.predict(x, verbose=0)[:, 0]), abs=1e-6)
    assert auc > 0.8


def test_sigmoid_binary_classifier(frames, test_rows, binary_classifier):
    df, features_col = frames["columns"]
    x, _ = test_rows
    out = predict(
        df, model_to_bytes(binary_classifier), features_col=features_col, prediction_col="yhat", raw_prediction_col=None
    )
    assert out.columns == df.columns + ["yhat", "probability"]
    rows = _by_id(out)
    p = binary_classifier.predict(x, verbose=0)[:, 0].astype(np.float64)
    np.testing.assert_array_equal([r.yhat for r in rows], (p > 0.5).astype(float))
    np.testing.assert_allclose([r.probability.toArray() for r in rows], np.stack([1 - p, p], axis=1), atol=1e-6)

    only = predict(
        df,
        model_to_bytes(binary_classifier),
        features_col=features_col,
        prediction_col="yhat",
        probability_col=None,
        raw_prediction_col=None,
    )
    assert only.columns == df.columns + ["yhat"]
    np.testing.assert_array_equal([r.yhat for r in _by_id(only)], (p > 0.5).astype(float))


def test_regression_gives_a_double(frames, test_rows):
    df, features_col = frames["array"]
    x, _ = test_rows
    model = _dense_model(1)
    out = predict(df, model_to_bytes(model), features_col=features_col, prediction_col="y")
    assert out.columns == df.columns + ["y"]  # no probability columns for a regression
    assert dict(out.dtypes)["y"] == "double"
    np.testing.assert_allclose([r.y for r in _by_id(out)], model.predict(x, verbose=0)[:, 0], rtol=1e-5, atol=1e-6)


def test_one_output_of_several_values_is_an_array_and_several_outputs_a_struct(frames, test_rows):
    df, features_col = frames["vector"]
    x, _ = test_rows
    model = _dense_model(3)
    out = predict(df, model_to_bytes(model), features_col=features_col, prediction_col="y")
    assert out.columns == df.columns + ["y"] and dict(out.dtypes)["y"] == "array<double>"
    np.testing.assert_allclose([r.y for r in _by_id(out)], model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)

    # Two heads (a functional model): a struct with a field per output, by name.
    inputs = keras.Input((WIDTH,))
    heads = [
        keras.layers.Dense(2, name="scores")(inputs),
        keras.layers.Dense(1, activation="sigmoid", name="p")(inputs),
    ]
    two = keras.Model(inputs, heads)
    out = predict(df, model_to_bytes(_compiled(two)), features_col=features_col, prediction_col="y", batch_size=50)
    assert dict(out.dtypes)["y"] == "struct<scores:array<double>,p:double>"
    scores, p = two.predict(x, verbose=0)
    rows = _by_id(out.select("id", "y.scores", "y.p"))
    np.testing.assert_allclose([r.scores for r in rows], scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r.p for r in rows], p[:, 0], rtol=1e-5, atol=1e-6)
    # The same model built on a dict of outputs: the fields follow its output names.
    named = keras.Model(inputs, {"p": heads[1], "scores": heads[0]})
    out = predict(df, model_to_bytes(_compiled(named)), features_col=features_col, prediction_col="y")
    rows = _by_id(out.select("id", "y.scores", "y.p"))
    np.testing.assert_allclose([r.p for r in rows], p[:, 0], rtol=1e-5, atol=1e-6)


def _compiled(model):
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_predict_is_lazy_and_keeps_rows(spark):
    model = _dense_model(10, "softmax")
    df = spark.range(0, 1000, 1, 4).select("id", F.array_repeat(F.col("id").cast("float") / 1000, WIDTH).alias("f"))
    with no_spark_job(spark):
        out = predict(df, model_to_bytes(model), features_col="f", prediction_col="prediction", batch_size=64)
    assert out.count() == 1000 and out.rdd.getNumPartitions() == 4


def test_model_is_loaded_once_per_python_worker(spark, frames, tmp_path):
    """LoadLog records which processes loaded the model (once per load) and which ran it (once per batch)."""
    import os

    df, _ = frames["array"]
    keras.utils.set_random_seed(7)
    model = _compiled(keras.Sequential([keras.Input((WIDTH,)), LoadLog(str(tmp_path)), keras.layers.Dense(2)]))
    model_bytes = model_to_bytes(model)
    settings = dict(features_col="features", custom_objects={"LoadLog": LoadLog})

    def workers(name):
        return [pid for pid in logged(tmp_path / name) if pid != os.getpid()]  # not the driver's own loads

    predict(df, model_bytes, prediction_col="y", **settings).write.format("noop").mode("overwrite").save()
    first_calls = workers("calls")
    first = set(first_calls)
    # A second, separate transformation with the same model: its tasks must reuse the loaded model.
    predict(df.where("id % 2 = 0"), model_bytes, prediction_col="y2", batch_size=7, **settings).write.format(
        "noop"
    ).mode("overwrite").save()
    second = set(workers("calls")[len(first_calls) :])
    loads = Counter(workers("loads"))

    assert first and set(workers("calls")) <= set(loads), (first, loads)  # every process that ran it loaded it
    assert all(n == 1 for n in loads.values()), loads  # never loaded twice in one process
    assert second  # the second job ran the model
    assert first & second, (first, second)  # a worker that loaded it for the first job ran the second job with it


def test_predict_step_is_traced_once_per_python_worker_for_batches_of_every_size(spark, tmp_path):
    """LoadLog tags every call with the trace it runs in: one trace per worker runs batches of several row counts,
    in both jobs (Keras's predict_on_batch traces again when a second row count shows up)."""
    import os

    model = _compiled(keras.Sequential([keras.Input((WIDTH,)), LoadLog(str(tmp_path)), keras.layers.Dense(2)]))
    model_bytes = model_to_bytes(model)
    # Two tasks of 115 rows, each one Arrow batch, which batch_size=50 runs as pieces of 39, 39 and 37 rows.
    df = spark.range(0, 230, 1, 2).select(F.array_repeat(F.col("id").cast("float") / 230, WIDTH).alias("f"))
    settings = dict(features_col="f", custom_objects={"LoadLog": LoadLog}, batch_size=50)
    for column in ("y", "y2"):
        predict(df, model_bytes, prediction_col=column, **settings).write.format("noop").mode("overwrite").save()

    pids, traces, rows = (logged(tmp_path / "calls", field) for field in (0, 2, 3))
    calls = [(pid, trace, n) for pid, trace, n in zip(pids, traces, rows) if pid != os.getpid()]
    traced: dict[int, set[int]] = {}
    for pid, trace, _ in calls:
        traced.setdefault(pid, set()).add(trace)
    assert sorted(n for _, _, n in calls) == sorted([39, 39, 37] * 4), calls  # every row, in pieces of two sizes
    assert all(len(numbers) == 1 for numbers in traced.values()), traced  # one trace per worker for both sizes


# Bad input ---------------------------------------------------------------------------------------


def _assert_fails_before_any_job(spark, match, df, **kwargs):
    model_bytes = kwargs.pop("model_bytes", None) or model_to_bytes(_dense_model(10, "softmax"))
    kwargs.setdefault("features_col", "features")
    kwargs.setdefault("prediction_col", "prediction")
    with no_spark_job(spark), pytest.raises(ValueError, match=match):
        predict(df, model_bytes, **kwargs)


def test_schema_errors_are_raised_on_the_driver(spark, frames):
    df, _ = frames["array"]
    _assert_fails_before_any_job(
        spark, r"Column 'nope' given as `features_col` is not in the DataFrame", df, features_col="nope"
    )
    text = df.withColumn("text", F.lit("a"))
    _assert_fails_before_any_job(
        spark, r"Column 'text' \(`features_col`\) holds strings .* takes numbers", text, features_col="text"
    )
    _assert_fails_before_any_job(spark, r"column 'features' is array<float>", df, features_col=["id", "features"])
    cols, _ = frames["columns"]
    _assert_fails_before_any_job(
        spark,
        r"Column \[.c0., .c1., .c2.\] \(`features_col`\) holds rows of 3 values; .* takes 64 values per row",
        cols,
        features_col=COLUMNS[:3],
    )
    _assert_fails_before_any_job(
        spark, r"Output column 'label' \(`prediction_col`\) already exists", df, prediction_col="label"
    )
    _assert_fails_before_any_job(spark, r"`batch_size` to be a positive integer", df, batch_size=0)


def _action_error(df, model, **kwargs):
    # One partition: no task with good rows starts TensorFlow in the fresh workers that replace failed ones.
    out = predict(df.coalesce(1), model_to_bytes(model), prediction_col="prediction", **kwargs)
    with pytest.raises(PythonException) as info:  # the task's ValueError, as Spark re-raises it from the action
        out.write.format("noop").mode("overwrite").save()
    return str(info.value)


def test_wrong_width_fails_the_task_with_a_clear_message(spark):
    df = spark.createDataFrame([([1.0, 2.0, 3.0],)] * 5, "features array<double>")
    message = _action_error(df, _dense_model(1), features_col="features")
    assert "Column 'features' (`features_col`) holds rows of 3 values; the model's input" in message


def test_null_and_nan_features_fail_the_task_with_a_clear_message(spark):
    model = _dense_model(1)
    good = [float(i) for i in range(WIDTH)]
    df = spark.createDataFrame([(good,), (None,), (good,)], "features array<float>")
    assert "Column 'features' (`features_col`) has null rows" in _action_error(df, model, features_col="features")

    columns = spark.createDataFrame(
        [tuple(good), tuple(good[:7] + [None] + good[8:])], ", ".join(f"{c} double" for c in COLUMNS)
    )
    assert "Column 'c7' (`features_col`) has null rows" in _action_error(columns, model, features_col=COLUMNS)
    columns = spark.createDataFrame(
        [tuple(good), tuple(good[:9] + [float("nan")] + good[10:])], ", ".join(f"{c} double" for c in COLUMNS)
    )
    assert "Column 'c9' (`features_col`) has rows containing NaN or infinite values" in _action_error(
        columns, model, features_col=COLUMNS
    )
