"""Score a Parquet dataset with a saved Keras model and write the predictions as Parquet, under spark-submit or python.

    spark-submit --properties-file conf/spark-local.conf jobs/predict.py --config conf/jobs/predict.toml
    python jobs/predict.py --model output/model.keras --data rows.parquet --output scored.parquet --features-col a,b,c
    python jobs/predict.py --remote sc://localhost:15002 --config conf/jobs/predict.toml   # over Spark Connect

Writes every input row with ``prediction`` added (for a classifier the class index, and its class
probabilities as ``probability``, an ``array<double>``). Spark does the work: sparkdl's KerasModel
runs the model on Arrow batches in the executors, and nothing is collected to the driver. The
model is a ``.keras`` file on the driver's file system (what jobs/train.py saves); Spark ships it to
the executors. Every option is checked before Spark starts. Deploying: docs/deploying.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import _checks
import _config
import _output
import _spark  # first: it sets the environment before pyspark or keras is imported


def build_parser() -> argparse.ArgumentParser:
    parser = _config.job_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="output/model.keras", help="the .keras file to score with")
    parser.add_argument(
        "--custom-objects",
        type=_config.import_paths,
        help="comma-separated import paths (my_layers.Scale) of the custom classes and functions the model uses that "
        "Keras cannot find by itself; they are sent to the executors with the job",
    )
    parser.add_argument(
        "--data",
        help="Parquet dataset to score (required, here or in --config). A local path "
        "is checked before Spark starts; hdfs://, s3a://, ... are checked by Spark",
    )
    parser.add_argument("--output", default="output/predictions.parquet", help="where to write the scored rows")
    parser.add_argument(
        "--features-col",
        type=_config.column_spec,
        default="features",
        help="vector/array column, comma-separated numeric columns, or a JSON object mapping the model's input "
        "names to columns (default: features)",
    )
    parser.add_argument("--prediction-col", default="prediction")
    parser.add_argument(
        "--probability-col", default="probability", help="class probabilities of a classifier; empty to leave them out"
    )
    parser.add_argument(
        "--mode",
        choices=("error", "overwrite"),
        default="error",
        help="when --output exists: fail (error) or replace it (overwrite)",
    )
    _spark.add_arguments(parser)
    return parser


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The options, checked: a bad one ends the job (exit status 2) before Spark starts."""
    parser = parser or build_parser()
    args = _config.parse_args(parser, argv)
    try:
        if args.data is None:
            raise ValueError("Expected --data (or `data` in the --config file): the Parquet dataset to score.")
        _spark.check_arguments(args)
    except ValueError as e:
        _checks.fail(parser, str(e))
    return args


def score(df, scorer, features_col):
    """``df`` plus the scorer's output columns; ``features_col`` is a column, a list of columns or a mapping from
    the model's input names to columns, read as ``sparkdl.fit`` reads them."""
    from pyspark.ml.functions import vector_to_array

    scored = scorer.transform(df, {scorer.featuresCol: features_col})
    probability_col = scorer.getProbabilityCol()
    if probability_col in scored.columns:  # a classifier's
        # A plain array instead of Spark ML's Vector, which Parquet stores as a struct only Spark understands.
        scored = scored.withColumn(probability_col, vector_to_array(probability_col, "float64"))
    return scored


def check_paths(args: argparse.Namespace, conf) -> None:
    """The model and the input exist and, unless --mode overwrite, the output does not (where this machine can tell)."""
    if not os.path.isfile(args.model):
        raise ValueError(f"--model {args.model}: no such file (the .keras file to score with, on the driver)")
    _checks.check_custom_objects("--model", args.model, args.custom_objects)
    remote = conf is None
    plain_path_is_local = not remote and _spark.is_local(conf.get("spark.master"))
    _checks.check_exists("--data", args.data, remote=remote, plain_path_is_local=plain_path_is_local)
    output = _checks.local_path(args.output)
    if args.mode == "error" and output is not None and plain_path_is_local and os.path.exists(output):
        raise ValueError(
            f"--output {args.output} exists already. Use --mode overwrite to replace it, or another --output."
        )


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(argv, parser)
    _output.configure(args.verbose)
    conf = None if _spark.remote_url(args) else _spark.classic_conf(args)
    try:
        check_paths(args, conf)
    except ValueError as e:
        _checks.fail(parser, str(e))
    from sparkdl.ml import KerasModel

    custom = {"customObjects": args.custom_objects} if args.custom_objects else {}
    scorer = KerasModel.from_keras(
        args.model,
        predictionCol=args.prediction_col,
        probabilityCol=args.probability_col,
        rawPredictionCol="",
        **custom,
    )
    spark = _spark.spark_session("sparkdl-predict", args, conf)
    try:
        score(spark.read.parquet(args.data), scorer, args.features_col).write.mode(args.mode).parquet(args.output)
        rows = spark.read.parquet(args.output).count()  # from the Parquet footers: no second pass over the data
    except ValueError as e:  # the library's errors: one line, naming the job's flags
        _output.logger.info("the error's trace:", exc_info=True)
        _checks.fail(parser, _checks.in_flags(str(e), _checks.flag_names(parser)))
    finally:
        _spark.stop(spark)
    print(f"scored {rows} rows of {args.data} with {args.model}")
    print(f"wrote predictions to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
