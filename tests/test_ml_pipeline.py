"""KerasEstimator / KerasModel as Spark ML stages: Pipeline, persistence, tuning, evaluators."""

import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from custom_layer import LoadLog, Scale, logged, make_scaled_classifier
from models import make_mlp
from pyspark.ml import Pipeline
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

from sparkdl.ml import KerasEstimator, KerasModel
from sparkdl.modes.registry import declared_options

PIXELS = [f"p{i}" for i in range(64)]


@pytest.fixture(scope="module")
def digits_frames(spark, digits):
    x_train, x_test, y_train, y_test = digits

    def frame(x, y):
        return spark.createDataFrame(
            [tuple(float(v) for v in row) + (int(label),) for row, label in zip(x, y)], PIXELS + ["label"]
        )

    return frame(x_train, y_train).cache(), frame(x_test, y_test).cache()


def pipeline(estimator):
    return Pipeline(
        stages=[
            VectorAssembler(inputCols=PIXELS, outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="scaled"),
            estimator,
        ]
    )


@pytest.fixture(scope="module")
def fitted(digits_frames):
    train, _ = digits_frames
    estimator = KerasEstimator(
        model=make_mlp(),
        featuresCol="scaled",
        labelCol="label",
        numWorkers=2,
        mode="sync",
        epochs=3,  # over 90% of the held-out rows right after 3 (tests/test_sync_training.py holds sync to 96%)
        batchSize=16,
        seed=0,
        validationSplit=0.1,
    )
    return pipeline(estimator).fit(train)


def test_pipeline_fits_scores_and_evaluates(fitted, digits_frames):
    """The pipeline trains (every epoch validated on the split it held out), its model scores each row as its Keras
    model predicts the row's scaled pixels, and the evaluator reads those predictions."""
    _, test = digits_frames
    stage = fitted.stages[-1]
    assert isinstance(stage, KerasModel)
    assert len(stage.history["loss"]) == 3
    assert len(stage.history["val_accuracy"]) == 3 and stage.history["val_accuracy"][-1] > 0.9
    scored = fitted.transform(test)
    assert {"prediction", "probability", "rawPrediction", "scaled", "p0"} <= set(scored.columns)
    rows = scored.select("scaled", "probability", "prediction", "label").collect()
    probabilities = np.array([row.probability.toArray() for row in rows])
    predicted = stage.keras_model.predict(np.array([row.scaled.toArray() for row in rows]), verbose=0)
    np.testing.assert_allclose(probabilities, predicted, rtol=1e-5, atol=1e-6)
    assert [row.prediction for row in rows] == probabilities.argmax(axis=1).tolist()
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    assert accuracy == pytest.approx(np.mean([row.prediction == row.label for row in rows]))
    assert accuracy >= 0.9, accuracy


@pytest.mark.slow  # a fresh process and Spark of their own: the slow command
def test_pipeline_model_saved_and_loaded_in_a_fresh_session_predicts_the_same(fitted, digits_frames, tmp_path):
    _, test = digits_frames
    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    assert os.path.exists(os.path.join(path, "stages"))
    keras_dirs = [d for d in os.listdir(os.path.join(path, "stages")) if "KerasModel" in d]
    assert keras_dirs and os.path.exists(os.path.join(path, "stages", keras_dirs[0], "model.keras"))
    test.write.parquet(str(tmp_path / "test.parquet"))
    expected = np.array([row.prediction for row in fitted.transform(test).orderBy("p0", *PIXELS[1:]).collect()])

    script = f"""
import os, sys
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
from pyspark.sql import SparkSession
from pyspark.ml import PipelineModel
spark = SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1").getOrCreate()
model = PipelineModel.load({path!r})
print("HISTORY", len(model.stages[-1].history["loss"]))
test = spark.read.parquet({str(tmp_path / "test.parquet")!r})
model.transform(test).select("prediction", *{PIXELS!r}).write.parquet({str(tmp_path / "predictions.parquet")!r})
"""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HISTORY 3" in done.stdout
    import pandas as pd

    reloaded = pd.read_parquet(tmp_path / "predictions.parquet").sort_values(PIXELS)
    np.testing.assert_array_equal(reloaded["prediction"].to_numpy(), expected)


