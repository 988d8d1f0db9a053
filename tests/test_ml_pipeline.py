"""KerasEstimator / KerasModel as Spark ML stages: Pipeline, persistence, tuning, evaluators."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

from sparkdl.ml import KerasEstimator, KerasModel
from models import make_mlp

PIXELS = [f"p{i}" for i in range(64)]


@pytest.fixture(scope="module")
def digits_frames(spark, digits):
    x_train, x_test, y_train, y_test = digits

    def frame(x, y):
        return spark.createDataFrame([tuple(float(v) for v in row) + (int(label),) for row, label in zip(x, y)],
                                     PIXELS + ["label"])

    return frame(x_train, y_train).cache(), frame(x_test, y_test).cache()


def pipeline(estimator):
    return Pipeline(stages=[VectorAssembler(inputCols=PIXELS, outputCol="raw"),
                            StandardScaler(inputCol="raw", outputCol="scaled"), estimator])


@pytest.fixture(scope="module")
def fitted(digits_frames):
    train, _ = digits_frames
    estimator = KerasEstimator(model=make_mlp(), featuresCol="scaled", labelCol="label", numWorkers=2, mode="sync",
                               epochs=12, batchSize=16, seed=0, validationSplit=0.1)
    return pipeline(estimator).fit(train)


def test_pipeline_fits_scores_and_evaluates(fitted, digits_frames, digits):
    _, test = digits_frames
    stage = fitted.stages[-1]
    assert isinstance(stage, KerasModel)
    assert len(stage.history["loss"]) == 12
    assert len(stage.history["val_accuracy"]) == 12 and stage.history["val_accuracy"][-1] > 0.9
    scored = fitted.transform(test)
    assert {"prediction", "probability", "rawPrediction", "scaled", "p0"} <= set(scored.columns)
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    assert accuracy >= 0.95, accuracy


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
    assert "HISTORY 12" in done.stdout
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
    estimator = KerasEstimator(model=make_mlp(hidden=(8,)), featuresCol="scaled", mode="async", pushEvery=2,
                               epochs=3, numServers=2)
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
    for name in ["model", "featuresCol", "labelCol", "predictionCol", "probabilityCol", "numWorkers", "mode",
                 "epochs", "batchSize", "shuffle", "seed", "pushEvery", "maxStaleness", "numServers", "syncEvery",
                 "validationCol", "validationSplit", "timeout"]:
        assert name in explained
    assert estimator.setBatchSize(8) is estimator and estimator.getBatchSize() == 8
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
    estimator = KerasEstimator(model=base, featuresCol="scaled", numWorkers=2, epochs=1, batchSize=16, seed=0)
    grid = ParamGridBuilder().addGrid(estimator.epochs, [1, 6]).build()
    cv = CrossValidator(estimator=pipeline(estimator), estimatorParamMaps=grid, numFolds=2,
                        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"), seed=0)
    cv_model = cv.fit(small)
    assert len(cv_model.avgMetrics) == 2
    assert cv_model.avgMetrics[1] > cv_model.avgMetrics[0]  # 6 epochs beat 1
    best = cv_model.bestModel.stages[-1]
    assert len(best.history["loss"]) == 6
    for w, b in zip(base.get_weights(), before):
        np.testing.assert_array_equal(w, b)  # the estimator's model was never trained in place
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(cv_model.transform(test)) > 0.85
