"""Trains one worker on a partition of ``rows`` x 100 float32 values; its Python runs through ``python_wrapper``.

    python tests/memory_job.py ROWS PYTHON_WRAPPER [VALIDATION_SPLIT]

Used by tests/test_partition_memory.py, which puts the wrapper's processes (the PySpark daemon and the
worker it forks) in a memory cgroup smaller than the partition. Prints one JSON line: the rows, the steps
of an epoch, the held-out rows and the metrics of the history.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import sparkdl

rows, wrapper = int(sys.argv[1]), sys.argv[2]
validation_split = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.ui.enabled", "false")
    .config("spark.pyspark.python", wrapper)
    .config("spark.driver.memory", "3g")
    .getOrCreate()
)
# One random value a row, repeated: as many bytes as 100 of them (nothing on the way compresses the rows), made in a
# quarter of the time on the job's one core (the rows are made twice: for the checks job and for the training read).
features = F.array_repeat(F.rand(0).cast("float"), 100)
df = spark.range(0, rows, numPartitions=4).select(
    features.alias("features"), (F.rand(1000) * 10).cast("int").alias("label")
)
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((100,)), keras.layers.Dense(10, activation="softmax")])
model.compile("sgd", "sparse_categorical_crossentropy")
result = sparkdl.fit(
    df, model, num_workers=1, epochs=1, batch_size=4096, seed=0, progress=False, validation_split=validation_split
)
print(
    json.dumps(
        {
            "rows": rows,
            "steps": result.steps_per_epoch,
            "validation_rows": result.validation_rows,
            "metrics": sorted(result.history),
            "sparkdl": os.path.dirname(sparkdl.__file__),
        }
    )
)
spark.stop()
