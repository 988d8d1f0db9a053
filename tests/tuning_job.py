"""TrainValidationSplit(parallelism=2) over two one-worker candidates, run by tests/test_tuning.py with spark-submit.

Usage: tuning_job.py DIRECTORY. The candidates' model holds a ``WaitForPeers`` layer: each candidate's task
waits for the other's in DIRECTORY/peers, so the fit succeeds only if both train at once. Writes
DIRECTORY/result.json (the validation metrics and each candidate's learning rate).
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
from frames import digits_frame
from models import WaitForPeers
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

from sparkdl.ml import KerasEstimator

directory = sys.argv[1]
peers = os.path.join(directory, "peers")
os.makedirs(peers)
spark = SparkSession.builder.getOrCreate()
x, y = load_digits(return_X_y=True)
df = digits_frame(spark, (x[:600] / 16.0).astype(np.float32), y[:600]).repartition(2).cache()

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
grid = ParamGridBuilder().addGrid(estimator.learningRate, [0.01, 0.002]).build()
tuning = TrainValidationSplit(
    estimator=estimator,
    estimatorParamMaps=grid,
    evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
    parallelism=2,
    collectSubModels=True,
    seed=0,
)
fitted = tuning.fit(df)
with open(os.path.join(directory, "result.json"), "w") as f:
    json.dump(
        {
            "metrics": list(fitted.validationMetrics),
            "learning_rates": [float(sub.keras_model.optimizer.learning_rate) for sub in fitted.subModels],
        },
        f,
    )
spark.stop()
