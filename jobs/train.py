"""Train a Keras model on a Spark DataFrame with sparkdl, under spark-submit or plain python.

    python jobs/train.py                                  # digits, bundled with scikit-learn, on local[*]
    spark-submit --master 'local-cluster[2,1,1024]' jobs/train.py --num-workers 2
    spark-submit --properties-file conf/spark-local.conf jobs/train.py --config conf/jobs/train-async.toml --epochs 5
    python jobs/train.py --data some.parquet --features-col features --label-col label
    python jobs/train.py --remote sc://localhost:15002   # over Spark Connect
    python jobs/train.py --model my.keras --data t.parquet --features-col '{"numeric": "x", "user": "user_id"}'

sparkdl logs one line per epoch; the job then prints the test accuracy and saves the trained model.
Options come from flags and from a ``--config`` TOML file (conf/jobs/train-*.toml, one per mode);
flags win. Every option is checked before Spark starts. Deploying: docs/deploying.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys

import _checks
import _config
import _output
import _spark  # first: it sets the environment before pyspark or keras is imported

import sparkdl
from sparkdl.modes.registry import declared_options

# Settings that only some modes use, as the modes declare them (sparkdl.fit rejects one the chosen mode does not use).
MODE_SETTINGS = tuple(declared_options())
# Settings that sparkdl.fit takes only when given.
OPTIONAL_FIT_SETTINGS = (*MODE_SETTINGS, "validation_split", "checkpoint_dir", "sample_weight_col")

_POSITIVE_INTEGER = (lambda v: v >= 1, "a positive integer")
_FRACTION = (lambda v: 0 < v < 1, "a fraction in (0, 1)")
NUMBER_RULES = {
    "num_workers": _POSITIVE_INTEGER,
    "epochs": _POSITIVE_INTEGER,
    "batch_size": _POSITIVE_INTEGER,
    "learning_rate": (lambda v: v > 0, "a positive number"),
    "test_fraction": _FRACTION,
    "validation_split": _FRACTION,
    "seed": (lambda v: v >= 0, "a non-negative integer"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _config.job_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        help="Parquet dataset to train on (default: scikit-learn's digits). A local path "
        "is checked before Spark starts; hdfs://, s3a://, ... are checked by Spark",
    )
    parser.add_argument(
        "--model",
        help="a compiled Keras model (.keras file) to train instead of the built-in MLP; it may have several "
        "inputs and outputs (give --features-col/--label-col as mappings)",
    )
    parser.add_argument(
        "--custom-objects",
        type=_config.import_paths,
        help="with --model: comma-separated import paths (my_layers.Scale) of the custom classes and functions the "
        "model uses that Keras cannot find by itself; they are sent to the executors with the job",
    )
    parser.add_argument(
        "--features-col",
        type=_config.column_spec,
        default="features",
        help="vector/array column, comma-separated numeric columns, or a JSON object mapping the model's input "
        "names to columns (default: features)",
    )
    parser.add_argument(
        "--label-col",
        type=_config.column_spec,
        default="label",
        help="label column, or a JSON object mapping the model's output names to columns (default: label)",
    )
    parser.add_argument("--sample-weight-col", help="number column weighting each row's loss")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--mode", choices=sparkdl.MODES, default="sync", help="how the workers combine their work")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per worker per step")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    _config.add_mode_options(parser, declared_options())
    parser.add_argument("--validation-split", type=float, help="training rows held out for val_ metrics (a fraction)")
    parser.add_argument("--checkpoint-dir", help="where sparkdl.fit writes checkpoints to resume from")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="output/model.keras", help="where to save the trained model")
    parser.add_argument("--test-output", help="also write the held-out test rows as Parquet (input for predict.py)")
    _spark.add_arguments(parser)
    return parser


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The options, checked: a bad one ends the job (exit status 2) before Spark starts."""
    parser = parser or build_parser()
    args = _config.parse_args(parser, argv)
    flags = _checks.flag_names(parser)
    try:
        _checks.check_numbers(args, flags, NUMBER_RULES)
        sparkdl.check_mode_options(args.mode, flags, **{name: getattr(args, name) for name in MODE_SETTINGS})
        for name in ("features_col", "label_col"):
            if not args.model and isinstance(getattr(args, name), dict):
                raise ValueError(
                    f"{flags[name]} maps model input/output names to columns: that needs your model, --model "
                    "(the built-in MLP has one input and one output)."
                )
        if args.model and not os.path.isfile(args.model):
            raise ValueError(f"Expected --model to be a .keras file. Received: {args.model!r}, which is not a file.")
        if args.model:
            _checks.check_custom_objects("--model", args.model, args.custom_objects)
        elif args.custom_objects:
            raise ValueError("--custom-objects names the custom objects of your model, --model: give that too.")
        _spark.check_arguments(args)
    except ValueError as e:
        _checks.fail(parser, str(e))
    return args


