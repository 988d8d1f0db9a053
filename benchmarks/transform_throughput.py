"""Batch inference throughput: ``sparkdl.ml.inference.predict`` on Spark vs in-process ``model.predict``.

    python benchmarks/transform_throughput.py [--rows 1000000] [--batch-size 4096] [--master local[2]]

Data: ``rows`` x 64 float32 features drawn with numpy, written once as Parquet (one
``array<float>`` column ``features`` plus an ``id``, 8 files) to a temporary directory, so that the
Spark timing covers reading the Parquet files, moving the features to Python as Arrow, running the
model and returning the predictions -- not Python-to-JVM transfer of the data. The model is the
digits-sized MLP (64-128-64-10, softmax), untrained (weights do not change the cost).

Spark side: ``predict(...)`` followed by ``.write.format("noop")``, which forces every row (and
all three output columns) through without writing anything. In-process side: ``model.predict(x,
batch_size)`` on the same numpy array. One warm-up pass each (Python worker start, model load,
TensorFlow tracing), then ``--repeats`` timed passes, interleaved; the median is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WIDTH = 64


def make_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((WIDTH,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def write_parquet(x: np.ndarray, directory: str, files: int = 8) -> None:
    for i, part in enumerate(np.array_split(np.arange(len(x)), files)):
        rows = x[part]
        offsets = pa.array(np.arange(0, rows.size + 1, WIDTH, dtype=np.int32))
        features = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))
        table = pa.table({"id": pa.array(part.astype(np.int64)), "features": features})
        pq.write_table(table, os.path.join(directory, f"part-{i:03d}.parquet"), row_group_size=64 * 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--arrow-batch",
        type=int,
        default=10_000,
        help="spark.sql.execution.arrow.maxRecordsPerBatch (Spark's default: 10000)",
    )
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    from sparkdl.keras.serialization import model_to_bytes
    from sparkdl.ml.inference import predict

    x = np.random.default_rng(0).random((args.rows, WIDTH), dtype=np.float32)
    model = make_model()
    model_bytes = model_to_bytes(model)

    spark = (
        SparkSession.builder.master(args.master)
        .appName("sparkdl-transform-throughput")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(args.arrow_batch))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    with tempfile.TemporaryDirectory(prefix="sparkdl-bench-") as tmp:
        write_parquet(x, tmp)
        df = spark.read.parquet(tmp)
        partitions = df.rdd.getNumPartitions()

        def run_spark() -> float:
            start = time.perf_counter()
            out = predict(
                df, model_bytes, features_col="features", prediction_col="prediction", batch_size=args.batch_size
            )
            out.write.format("noop").mode("overwrite").save()
            return time.perf_counter() - start

        def run_local() -> float:
            start = time.perf_counter()
            model.predict(x, batch_size=args.batch_size, verbose=0)
            return time.perf_counter() - start

        warm_spark, warm_local = run_spark(), run_local()
        spark_times, local_times = [], []
        for _ in range(args.repeats):
            spark_times.append(run_spark())
            local_times.append(run_local())
    spark.stop()

    spark_s, local_s = statistics.median(spark_times), statistics.median(local_times)
    spark_rate, local_rate = args.rows / spark_s, args.rows / local_s
    print(
        f"rows: {args.rows:,} x {WIDTH} float32 from Parquet ({partitions} partitions), model 64-128-64-10 softmax, "
        f"batch_size {args.batch_size}, {args.master}, arrow maxRecordsPerBatch {args.arrow_batch}"
    )
    print(f"warm-up passes: spark {warm_spark:.2f} s, in-process {warm_local:.2f} s")
    print(
        f"spark predict + noop write : {spark_s:6.2f} s  {spark_rate:12,.0f} rows/s   "
        f"(runs: {', '.join(f'{t:.2f}' for t in spark_times)})"
    )
    print(
        f"in-process model.predict   : {local_s:6.2f} s  {local_rate:12,.0f} rows/s   "
        f"(runs: {', '.join(f'{t:.2f}' for t in local_times)})"
    )
    print(f"spark / in-process throughput: {spark_rate / local_rate:.0%} (goal: >= 50%)")


if __name__ == "__main__":
    main()
