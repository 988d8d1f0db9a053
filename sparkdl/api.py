"""``sparkdl.fit``: check everything on the driver, launch the workers, rebuild the trained model."""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import secrets
import threading
import time
from typing import Callable, Optional

from pyspark.sql import DataFrame

from sparkdl import _compat, data, launch, tracking
from sparkdl.checkpoint import Checkpoint, CheckpointStore
from sparkdl.data import ColumnSpec
from sparkdl.launch import probe
from sparkdl.launch.backends import check_backend
from sparkdl.progress import ProgressMonitor
from sparkdl.ps.average import recommended_sync_every, run_average
from sparkdl.ps.driver import run_parameter_server
from sparkdl.train import serialization
from sparkdl.train.task import run_sync

logger = logging.getLogger(__name__)

MODES = ("sync", "async", "hogwild", "ssp", "average")


@dataclasses.dataclass
class FitResult:
    """What ``sparkdl.fit`` returns.

    ``model`` is a new ``keras.Model`` on the driver holding the trained
    weights and optimizer state (the model passed in is left untouched);
    ``history`` maps each metric to its per-epoch values averaged over workers;
    ``stats`` holds the mode's counters (samples, pushes, pulls, bytes,
    highest staleness seen, rounds); ``validation_rows`` the rows held out
    for validation (0 without ``validation_col``/``validation_split``);
    ``initial_epoch`` the epoch training (re)started from: above 0 when it
    resumed from a checkpoint in ``checkpoint_dir``, left by an earlier fit or
    by a failed attempt of this one.
    """

    model: object
    history: dict[str, list[float]]
    num_workers: int
    steps_per_epoch: int
    seconds: float
    stats: dict = dataclasses.field(default_factory=dict)
    validation_rows: int = 0
    initial_epoch: int = 0


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
    push_every: Optional[int] = None,
    max_staleness: Optional[int] = None,
    num_servers: Optional[int] = None,
    sync_every: Optional[int] = None,
    validation_col: Optional[str] = None,
    validation_split: Optional[float] = None,
    timeout: float = 600.0,
    custom_objects: Optional[dict] = None,
    backend: str = "ring",
    checkpoint_dir: Optional[str] = None,
    callbacks: Optional[list] = None,
    progress: bool = True,
    tensorboard_dir: Optional[str] = None,
    log_to_mlflow: bool = False,
) -> FitResult:
    """Trains a compiled Keras 3 model on a Spark DataFrame with ``num_workers`` Spark tasks.

    Modes:
        ``"sync"``: every step, the workers' gradients are averaged with a ring
        allreduce (barrier mode); equivalent to minibatch SGD at the global
        batch ``num_workers * batch_size``.
        ``"async"``: a parameter server on the driver applies each worker's
        pushed gradient as it arrives, under a lock, with the model's own optimizer.
        ``"hogwild"``: as async, without the lock.
        ``"ssp"``: as async, but a worker more than ``max_staleness`` pushes
        ahead of the slowest one waits.
        ``"average"``: no server: every ``sync_every`` local steps the driver
        averages the workers' weights (Spark broadcast + accumulators).

    Args:
        df: the training data.
        model: a compiled ``keras.Model`` (TensorFlow backend); it is left untouched.
        features_col: a Vector column, an ``array<numeric>`` column, or a list of numeric columns.
        label_col: a numeric column (or a Vector/array column for multi-output targets).
        num_workers: Spark tasks that train together; at most the cluster's task slots.
        epochs: passes over the whole DataFrame.
        batch_size: rows per worker per step.
        shuffle: reshuffle every worker's rows each epoch.
        seed: makes shuffling and per-worker randomness reproducible.
        push_every: async/hogwild/ssp: steps whose gradients are averaged into one push (default 1).
        max_staleness: ssp (required): how many pushes a worker may run ahead of the slowest.
        num_servers: async/hogwild/ssp: parameter-server shards, balanced by size (default 1).
        sync_every: average: local steps between two averagings (default: half an epoch's steps).
        validation_col: a boolean column; rows where it is true are held out for validation
            (never trained on). Not together with ``validation_split``.
        validation_split: a fraction in (0, 1) of the rows held out for validation, chosen by a
            hash of each row seeded with ``seed`` (``data.validation_split_mask``): the same rows
            for the same seed and data.
            With either setting, ``history`` also holds ``val_<metric>`` per epoch for every
            metric (``val_loss``, ``val_accuracy``, ...), as Keras's ``fit(validation_data=...)``
            does: the held-out rows evaluated with the epoch's final weights (per mode: sync, the
            replicas' common weights; async/hogwild/ssp, each worker's weights at its epoch end,
            combined weighted by held-out rows; average, the averaged model after the round that
            completes the epoch). Steps per epoch count the training rows only.
        timeout: seconds any single network wait may take before the job fails.
        custom_objects: passed to ``keras.models.load_model`` on the workers.
        backend: sync: whose collectives average the gradients: ``"ring"`` (sparkdl's own) or
            ``"horovod"`` (Horovod's Gloo/NCCL; needs the Horovod stack, ``conf/horovod/install.sh``).
        checkpoint_dir: a directory (local path, ``file://``, ``hdfs://``, ``s3://``, ...) where the
            model, its optimizer state and the history are saved after every epoch (by rank 0 in
            sync mode, by the driver otherwise; see ``sparkdl.checkpoint``). A fit pointed at a
            directory holding checkpoints continues from the newest one, and in sync mode a stage
            Spark retries after losing a task resumes from it. On a cluster it must be storage
            every executor reaches.
        callbacks: Keras callbacks to run inside every worker (sync mode: after the metrics are
            averaged over workers, so every rank sees, and decides on, the same values).
        progress: show progress on the console: a bar where one can be seen (terminal, notebook) and
            one line per epoch (docs/output.md). Epoch lines are logged on the ``sparkdl.progress``
            logger (INFO) either way.
        tensorboard_dir: write per-epoch metrics and throughput there for TensorBoard (needs the
            ``tensorboard`` package), from the driver.
        log_to_mlflow: log the settings and per-epoch metrics to MLflow (the active run, or a new
            one), from the driver.

    Example:
        >>> result = sparkdl.fit(df, model, features_col="features", label_col="label",
        ...                      num_workers=2, epochs=20, batch_size=16, seed=0)
        >>> result.history["loss"][-1]
    """
    _check_settings(df, model, num_workers=num_workers, mode=mode, epochs=epochs, batch_size=batch_size,
                    timeout=timeout, seed=seed)
    options = _mode_options(model, mode, push_every=push_every, max_staleness=max_staleness,
                            num_servers=num_servers, sync_every=sync_every)
    _validation_options(validation_col, validation_split)
    if backend != "ring" and mode != "sync":
        raise ValueError(f"`backend` applies to mode='sync' only. Received: backend={backend!r} with mode={mode!r}")
    check_backend(backend)
    callbacks = _check_callbacks(callbacks, mode)
    if not isinstance(progress, bool):
        raise ValueError(f"Expected `progress` to be True or False. Received: progress={progress!r}")
    tracking.check_available(tensorboard_dir, log_to_mlflow)
    checkpoints = CheckpointStore.open(checkpoint_dir) if checkpoint_dir is not None else None
    resumed = _newest_checkpoint(checkpoints, model, custom_objects)
    phases = _Phases()
    launch.check_slots(df.sparkSession, num_workers, wait_seconds=30.0, mode=mode)
    seed = secrets.randbelow(2**31) if seed is None else seed
    planned = data.plan(df, features_col, label_col, validation_col=validation_col,
                        validation_split=validation_split, seed=seed)  # the columns: no Spark job yet
    # The executors' Python is checked (and TensorFlow loaded into it) while the driver checks the rows.
    workers = probe.start_check(df.sparkSession, num_workers, timeout)
    phases.end("slots")
    training = planned.check(num_workers)
    phases.end("checks")
    workers.wait()
    phases.end("workers")
    steps = data.steps_per_epoch(training.num_rows, num_workers, batch_size)  # training rows only
    if resumed is not None and resumed.epoch >= epochs:
        logger.info("sparkdl: %s already holds %d trained epochs (epochs=%d): nothing to train", checkpoint_dir,
                    resumed.epoch, epochs)
        return FitResult(serialization.model_from_bytes(resumed.model_bytes, custom_objects), resumed.history,
                         num_workers, steps, 0.0, {}, training.validation_rows, resumed.epoch)
    initial_epoch = resumed.epoch if resumed is not None else 0
    common = dict(model_bytes=serialization.model_to_bytes(model), num_workers=num_workers, epochs=epochs,
                  batch_size=batch_size, seed=seed, shuffle=shuffle, custom_objects=custom_objects)
    logger.info("sparkdl: %s training on %d workers, %d rows (%d held out for validation), "
                "%d steps/epoch x %d epochs%s", mode, num_workers, training.num_rows, training.validation_rows, steps, epochs,
                f", resuming after epoch {initial_epoch}" if initial_epoch else "")
    listeners = []
    if tensorboard_dir is not None:
        listeners.append(tracking.TensorBoardLogger(tensorboard_dir))
    if log_to_mlflow:
        listeners.append(tracking.MLflowLogger(dict(
            mode=mode, num_workers=num_workers, epochs=epochs, batch_size=batch_size, seed=seed, shuffle=shuffle,
            steps_per_epoch=steps, backend=backend, **{k: v for k, v in options.items() if v is not None})))
    monitor = ProgressMonitor(epochs=epochs, steps_per_epoch=steps, initial_epoch=initial_epoch,
                              reporting_ranks=1 if mode in ("sync", "average") else num_workers,
                              console=progress, listeners=listeners,
                              description=f"sparkdl {mode} x{num_workers}")
    started = time.perf_counter()
    phases.end("serialize")
    with monitor:
        if mode == "sync":
            model_bytes, history, initial_epoch = run_sync(
                training, steps_per_epoch=steps, timeout=timeout, backend=backend, checkpoints=checkpoints,
                callbacks=callbacks, on_progress=phases.watch(monitor.on_event), **common)
            stats = {}
        elif mode == "average":
            model_bytes, history, stats = run_average(
                training, sync_every=options["sync_every"] or recommended_sync_every(steps), resumed=resumed,
                checkpoints=checkpoints, monitor=monitor, **common)
        else:
            model_bytes, history, stats = run_parameter_server(
                df.sparkSession, training, mode=mode, steps_per_epoch=steps, timeout=timeout,
                push_every=options["push_every"] or 1, max_staleness=options["max_staleness"] or 0,
                num_servers=options["num_servers"] or 1, resumed=resumed, checkpoints=checkpoints,
                callbacks=callbacks, monitor=monitor, **common)
    seconds = time.perf_counter() - started
    phases.end("training" if mode != "sync" else "result")
    trained = serialization.model_from_bytes(model_bytes, custom_objects)
    phases.end("rebuild")
    logger.info("sparkdl: phases %s; %s", phases, workers.summary())
    return FitResult(trained, history, num_workers, steps, seconds, stats, training.validation_rows, initial_epoch)