def load_in_background(args: argparse.Namespace):
    """Keras, seeded, and the default data split (None with --data): what the job needs besides Spark."""
    import keras

    keras.utils.set_random_seed(args.seed)
    return None if args.data else digits(args.test_fraction, args.seed)


def digits(test_fraction: float, seed: int):
    """scikit-learn's digits, split on the driver into training and held-out test arrays."""
    import numpy as np
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[: round(len(x) * test_fraction)], order[round(len(x) * test_fraction) :]
    return (x[train], y[train]), (x[test], y[test])


def digits_frame(spark, x, y):
    """Rows ``features array<float>, label int``, built from Arrow arrays (no Python object per row)."""
    import numpy as np
    import pyarrow as pa

    offsets = pa.array(np.arange(0, x.size + 1, x.shape[1], dtype=np.int32))
    features = pa.ListArray.from_arrays(offsets, pa.array(x.ravel()))
    return spark.createDataFrame(pa.table({"features": features, "label": pa.array(y)}))


def width_and_classes(df, features, label_col: str) -> tuple[int, int]:
    """The features' width and the number of classes (largest label + 1), in one Spark job."""
    from pyspark.sql import functions as F

    expr = sparkdl.features_column(df, features)  # checks the columns' types, naming them
    if label_col not in df.columns:
        raise ValueError(
            f"Column {label_col!r} given as `label_col` is not in the data. Available columns: {df.columns}"
        )
    row = df.agg(F.max(F.size(expr)), F.max(label_col)).first()
    if row[0] is None:
        raise ValueError("Expected `data` to hold rows to train on. Received: no rows")
    return int(row[0]), int(row[1]) + 1


def test_arrays(test_df, features, label_col: str, width: int):
    """The held-out rows as numpy arrays on the driver (one Spark job; fine for a test split of this size)."""
    from pyspark.sql import functions as F

    table = test_df.select(sparkdl.features_column(test_df, features).alias("x"), F.col(label_col).alias("y")).toArrow()
    x = table.column("x").combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
    return x, table.column("y").to_numpy()


def test_accuracy(test_df, model, args: argparse.Namespace) -> float | None:
    """A user's model scored on the test rows with sparkdl's batch inference (any inputs, by the fit's rule);
    the accuracy of a classifier of one label column, else None."""
    from pyspark.sql import functions as F

    from sparkdl.ml import KerasModel

    custom = {"customObjects": args.custom_objects} if args.custom_objects else {}
    scorer = KerasModel.from_keras(
        model,
        featuresCol=args.features_col,
        predictionCol="_prediction",
        probabilityCol="",
        rawPredictionCol="",
        **custom,
    )
    scored = scorer.transform(test_df)
    if not isinstance(args.label_col, str) or dict(scored.dtypes)["_prediction"] != "double":
        return None
    row = scored.agg(F.avg((F.col("_prediction") == F.col(args.label_col)).cast("double"))).first()
    return float(row[0])


