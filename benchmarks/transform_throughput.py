"""Batch inference throughput: ``KerasModel.transform`` against Spark's own Arrow round trip and in-process predict.

    python benchmarks/transform_throughput.py [--rows 1000000] [--repeats 5] [--master local[2]]

Data: ``rows`` x 64 float32 features drawn with numpy, written once as Parquet (one
``array<float>`` column ``features`` plus an ``id``, 8 files) to a temporary directory, so that the
Spark timings cover reading the Parquet files, moving the features to Python as Arrow, running the
model and returning the predictions -- not Python-to-JVM transfer of the data. The model is the
digits-sized MLP (64-128-64-10, softmax), untrained (weights do not change the cost); the regressor the same MLP
with one linear output.

Runs, side by side in one session, each forcing every row and every column through Spark's
``noop`` sink (``.write.format("noop")``):

* ``no-op UDF``: a scalar-iterator ``arrow_udf`` (the kind ``transform`` uses) over the same
  column, wrapped as ``transform`` wraps it (``struct(features)``), returning zeros as a double:
  Spark's Arrow round trip to Python and back, with no model. The reference: 1.00.
* ``no-op UDF, classifier columns``: the same, returning what ``transform`` returns for a
  classifier (a class index and 10 probabilities, zeros) and unpacking it into the same three
  columns (``prediction``, ``probability`` and ``rawPrediction`` Vectors): Spark's cost of the output.
* ``KerasModel.transform, prediction``: ``KerasModel.from_keras(regressor).transform(df)``, the same MLP ending in
  one linear unit: a prediction column alone, against the no-op UDF;
* ``KerasModel.transform, classifier``: ``KerasModel.from_keras(model).transform(df)``: its three columns, against
  the no-op UDF of the classifier columns.
* ``in-process predict``: ``model.predict(x, batch_size)`` on the same numpy array, no Spark.

The Spark runs are repeated under both settings of ``spark.sql.execution.arrow.pythonUDF.
columnarInput.enabled`` where the Spark has it (4.3): ``true``, the default, feeds an Arrow UDF
over a columnar source (Parquet) from the source's column batches and turns its output rows back
into column vectors; ``false`` feeds it rows, in Arrow batches of ``maxRecordsPerBatch``.

One warm-up pass each (Python worker start, model load, tracing, JIT), then ``--repeats`` rounds,
each running every variant once, in an order rotated every round. Each line reports the median
rows/s and its spread (lowest to highest round), the ratio to its reference, the no-op UDF of the same
output columns and setting (the median of the ratios within each round, with their spread), and the CPU seconds all the
processes spent per million rows (Spark: the JVM and its Python workers; in-process: this one),
which a busy machine disturbs less than the wall-clock time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WIDTH = 64
CLASSES = 10
NOOP = "no-op UDF"
COLUMNAR_INPUT = "spark.sql.execution.arrow.pythonUDF.columnarInput.enabled"


def make_model(classes: int = CLASSES):
    """The MLP: a classifier of ``classes`` classes (softmax), or with ``classes=0`` a regressor (one linear unit)."""
    import keras

    keras.utils.set_random_seed(0)
    head = keras.layers.Dense(classes, activation="softmax") if classes else keras.layers.Dense(1)
    model = keras.Sequential(
        [
            keras.Input((WIDTH,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            head,
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy" if classes else "mse")
    return model


def write_parquet(x: np.ndarray, directory: str, files: int = 8) -> None:
    for i, part in enumerate(np.array_split(np.arange(len(x)), files)):
        rows = x[part]
        offsets = pa.array(np.arange(0, rows.size + 1, WIDTH, dtype=np.int32))
        features = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))
        table = pa.table({"id": pa.array(part.astype(np.int64)), "features": features})
        pq.write_table(table, os.path.join(directory, f"part-{i:03d}.parquet"), row_group_size=64 * 1024)


def zeros(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
    for column in batches:
        yield pa.array(np.zeros(len(column)))


def zero_classes(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
    for column in batches:
        rows = len(column)
        offsets = pa.array(np.arange(0, rows * CLASSES + 1, CLASSES, dtype=np.int32))
        probability = pa.ListArray.from_arrays(offsets, pa.array(np.zeros(rows * CLASSES)))
        yield pa.StructArray.from_arrays([pa.array(np.zeros(rows)), probability], names=["prediction", "probability"])


def spark_frames(df, model, regressor) -> dict[str, tuple[Callable[[], object], str]]:
    """Each Spark run as a function making the DataFrame to write to the noop sink, and the run it is compared to."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F
    from pyspark.sql.functions import arrow_udf

    from sparkdl.ml import KerasModel

    shipped = F.struct(F.col("features").alias("i0"))  # what transform hands its UDF
    noop = arrow_udf(zeros, "double")  # type: ignore[call-overload]
    classes = arrow_udf(zero_classes, "struct<prediction: double, probability: array<double>>")  # type: ignore[call-overload]
    scorer, predictor = KerasModel.from_keras(model), KerasModel.from_keras(regressor)

    def classifier_columns():
        scored = df.withColumn("_scored", classes(shipped))
        columns = {
            "prediction": F.col("_scored.prediction"),
            "probability": array_to_vector(F.col("_scored.probability")),
        }
        return scored.withColumns(columns).drop("_scored").withColumn("rawPrediction", F.col("probability"))

    classifier = f"{NOOP}, classifier columns"
    return {
        NOOP: (lambda: df.withColumn("zeros", noop(shipped)), NOOP),
        classifier: (classifier_columns, classifier),
        "KerasModel.transform, prediction": (lambda: predictor.transform(df), NOOP),
        "KerasModel.transform, classifier": (lambda: scorer.transform(df), classifier),
    }


