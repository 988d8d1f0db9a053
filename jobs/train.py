"""Train a Keras MLP on a Spark DataFrame with sparkdl, under spark-submit or plain python.

    python jobs/train.py                                  # digits, bundled with scikit-learn, on local[*]
    spark-submit --master local-cluster[2,1,1024] jobs/train.py --num-workers 2
    spark-submit --properties-file conf/spark-local.conf jobs/train.py --config conf/jobs/train-async.toml --epochs 5
    python jobs/train.py --data some.parquet --features-col features --label-col label

Prints per-epoch metrics and the test accuracy, and saves the trained model. Options come from
flags and from a ``--config`` TOML file (conf/jobs/train-*.toml, one per mode); flags win.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import _config
from _spark import spark_session  # first: it sets the environment before pyspark or keras is imported

from sparkdl.api import MODES

# Settings that sparkdl.fit takes only when given: it rejects a setting the chosen mode does not use.
OPTIONAL_FIT_SETTINGS = ("push_every", "max_staleness", "num_servers", "sync_every", "validation_split",
                         "checkpoint_dir")


def parse_args(argv=None) -> argparse.Namespace:
    parser = _config.job_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="Parquet dataset to train on (default: scikit-learn's digits)")
    parser.add_argument("--features-col", default="features",
                        help="vector/array column, or comma-separated numeric columns (default: features)")
    parser.add_argument("--label-col", default="label", help="integer class label column (default: label)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--mode", choices=MODES, default="sync", help="how the workers combine their work")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per worker per step")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--push-every", type=int, help="async/hogwild/ssp: steps per gradient push")
    parser.add_argument("--max-staleness", type=int, help="ssp (required): pushes a worker may run ahead")
    parser.add_argument("--num-servers", type=int, help="async/hogwild/ssp: parameter-server shards")
    parser.add_argument("--sync-every", type=int, help="average: local steps between averagings")
    parser.add_argument("--validation-split", type=float, help="training rows held out for val_ metrics (a fraction)")
    parser.add_argument("--checkpoint-dir", help="where sparkdl.fit writes checkpoints to resume from")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="output/model.keras", help="where to save the trained model")
    parser.add_argument("--test-output", help="also write the held-out test rows as Parquet (input for predict.py)")
    parser.add_argument("--master", help="Spark master when run with plain python (spark-submit sets its own)")
    return _config.parse_args(parser, argv)


def load_digits_frame(spark):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rows = [((pixels / 16.0).tolist(), int(label)) for pixels, label in zip(x, y)]
    return spark.createDataFrame(rows, "features array<float>, label int")


def build_mlp(width: int, classes: int, learning_rate: float):
    import keras

    model = keras.Sequential([
        keras.Input((width,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(classes, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def test_accuracy(model, test_df, features, label_col: str) -> float:
    """Scores the held-out split on the driver (fine for the demo's small test split)."""
    import numpy as np
    from sparkdl import data

    prepared = data.prepare(test_df, features, label_col, num_workers=1)
    x, y = prepared.shapes.to_numpy(prepared.frame.toArrow().to_batches())
    return float(np.mean(model.predict(x, verbose=0).argmax(axis=1) == y))


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import keras
    from pyspark.sql import functions as F

    import sparkdl
    from sparkdl.launch import probe

    keras.utils.set_random_seed(args.seed)
    spark = spark_session("sparkdl-train", args.master)
    # The executors' Python is checked, and TensorFlow loaded into it, while the data loads (fit waits for it).
    probe.start_check(spark, args.num_workers, timeout=600.0)
    df = spark.read.parquet(args.data) if args.data else load_digits_frame(spark)
    features = args.features_col.split(",") if "," in args.features_col else args.features_col
    train_df, test_df = df.randomSplit([1 - args.test_fraction, args.test_fraction], seed=args.seed)
    train_df = train_df.cache()

    width = sparkdl.data.prepare(train_df.limit(1), features, args.label_col, num_workers=1).shapes.feature_width
    classes = int(train_df.agg(F.max(args.label_col)).first()[0]) + 1
    model = build_mlp(width, classes, args.learning_rate)

    optional = {name: getattr(args, name) for name in OPTIONAL_FIT_SETTINGS if getattr(args, name) is not None}
    result = sparkdl.fit(train_df, model, features_col=features, label_col=args.label_col,
                         num_workers=args.num_workers, mode=args.mode, epochs=args.epochs,
                         batch_size=args.batch_size, seed=args.seed, **optional)
    for epoch in range(len(result.history["loss"])):
        metrics = "  ".join(f"{name}={values[epoch]:.4f}" for name, values in result.history.items())
        print(f"epoch {epoch + 1:3d}/{args.epochs}  {metrics}")
    print(f"trained on {result.num_workers} workers in {result.seconds:.1f}s ({args.mode} mode, "
          f"{result.steps_per_epoch} steps/epoch of {args.batch_size} rows per worker)")
    print(f"test accuracy: {test_accuracy(result.model, test_df, features, args.label_col):.4f}")

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    result.model.save(args.output)
    print(f"saved model to {args.output}")
    if args.test_output:
        test_df.write.mode("overwrite").parquet(args.test_output)
        print(f"wrote the test rows to {args.test_output}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