def build_mlp(width: int, classes: int, learning_rate: float):
    import keras

    model = keras.Sequential(
        [
            keras.Input((width,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(classes, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate), loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    return model


def train(spark, args: argparse.Namespace, digits_split) -> None:
    """Trains, scores and saves; ``digits_split`` is the default data's ``digits()``, None with --data."""
    import numpy as np

    phase = _output.phase
    features = args.features_col
    with phase("data"):
        if args.data:
            df = spark.read.parquet(args.data)
            train_df, test_df = df.randomSplit([1 - args.test_fraction, args.test_fraction], seed=args.seed)
            train_df = train_df.cache()  # read again by sparkdl's checks and by the training stage
        else:  # on the driver already: its width and classes cost no Spark job
            (x_train, y_train), (x_test, y_test) = digits_split
            train_df, width, classes = digits_frame(spark, x_train, y_train), x_train.shape[1], int(y_train.max()) + 1
    if args.model:
        import keras

        model = keras.models.load_model(args.model, custom_objects=args.custom_objects)
    else:
        if args.data:
            with phase("width_and_classes"):
                width, classes = width_and_classes(train_df, features, args.label_col)
        model = build_mlp(width, classes, args.learning_rate)

    optional = {name: getattr(args, name) for name in OPTIONAL_FIT_SETTINGS if getattr(args, name) is not None}
    with phase("fit"):
        result = sparkdl.fit(
            train_df,
            model,
            features_col=features,
            label_col=args.label_col,
            num_workers=args.num_workers,
            mode=args.mode,
            epochs=args.epochs,
            batch_size=args.batch_size,
            seed=args.seed,
            custom_objects=args.custom_objects,
            **optional,
        )
    print(
        f"trained on {result.num_workers} workers in {result.seconds:.1f}s ({args.mode} mode, "
        f"{result.steps_per_epoch} steps/epoch of {args.batch_size} rows per worker)"
    )
    with phase("test"):
        if args.model:
            accuracy = test_accuracy(test_df if args.data else digits_frame(spark, x_test, y_test), result.model, args)
        else:
            if args.data:
                x_test, y_test = test_arrays(test_df, features, args.label_col, width)
            accuracy = float(np.mean(result.model.predict(x_test, verbose=0).argmax(axis=1) == y_test))
    if accuracy is None:
        print("test accuracy: not computed (the model is not a classifier of one label column)")
    else:
        print(f"test accuracy: {accuracy:.4f}")

    with phase("save"):
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        result.model.save(args.output)
    print(f"saved model to {args.output}")
    if args.test_output:
        with phase("test_output"):
            (test_df if args.data else digits_frame(spark, x_test, y_test)).write.mode("overwrite").parquet(
                args.test_output
            )
        print(f"wrote the test rows to {args.test_output}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(argv, parser)
    _output.configure(args.verbose)
    flags = _checks.flag_names(parser)
    with _output.phase("checks"):
        conf = None if _spark.remote_url(args) else _spark.classic_conf(args)
        if args.data:
            try:
                _checks.check_exists(
                    "--data",
                    args.data,
                    remote=conf is None,
                    plain_path_is_local=conf is not None and _spark.is_local(conf.get("spark.master")),
                )
            except ValueError as e:
                _checks.fail(parser, str(e))
    # Three processes load TensorFlow: this one, and the executors' Python (once, in sparkdl's worker daemon for
    # local masters). The JVM starts first, alone, so that the executors' import can begin at once; the driver's
    # import and the default data then load beside it, and fit's data checks run while it ends.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _output.phase("session"):
            spark = _spark.spark_session("sparkdl-train", args, conf)
        sparkdl.check_executors(spark, args.num_workers, wait=False)  # fit waits for it
        loading = pool.submit(load_in_background, args)
        with _output.phase("background"):  # what is left of loading Keras and the data
            digits_split = loading.result()
    try:
        train(spark, args, digits_split)
    except ValueError as e:  # the library's (and the data's) errors: one line, naming the job's flags
        _output.logger.info("the error's trace:", exc_info=True)
        _checks.fail(parser, _checks.in_flags(str(e), flags))
    finally:
        _spark.stop(spark)
    return 0


if __name__ == "__main__":
    sys.exit(main())