class _Phases:
    """Wall-clock seconds of ``fit``'s phases, for one log line (``sparkdl: phases settings 0.02s, checks ...``).

    ``watch`` wraps a sync job's progress callback: the first ``start`` event (rank 0 has its data,
    its ring and its model: Python worker start, TensorFlow import, model load) ends ``startup``, the
    first epoch event ``epoch 1`` (which includes tracing the train step), the last one ``epochs``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = time.perf_counter()
        self._seconds: dict[str, float] = {}

    def end(self, name: str) -> None:
        """Ends the running phase, naming it ``name`` (a name ended again grows by the time since)."""
        with self._lock:
            now = time.perf_counter()
            self._seconds[name] = self._seconds.get(name, 0.0) + now - self._last
            self._last = now

    def watch(self, on_event: Callable[[int, dict], None]) -> Callable[[int, dict], None]:
        def on_progress(rank: int, event: dict) -> None:
            kind = event.get("event")
            if kind == "start" and "startup" not in self._seconds:
                self.end("startup")
            elif kind == "epoch":
                self.end("epochs" if "epoch 1" in self._seconds else "epoch 1")
            on_event(rank, event)

        return on_progress

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self._seconds.items())


def _newest_checkpoint(checkpoints: Optional[CheckpointStore], model, custom_objects) -> Optional[Checkpoint]:
    """The checkpoint a fit continues from; refuses one of a different model rather than train that instead."""
    latest = checkpoints.latest() if checkpoints is not None else None
    if latest is None:
        return None
    saved = serialization.model_from_bytes(latest.model_bytes, custom_objects)
    expected = [tuple(w.shape) for w in model.weights]
    found = [tuple(w.shape) for w in saved.weights]
    if expected != found:
        raise ValueError(f"checkpoint_dir={checkpoints.uri!r} holds a checkpoint (epoch {latest.epoch}) of a different "
                         f"model: its weights have shapes {found}, the model's {expected}. Use another directory "
                         "for this model, or empty this one.")
    logger.info("sparkdl: found a checkpoint after epoch %d in %s", latest.epoch, checkpoints.uri)
    return latest


def _check_callbacks(callbacks, mode: str) -> tuple:
    """Keras callbacks that can travel to the workers (they are pickled into the tasks)."""
    if not callbacks:
        return ()
    import keras
    from pyspark import cloudpickle

    if mode == "average":
        raise ValueError("`callbacks` run inside Keras's fit on the workers, which mode='average' does not use (it "
                         "trains in rounds of train_on_batch). Use mode='sync' or a parameter-server mode, or drop "
                         f"the callbacks. Received: callbacks={callbacks!r}")
    if not isinstance(callbacks, (list, tuple)):
        raise ValueError(f"Expected `callbacks` to be a list of keras.callbacks.Callback. Received: {callbacks!r}")
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise ValueError("Expected `callbacks` to hold keras.callbacks.Callback instances. "
                             f"Received: {type(callback).__name__}")
        try:
            cloudpickle.dumps(callback)
        except Exception as exc:
            raise ValueError(f"Callback {type(callback).__name__} cannot be sent to the workers (it must be "
                             f"picklable; create resources such as files or clients in its on_train_begin): {exc}"
                             ) from exc
    return tuple(callbacks)


_MODE_OPTIONS = {
    "push_every": ("async", "hogwild", "ssp"),
    "max_staleness": ("ssp",),
    "num_servers": ("async", "hogwild", "ssp"),
    "sync_every": ("average",),
}


def check_mode_options(mode: str, names: Optional[dict[str, str]] = None, **options) -> None:
    """Checks the settings only some modes use: one the mode does not use, or a bad value, is an error.

    ``names`` maps a setting (and ``mode``) to what the errors call it, e.g. a job's flags
    (``{"mode": "--mode", "max_staleness": "--max-staleness"}``); by default the argument names.
    """
    names = names or {}

    def called(name):
        return names.get(name, f"`{name}`")

    def shown(name, value):
        return f"{names[name]} {value}" if name in names else f"{name}={value!r}"

    for name, value in options.items():
        if value is None:
            continue
        if mode not in _MODE_OPTIONS[name]:
            modes = (f"{names['mode']} {' or '.join(_MODE_OPTIONS[name])}" if "mode" in names
                     else "mode=" + " or ".join(map(repr, _MODE_OPTIONS[name])))
            raise ValueError(f"{called(name)} applies to {modes} only. "
                             f"Received: {shown(name, value)} with {shown('mode', mode)}")
        minimum = 0 if name == "max_staleness" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "non-negative" if minimum == 0 else "positive"
            raise ValueError(f"Expected {called(name)} to be a {kind} integer. "
                             f"Received: {shown(name, value)}")
    if mode == "ssp" and options.get("max_staleness") is None:
        raise ValueError(f"{shown('mode', mode)} needs {called('max_staleness')}: how many "
                         "pushes a worker may run ahead of the slowest.")


def _mode_options(model, mode: str, **options) -> dict:
    """Checks the mode-specific settings, and that the model has enough variables for ``num_servers`` shards."""
    check_mode_options(mode, **options)
    variables = len(model.trainable_variables)
    if (options["num_servers"] or 1) > variables:
        raise ValueError(f"Expected `num_servers` <= the model's {variables} trainable variables (a shard holds whole "
                         f"variables). Received: num_servers={options['num_servers']}")
    return options


def _validation_options(validation_col, validation_split) -> None:
    """Checks the validation settings (the column itself is checked against the schema in ``data.plan``)."""
    if validation_col is not None and validation_split is not None:
        raise ValueError("`validation_col` and `validation_split` are mutually exclusive: pass one of them. "
                         f"Received: validation_col={validation_col!r}, validation_split={validation_split!r}")
    if validation_col is not None and not isinstance(validation_col, str):
        raise ValueError(f"Expected `validation_col` to be a column name. Received: validation_col={validation_col!r}")
    if validation_split is not None and (isinstance(validation_split, bool)
                                         or not isinstance(validation_split, numbers.Real)
                                         or not 0 < validation_split < 1):
        raise ValueError(f"Expected `validation_split` to be a float in (0, 1). "
                         f"Received: validation_split={validation_split!r}")


def _check_settings(df, model, *, num_workers, mode, epochs, batch_size, timeout, seed) -> None:
    if not isinstance(df, DataFrame):
        raise ValueError(f"Expected `df` to be a pyspark.sql.DataFrame. Received: {type(df).__name__}")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected `model` to be a keras.Model. Received: {type(model).__name__}")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"Expected the TensorFlow Keras backend. Received: KERAS_BACKEND={keras.backend.backend()!r}")
    if not _compat.is_compiled(model) or getattr(model, "optimizer", None) is None:
        raise ValueError("Expected a compiled model: call model.compile(optimizer=..., loss=...) before sparkdl.fit.")
    _compat.check_model_supported(model)
    if mode not in MODES:
        raise ValueError(f"Expected `mode` to be one of {list(MODES)}. Received: mode={mode!r}")
    for name, value in (("num_workers", num_workers), ("epochs", epochs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Expected `{name}` to be a positive integer. Received: {name}={value!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"Expected `timeout` to be a positive number of seconds. Received: timeout={timeout!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"Expected `seed` to be a non-negative integer or None. Received: seed={seed!r}")
