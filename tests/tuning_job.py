"""Tuners with parallelism=2 over two one-worker candidates, run by tests/test_tuning.py with spark-submit.

Usage: tuning_job.py DIRECTORY TUNER..., each TUNER TrainValidationSplit or CrossValidator (two folds), run one
after the other in one application. The candidates' model holds a ``WaitForPeers`` layer: each candidate's task
waits for the other's in DIRECTORY/TUNER/peers, so a tuner's first two fits succeed only if they train at once
(later fits find the peers there and go on). Writes DIRECTORY/TUNER/result.json: the validation or average
metrics, each candidate's learning rate, and when the tuner started and ended (milliseconds since the epoch, as
Spark's event log times its stages).
"""

import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
from frames import digits_frame
from models import WaitForPeers
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder, TrainValidationSplit
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

from sparkdl.ml import KerasEstimator

directory, tuners = sys.argv[1], sys.argv[2:]
for tuner in tuners:
    if tuner not in ("TrainValidationSplit", "CrossValidator"):
        raise SystemExit(f"Expected each TUNER to be TrainValidationSplit or CrossValidator. Received: {tuner!r}")
spark = SparkSession.builder.getOrCreate()
x, y = load_digits(return_X_y=True)
df = digits_frame(spark, (x[:600] / 16.0).astype(np.float32), y[:600]).repartition(2).cache()


def tune(tuner: str) -> dict:
    peers = os.path.join(directory, tuner, "peers")
    os.makedirs(peers)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            WaitForPeers(peers, peers=2),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    estimator = KerasEstimator(
        model=model,
        numWorkers=1,
        epochs=2,
        batchSize=32,
        seed=0,
        progress=False,
        customObjects={"WaitForPeers": WaitForPeers},  # the workers import it from tests/models.py
    )
    common = dict(
        estimator=estimator,
        estimatorParamMaps=ParamGridBuilder().addGrid(estimator.learningRate, [0.01, 0.002]).build(),
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
        parallelism=2,
        collectSubModels=True,
        seed=0,
    )
    if tuner == "CrossValidator":
        fitted = CrossValidator(numFolds=2, **common).fit(df)
        metrics, candidates = fitted.avgMetrics, fitted.subModels[0]  # the first fold's candidates
    else:  # TrainValidationSplit
        fitted = TrainValidationSplit(**common).fit(df)
        metrics, candidates = fitted.validationMetrics, fitted.subModels
    return {
        "metrics": list(metrics),
        "learning_rates": [float(sub.keras_model.optimizer.learning_rate) for sub in candidates],
    }


for tuner in tuners:
    started = time.time() * 1000
    result = tune(tuner)
    with open(os.path.join(directory, tuner, "result.json"), "w") as f:
        json.dump({**result, "started_ms": started, "ended_ms": time.time() * 1000}, f)
spark.stop()
