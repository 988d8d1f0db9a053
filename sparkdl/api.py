"""``sparkdl.fit``: check everything on the driver, launch the workers, rebuild the trained model."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from typing import Optional

from pyspark.sql import DataFrame

from sparkdl import data, launch
from sparkdl.data import ColumnSpec
from sparkdl.train import serialization
from sparkdl.train.task import SyncJob, run_sync_task

logger = logging.getLogger(__name__)

MODES = ("sync",)


@dataclasses.dataclass
class FitResult:
    """What ``sparkdl.fit`` returns.

    ``model`` is a new ``keras.Model`` on the driver holding the trained
    weights and optimizer state (the model passed in is left untouched);
    ``history`` maps each metric to its per-epoch values averaged over workers.
    """

    model: object
    history: dict[str, list[float]]
    num_workers: int
    steps_per_epoch: int
    seconds: float


def fit(
    df: DataFrame,
    model,
    *,
    features_col: ColumnSpec = "features",
    label_col: str = "label",
    num_workers: int = 2,
    mode: str = "sync",
    epochs: int = 1,
    batch_size: int = 32,
    shuffle: bool = True,
    seed: Optional[int] = None,
    timeout: float = 600.0,
    custom_objects: Optional[dict] = None,
) -> FitResult:
    """Trains a compiled Keras 3 model on a Spark DataFrame with ``num_workers`` Spark tasks.

    In ``mode="sync"`` every worker computes gradients on its own ``batch_size``
    rows and the gradients are averaged with a ring allreduce every step, so
    the global batch is ``num_workers * batch_size`` and the result matches
    single-process minibatch SGD at that batch size.

    Args:
        df: the training data.
        model: a compiled ``keras.Model`` (TensorFlow backend).
        features_col: a Vector column, an ``array<numeric>`` column, or a list of numeric columns.
        label_col: a numeric column (or a Vector/array column for multi-output targets).
        num_workers: Spark tasks that train together; at most the cluster's task slots.
        epochs: passes over the whole DataFrame.
        batch_size: rows per worker per step.
        shuffle: reshuffle every worker's rows each epoch.
        seed: makes shuffling and per-worker randomness reproducible.
        timeout: seconds any single network wait between workers may take before the job fails.
        custom_objects: passed to ``keras.saving.load_model`` on the workers.

    Example:
        >>> result = sparkdl.fit(df, model, features_col="features", label_col="label",
        ...                      num_workers=2, epochs=20, batch_size=16, seed=0)
        >>> result.history["loss"][-1]
    """
    _check_settings(df, model, num_workers=num_workers, mode=mode, epochs=epochs, batch_size=batch_size,
                    timeout=timeout, seed=seed)
    launch.check_slots(df.sparkSession, num_workers, wait_seconds=30.0)
    training = data.prepare(df, features_col, label_col, num_workers)
    steps = data.steps_per_epoch(training.num_rows, num_workers, batch_size)
    job = SyncJob(
        model_bytes=serialization.model_to_bytes(model),
        secret=secrets.token_bytes(32),
        feature_width=training.feature_width,
        label_width=training.label_width,
        label_is_scalar=training.label_is_scalar,
        epochs=epochs,
        batch_size=batch_size,
        steps_per_epoch=steps,
        seed=secrets.randbelow(2**31) if seed is None else seed,
        shuffle=shuffle,
        timeout=timeout,
        custom_objects=custom_objects,
    )
    logger.info("sparkdl: %s training on %d workers, %d rows, %d steps/epoch x %d epochs",
                mode, num_workers, training.num_rows, steps, epochs)
    started = time.perf_counter()
    results = launch.run_tasks(training.frame, num_workers, lambda batches: run_sync_task(batches, job), barrier=True)
    seconds = time.perf_counter() - started
    model_bytes, history = serialization.result_from_bytes(results[0])
    trained = serialization.model_from_bytes(model_bytes, custom_objects)
    return FitResult(trained, history, num_workers, steps, seconds)


def _check_settings(df, model, *, num_workers, mode, epochs, batch_size, timeout, seed) -> None:
    if not isinstance(df, DataFrame):
        raise ValueError(f"Expected `df` to be a pyspark.sql.DataFrame. Received: {type(df).__name__}")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected `model` to be a keras.Model (Keras 3). Received: {type(model).__name__}")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"Expected the TensorFlow Keras backend. Received: KERAS_BACKEND={keras.backend.backend()!r}")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError("Expected a compiled model: call model.compile(optimizer=..., loss=...) before sparkdl.fit.")
    if mode not in MODES:
        raise ValueError(f"Expected `mode` to be one of {list(MODES)}. Received: mode={mode!r}")
    for name, value in (("num_workers", num_workers), ("epochs", epochs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Expected `{name}` to be a positive integer. Received: {name}={value!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"Expected `timeout` to be a positive number of seconds. Received: timeout={timeout!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"Expected `seed` to be a non-negative integer or None. Received: seed={seed!r}")