def test_bare_keras_model_round_trip(spark, fitted, digits_frames, tmp_path):
    _, test = digits_frames
    stage = fitted.stages[-1]
    features = fitted.stages[1].transform(fitted.stages[0].transform(test))
    path = str(tmp_path / "keras-model")
    stage.write().save(path)
    loaded = KerasModel.load(path)
    assert loaded.uid == stage.uid and loaded.getFeaturesCol() == "scaled"
    assert loaded.history == stage.history
    want = np.array([r.probability.toArray() for r in stage.transform(features).collect()])
    got = np.array([r.probability.toArray() for r in loaded.transform(features).collect()])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(loaded.keras_model.get_weights(), stage.keras_model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_from_keras_takes_a_compiled_model_or_its_file(tmp_path):
    model = make_mlp(hidden=(8,))
    model.save(tmp_path / "model.keras")
    for source in (model, tmp_path / "model.keras", str(tmp_path / "model.keras")):
        stage = KerasModel.from_keras(source, featuresCol="pixels", probabilityCol="")
        assert (stage.getFeaturesCol(), stage.getProbabilityCol(), stage.history) == ("pixels", "", {})
        for a, b in zip(stage.keras_model.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match="missing.keras"):
        KerasModel.from_keras(tmp_path / "missing.keras")
    with pytest.raises(ValueError, match="compiled"):
        KerasModel.from_keras(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="Received: dict"):
        KerasModel.from_keras({})


def test_unfitted_estimator_saves_and_loads(spark, tmp_path):
    estimator = KerasEstimator(
        model=make_mlp(hidden=(8,)), featuresCol="scaled", mode="async", pushEvery=2, epochs=3, numServers=2
    )
    path = str(tmp_path / "estimator")
    estimator.save(path)
    loaded = KerasEstimator.load(path)
    assert (loaded.getMode(), loaded.getPushEvery(), loaded.getEpochs(), loaded.getNumServers()) == ("async", 2, 3, 2)
    assert loaded.getFeaturesCol() == "scaled"
    for a, b in zip(loaded.getModel().get_weights(), estimator.getModel().get_weights()):
        np.testing.assert_array_equal(a, b)


def test_params_follow_spark_ml_conventions():
    estimator = KerasEstimator(model=make_mlp(hidden=(8,)), epochs=3)
    explained = estimator.explainParams()
    for name in [
        "model",
        "featuresCol",
        "labelCol",
        "predictionCol",
        "probabilityCol",
        "numWorkers",
        "mode",
        "epochs",
        "batchSize",
        "shuffle",
        "seed",
        "pushEvery",
        "maxStaleness",
        "numServers",
        "syncEvery",
        "validationIndicatorCol",
        "validationSplit",
        "timeout",
        "backend",
        "customObjects",
        "learningRate",
        "optimizerOptions",
    ]:
        assert name in explained
    assert estimator.setBatchSize(8) is estimator and estimator.getBatchSize() == 8
    for name in [p.name for p in estimator.params] + ["validationCol"]:  # every Param's getX/setX pair
        suffix = name[0].upper() + name[1:]
        assert callable(getattr(estimator, f"get{suffix}")) and callable(getattr(estimator, f"set{suffix}")), name
    for param in KerasModel().params:
        suffix = param.name[0].upper() + param.name[1:]
        assert callable(getattr(KerasModel, f"get{suffix}")) and callable(getattr(KerasModel, f"set{suffix}"))
    assert estimator.getNumWorkers() == 2 and estimator.getMode() == "sync"
    copied = estimator.copy({estimator.epochs: 7})
    assert copied.getEpochs() == 7 and estimator.getEpochs() == 3
    with pytest.raises(TypeError, match="keras.Model"):
        estimator.setModel("not a model")


def test_cross_validator_over_two_settings_and_copies_share_no_trained_state(digits_frames):
    train, test = digits_frames
    small = train.limit(400).cache()
    base = make_mlp(hidden=(32,), optimizer=keras.optimizers.Adam(0.01))
    before = [w.copy() for w in base.get_weights()]
    estimator = KerasEstimator(model=base, featuresCol="scaled", numWorkers=1, epochs=1, batchSize=16, seed=0)
    grid = ParamGridBuilder().addGrid(estimator.epochs, [1, 6]).build()
    cv = CrossValidator(
        estimator=pipeline(estimator),
        estimatorParamMaps=grid,
        numFolds=2,
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
        parallelism=2,  # a fold's two copies train at once, one worker each on the two slots
        seed=0,
    )
    cv_model = cv.fit(small)
    assert len(cv_model.avgMetrics) == 2
    assert cv_model.avgMetrics[1] > cv_model.avgMetrics[0]  # 6 epochs beat 1
    best = cv_model.bestModel.stages[-1]
    assert len(best.history["loss"]) == 6
    for w, b in zip(base.get_weights(), before):
        np.testing.assert_array_equal(w, b)  # the estimator's model was never trained in place
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(cv_model.transform(test)) > 0.85


# Every Param reaches sparkdl.fit ------------------------------------------------------------------

# Each Param set to a value that differs from its default, and the fit argument it must become.
EVERY_PARAM = {
    "featuresCol": ({"x": ["a", "b"]}, "features_col", {"x": ["a", "b"]}),
    "labelCol": (("y",), "label_col", ["y"]),
    "numWorkers": (1, "num_workers", 1),
    "mode": ("ssp", "mode", "ssp"),
    "epochs": (4, "epochs", 4),
    "batchSize": (8, "batch_size", 8),
    "shuffle": (False, "shuffle", False),
    "validationIndicatorCol": ("held", "validation_col", "held"),
    "validationSplit": (0.25, "validation_split", 0.25),
    "timeout": (30.0, "timeout", 30.0),
    "checkpointDir": ("/tmp/ck", "checkpoint_dir", "/tmp/ck"),
    "tensorboardDir": ("/tmp/tb", "tensorboard_dir", "/tmp/tb"),
    "logToMlflow": (True, "log_to_mlflow", True),
    "progress": (False, "progress", False),
    "seed": (7, "seed", 7),
    "customObjects": ({"Scale": Scale}, "custom_objects", {"Scale": Scale}),
    "weightCol": ("w", "sample_weight_col", "w"),
}
# The modes' options: a Param each, made from the declaration; a value other than the default passes through.
EVERY_PARAM.update(
    {
        entry.option.camel_name: (value, name, value)
        for name, entry in declared_options().items()
        for value in [
            not entry.option.default
            if entry.option.kind is bool
            else entry.option.choices[-1]
            if entry.option.choices
            else "a,b"
            if entry.option.kind is str
            else ["a", "b"]
            if entry.option.kind is list
            else entry.option.minimum + 2
        ]
    }
)
OUTPUT_PARAMS = {"model", "predictionCol", "probabilityCol", "rawPredictionCol"}  # not fit settings
OPTIMIZER_PARAMS = {"learningRate", "optimizerOptions"}  # applied to a copy of the model (tests/test_tuning.py)


def test_every_param_maps_to_its_fit_argument():
    estimator = KerasEstimator(**{name: value for name, (value, _, _) in EVERY_PARAM.items()})
    # A new Param needs a row here.
    assert {p.name for p in estimator.params} - OUTPUT_PARAMS - OPTIMIZER_PARAMS == set(EVERY_PARAM)
    assert estimator.fit_arguments() == {argument: expected for _, argument, expected in EVERY_PARAM.values()}
    # The same through the setters, one at a time.
    for name, (value, argument, expected) in EVERY_PARAM.items():
        one = KerasEstimator()
        getattr(one, f"set{name[0].upper()}{name[1:]}")(value)
        assert one.fit_arguments()[argument] == expected, name
    default = KerasEstimator().fit_arguments()
    assert "custom_objects" not in default and "validation_col" not in default
    assert not set(default) & set(declared_options())  # a mode option left out is its default: not passed


def test_validation_col_is_a_deprecated_alias_of_validation_indicator_col(spark, tmp_path):
    with pytest.warns(DeprecationWarning, match="validationIndicatorCol"):
        estimator = KerasEstimator(model=make_mlp(hidden=(8,)), validationCol="held")
    assert estimator.getValidationIndicatorCol() == "held"
    with pytest.warns(DeprecationWarning):
        estimator.setParams(validationCol="other")
    with pytest.warns(DeprecationWarning):
        assert estimator.setValidationCol("third").getValidationCol() == "third"
    assert estimator.fit_arguments()["validation_col"] == "third"
    with pytest.raises(ValueError, match="Received both"):
        KerasEstimator(validationCol="a", validationIndicatorCol="b")

    # A stage saved before the rename: its metadata names validationCol.
    path = tmp_path / "old-estimator"
    estimator.save(str(path))
    (metadata_file,) = [f for f in (path / "metadata").iterdir() if f.name.startswith("part-")]
    metadata = json.loads(metadata_file.read_text())
    metadata["paramMap"]["validationCol"] = metadata["paramMap"].pop("validationIndicatorCol")
    metadata_file.write_text(json.dumps(metadata))
    for crc in (path / "metadata").glob(".*.crc"):
        crc.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading an old stage is not the user's deprecated call
        assert KerasEstimator.load(str(path)).getValidationIndicatorCol() == "third"


@pytest.fixture(scope="module")
def custom_fit(spark, tmp_path_factory):
    """One real fit of a model with an unregistered custom layer, with every observable setting switched on."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4))
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0).astype(int)
    rows = [(row.tolist(), int(label), i % 4 == 0) for i, (row, label) in enumerate(zip(x, y))]
    df = spark.createDataFrame(rows, "f array<double>, y int, held boolean").repartition(2).cache()
    out = tmp_path_factory.mktemp("custom-fit")
    (out / "log").mkdir()
    estimator = KerasEstimator(
        model=make_scaled_classifier(log_dir=str(out / "log")),
        featuresCol="f",
        labelCol="y",
        numWorkers=1,
        epochs=3,
        batchSize=8,
        seed=0,
        validationIndicatorCol="held",
        progress=False,
        checkpointDir=str(out / "checkpoints"),
        tensorboardDir=str(out / "tb"),
        customObjects={"Scale": Scale, "LoadLog": LoadLog},
    )
    model = estimator.fit(df)
    (out / "log" / "calls").rename(out / "log" / "training-calls")  # before anything else runs the model
    return df, model, out


def test_a_real_fit_applies_the_params(custom_fit):
    df, model, out = custom_fit
    assert len(model.history["loss"]) == 3  # epochs
    assert len(model.history["val_loss"]) == 3 and len(model.history["val_accuracy"]) == 3  # validationIndicatorCol
    assert any(name.startswith("epoch-000003.") for name in os.listdir(out / "checkpoints"))  # checkpointDir
    assert any("tfevents" in name for _, _, files in os.walk(out / "tb") for name in files)  # tensorboardDir
    partitions = set(logged(out / "log" / "training-calls", field=1)) - {-1}  # -1: the driver, outside a task
    assert partitions == {0}  # numWorkers: one task trained (two, the default, would log 0 and 1)
    assert model.getCustomObjects() == {"Scale": Scale, "LoadLog": LoadLog} and model.getFeaturesCol() == "f"


def test_custom_objects_train_score_save_and_load(custom_fit, tmp_path):
    df, model, _ = custom_fit
    assert isinstance(model.keras_model.layers[1], Scale)
    scored = np.array([r.probability.toArray() for r in model.transform(df).orderBy("f").collect()])
    assert scored.shape == (96, 3)
    path = str(tmp_path / "model")
    model.save(path)
    loaded = KerasModel.load(path)
    assert loaded.getCustomObjects() == {"Scale": Scale, "LoadLog": LoadLog}
    again = np.array([r.probability.toArray() for r in loaded.transform(df).orderBy("f").collect()])
    np.testing.assert_allclose(again, scored, rtol=1e-6)

    estimator = KerasEstimator(model=make_scaled_classifier(), customObjects={"Scale": "custom_layer.Scale"})
    estimator.save(str(tmp_path / "estimator"))
    reloaded = KerasEstimator.load(str(tmp_path / "estimator"))
    assert isinstance(reloaded.getModel().layers[0], Scale) and reloaded.getCustomObjects() == {"Scale": Scale}


def test_custom_objects_errors_name_the_missing_class(spark, tmp_path):
    df = spark.createDataFrame([([0.0] * 4,)], "f array<double>")
    # not supplied, but this process defines it (tests/custom_layer.py): found and sent along, no customObjects needed
    (row,) = KerasModel.from_keras(make_scaled_classifier(), featuresCol="f").transform(df).collect()
    assert len(row.probability) == 3

    with pytest.raises(ValueError, match=r"customObjects\['Scale'\] = 'no_such_module.Scale'"):
        KerasModel(customObjects={"Scale": "no_such_module.Scale"})

    class Local(Scale):
        pass

    with pytest.raises(ValueError, match=r"Cannot save customObjects\['Local'\]"):
        KerasModel.from_keras(make_scaled_classifier(), customObjects={"Local": Local}).save(str(tmp_path / "m"))


# Columns as a list, outputs as a struct ---------------------------------------------------------------------------

# Number columns on very different scales, listed in neither the DataFrame's nor alphabetical order (b, which
# decides the label, moves in both): a stage that stacked them in another order would feed the model other values.
SCALES = {"a": 100.0, "b": 1.0, "c": 0.01}
LISTED = ["b", "c", "a"]


@pytest.fixture(scope="module")
def three_columns(spark):
    """256 rows of a, b, c (each N(0, 1) times its scale) whose label is b > 0, and the features in LISTED order."""
    rng = np.random.default_rng(0)
    values = {name: rng.normal(size=256) * scale for name, scale in SCALES.items()}
    label = (values["b"] > 0).astype(int)
    rows = [(i, *(float(values[name][i]) for name in SCALES), int(label[i])) for i in range(256)]
    df = spark.createDataFrame(rows, "id long, a double, b double, c double, label int").repartition(2).cache()
    return df, np.stack([values[name] for name in LISTED], axis=1).astype(np.float32), label


def _probabilities(stage, df):
    return np.array([r.probability.toArray() for r in stage.transform(df).orderBy("id").collect()])


def test_a_list_of_number_columns_trains_and_scores_in_the_lists_order(three_columns, tmp_path):
    """KerasEstimator(featuresCol=[...]) trains on the columns stacked in the list's order: the model it returns
    separates the label from b's place in that order, and its KerasModel, one made with KerasModel.from_keras,
    and both saved and loaded, score as in-process predict on the columns stacked in that order."""
    df, x, label = three_columns
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy", metrics=["accuracy"])
    estimator = KerasEstimator(
        model=model, featuresCol=LISTED, labelCol="label", numWorkers=2, epochs=12, batchSize=16, seed=0
    )
    fitted = estimator.fit(df)
    assert fitted.getFeaturesCol() == LISTED
    expected = fitted.keras_model.predict(x, verbose=0)[:, 0]
    # Trained on b at its place in the list: any other order would have taught it the label from another column.
    assert np.mean((expected > 0.5) == label) > 0.9, np.mean((expected > 0.5) == label)
    assert np.mean((fitted.keras_model.predict(x[:, ::-1], verbose=0)[:, 0] > 0.5) == label) < 0.75

    scorer = KerasModel.from_keras(fitted.keras_model, featuresCol=LISTED)
    fitted.save(str(tmp_path / "fitted"))
    scorer.save(str(tmp_path / "scorer"))
    stages = [fitted, scorer, KerasModel.load(str(tmp_path / "fitted")), KerasModel.load(str(tmp_path / "scorer"))]
    for stage in stages:
        assert stage.getFeaturesCol() == LISTED
        np.testing.assert_allclose(_probabilities(stage, df), np.stack([1 - expected, expected], axis=1), atol=1e-6)


def test_a_model_with_two_named_outputs_scores_a_struct_with_a_field_per_output(three_columns):
    """KerasModel.transform of a model with an output of one value and one of several: one struct column with a
    field per output, by name (a double, an array<double>), each equal to in-process predict's output; no
    probability columns, as the model is no classifier."""
    df, x, _ = three_columns
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,), name="columns")
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = {
        "total": keras.layers.Dense(1, name="total")(hidden),
        "parts": keras.layers.Dense(4, activation="softmax", name="parts")(hidden),
    }
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss={"total": "mse", "parts": "categorical_crossentropy"})
    expected = model.predict(x, verbose=0)

    scored = KerasModel.from_keras(model, featuresCol=LISTED, predictionCol="out").transform(df)
    assert scored.columns == df.columns + ["out"]
    assert model.output_names == ["parts", "total"]  # Keras orders a dict's outputs by name
    assert dict(scored.dtypes)["out"] == "struct<parts:array<double>,total:double>"
    rows = scored.select("id", "out.total", "out.parts").orderBy("id").collect()
    np.testing.assert_allclose([r.total for r in rows], expected["total"][:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r.parts for r in rows], expected["parts"], rtol=1e-5, atol=1e-6)
