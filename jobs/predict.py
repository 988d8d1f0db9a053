"""Score a Parquet dataset with a saved Keras model and write the predictions as Parquet, under spark-submit or python.

    spark-submit --properties-file conf/spark-local.conf jobs/predict.py --config conf/jobs/predict.toml
    python jobs/predict.py --model output/model.keras --data rows.parquet --output scored.parquet --features-col a,b,c

Writes every input row with ``prediction`` added (for a classifier the class index, and its class
probabilities as ``probability``, an ``array<double>``). Spark does the work: sparkdl's KerasModel
runs the model on Arrow batches in the executors, and nothing is collected to the driver. The
model is a ``.keras`` file on the driver's file system (what jobs/train.py saves); Spark ships it to
the executors.
"""

from __future__ import annotations

import argparse
import sys

import _config
from _spark import spark_session  # first: it sets the environment before pyspark or keras is imported


def parse_args(argv=None) -> argparse.Namespace:
    parser = _config.job_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="output/model.keras", help="the .keras file to score with")
    parser.add_argument("--data", help="Parquet dataset to score (required, here or in --config)")
    parser.add_argument("--output", default="output/predictions.parquet", help="where to write the scored rows")
    parser.add_argument("--features-col", default="features",
                        help="vector/array column, or comma-separated numeric columns (default: features)")
    parser.add_argument("--prediction-col", default="prediction")
    parser.add_argument("--probability-col", default="probability",
                        help="class probabilities of a classifier; empty to leave them out")
    parser.add_argument("--mode", choices=("error", "overwrite"), default="error",
                        help="when --output exists: fail (error) or replace it (overwrite)")
    parser.add_argument("--master", help="Spark master when run with plain python (spark-submit sets its own)")
    args = _config.parse_args(parser, argv)
    if args.data is None:
        parser.error("Expected --data (or `data` in the --config file): the Parquet dataset to score.")
    return args


def score(df, scorer, features_col: str):
    """``df`` plus the scorer's output columns; a comma-separated list of columns is scored as one array."""
    from pyspark.ml.functions import vector_to_array

    from sparkdl.data import features_array

    assembled = None
    if "," in features_col:
        # KerasModel reads one column: assemble the list into one, checked and named as sparkdl.fit does.
        assembled = _unused_column_name(df, "features")
        df = df.withColumn(assembled, features_array(df, features_col.split(","))[0])
    scored = scorer.transform(df, {scorer.featuresCol: assembled or features_col})
    probability_col = scorer.getProbabilityCol()
    if probability_col in scored.columns:  # a classifier's
        # A plain array instead of Spark ML's Vector, which Parquet stores as a struct only Spark understands.
        scored = scored.withColumn(probability_col, vector_to_array(probability_col, "float64"))
    return scored.drop(assembled) if assembled else scored


def _unused_column_name(df, base: str) -> str:
    name = f"_{base}"
    while name in df.columns:
        name = f"_{name}"
    return name


def main(argv=None) -> int:
    args = parse_args(argv)
    from sparkdl.ml import KerasModel

    # Before the session starts: a missing model file fails at once.
    scorer = KerasModel.from_keras(args.model, predictionCol=args.prediction_col,
                                   probabilityCol=args.probability_col, rawPredictionCol="")
    spark = spark_session("sparkdl-predict", args.master)
    score(spark.read.parquet(args.data), scorer, args.features_col).write.mode(args.mode).parquet(args.output)
    rows = spark.read.parquet(args.output).count()  # from the Parquet footers: no second pass over the data
    print(f"scored {rows} rows of {args.data} with {args.model}")
    print(f"wrote predictions to {args.output}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