def cpu_seconds(root: int) -> float:
    """User and system CPU seconds of process ``root`` and every live process below it (Linux's /proc)."""
    tick, parents, times = os.sysconf("SC_CLK_TCK"), {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        parents[int(entry)], times[int(entry)] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    tree, grown = {root}, True
    while grown:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree, grown = tree | below, bool(below)
    return sum(times.get(pid, 0.0) for pid in tree)


def _has_setting(spark, key: str) -> bool:
    try:
        spark.conf.get(key)  # a setting this Spark does not know raises; one left at its default gives the default
    except Exception:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=4096, help="in-process model.predict's batch_size")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--arrow-batch",
        type=int,
        default=10_000,
        help="spark.sql.execution.arrow.maxRecordsPerBatch (Spark's default: 10000)",
    )
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    x = np.random.default_rng(0).random((args.rows, WIDTH), dtype=np.float32)
    model, regressor = make_model(), make_model(classes=0)

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
    jvm = int(spark.sparkContext._jvm.ProcessHandle.current().pid())  # type: ignore[union-attr]
    settings: list[str | None] = ["true", "false"] if _has_setting(spark, COLUMNAR_INPUT) else [None]
    with tempfile.TemporaryDirectory(prefix="sparkdl-bench-") as tmp:
        write_parquet(x, tmp)
        df = spark.read.parquet(tmp)
        partitions = df.rdd.getNumPartitions()

        def on_spark(setting: str | None, make_frame: Callable[[], object]) -> Callable[[], tuple[float, float]]:
            def run() -> tuple[float, float]:
                if setting is not None:
                    spark.conf.set(COLUMNAR_INPUT, setting)
                cpu, start = cpu_seconds(jvm), time.perf_counter()
                make_frame().write.format("noop").mode("overwrite").save()  # type: ignore[attr-defined]
                return time.perf_counter() - start, cpu_seconds(jvm) - cpu

            return run

        def in_process() -> tuple[float, float]:
            cpu, start = time.process_time(), time.perf_counter()
            model.predict(x, batch_size=args.batch_size, verbose=0)
            return time.perf_counter() - start, time.process_time() - cpu

        runs: dict[tuple[str | None, str], Callable[[], tuple[float, float]]] = {}
        references = {"in-process predict": NOOP}
        for setting in settings:
            for name, (frame, reference_run) in spark_frames(df, model, regressor).items():
                runs[(setting, name)] = on_spark(setting, frame)
                references[name] = reference_run
        runs[(None, "in-process predict")] = in_process
        warm = {key: run()[0] for key, run in runs.items()}
        measured: dict[tuple[str | None, str], list[tuple[float, float]]] = {key: [] for key in runs}
        keys = list(runs)
        for round_ in range(args.repeats):
            for key in keys[round_ % len(keys) :] + keys[: round_ % len(keys)]:
                measured[key].append(runs[key]())
    spark.stop()

    print(
        f"rows: {args.rows:,} x {WIDTH} float32 from Parquet ({partitions} partitions), model 64-128-64-10 softmax, "
        f"{args.master} on {os.cpu_count()} cores, arrow maxRecordsPerBatch {args.arrow_batch}, "
        f"in-process batch_size {args.batch_size}, {args.repeats} rounds"
    )
    print("warm-up passes (s): " + ", ".join(f"{name} [{setting}] {s:.1f}" for (setting, name), s in warm.items()))
    print(f"columnar input: {COLUMNAR_INPUT}")
    header = f"{'columnar input':>14} {'run':33} {'rows/s':>10} {'spread (rows/s)':>21} {'x ref.':>7} {'spread':>11}"
    print(f"{header} {'CPU s / 1M rows':>15}")
    reference = settings[0]
    for (setting, name), times in measured.items():
        noop = measured[(setting if setting in settings else reference, references[name])]
        rates = [args.rows / wall for wall, _ in times]
        ratios = [base / wall for (wall, _), (base, _) in zip(times, noop)]  # within each round
        cpu = statistics.median(spent for _, spent in times) * 1e6 / args.rows
        print(
            f"{setting or '-':>14} {name:33} {statistics.median(rates):10,.0f} {min(rates):10,.0f}-{max(rates):<10,.0f} "
            f"{statistics.median(ratios):7.2f} {min(ratios):5.2f}-{max(ratios):<5.2f} {cpu:15.2f}"
        )


if __name__ == "__main__":
    main()
