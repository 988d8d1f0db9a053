"""Sync mode: the barrier stage, and what each of its tasks does from its Arrow partition to rank 0's result."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa
from pyspark import TaskContext

from sparkdl import data
from sparkdl.checkpoint import BackgroundWriter, Checkpoint, CheckpointStore
from sparkdl.launch import payloads, run_tasks
from sparkdl.launch.relay import TaskReporter
from sparkdl.launch.backends import trainer_communicator
from sparkdl.train import reporting, serialization, sync

_MODEL = "model"  # the name the driver offers the model to train under


@dataclasses.dataclass(frozen=True)
class SyncJob:
    """Everything a task needs but the model, shipped from the driver in the task closure.

    The model, which may be far larger than a closure should be (a Spark Connect
    message, the driver JVM's heap), is fetched from the driver's relay by rank 0.
    """

    secret: bytes
    shapes: data.ColumnShapes
    epochs: int
    batch_size: int
    steps_per_epoch: int
    seed: int
    shuffle: bool
    timeout: float
    custom_objects: Optional[dict]
    validate: bool = False  # rows are held out: every rank evaluates its own and the metrics are combined
    backend: str = "ring"   # whose collectives average the gradients: sparkdl's ring or Horovod's
    checkpoints: Optional[CheckpointStore] = None  # rank 0 resumes from the newest and saves after every epoch
    callbacks: Sequence = ()  # the user's Keras callbacks, run on every rank


def run_sync(training: data.TrainingData, *, model_bytes: bytes, num_workers: int, epochs: int, batch_size: int,
             steps_per_epoch: int, seed: int, shuffle: bool, timeout: float, custom_objects: Optional[dict],
             backend: str = "ring", checkpoints: Optional[CheckpointStore] = None, callbacks: Sequence = (),
             on_progress: Callable[[int, dict], None] = lambda rank, event: None
             ) -> tuple[bytes, dict[str, list[float]], int]:
    """Runs sync training as one barrier stage.

    Returns rank 0's trained ``.keras`` bytes, the history of all epochs, and the epoch its
    (last) attempt started from: above 0 when it resumed from a checkpoint, after an earlier
    ``fit`` or after Spark retried the stage because a task was lost.
    """
    job = SyncJob(
        secret=secrets.token_bytes(32),
        shapes=training.shapes,
        epochs=epochs,
        batch_size=batch_size,
        steps_per_epoch=steps_per_epoch,
        seed=seed,
        shuffle=shuffle,
        timeout=timeout,
        custom_objects=custom_objects,
        validate=training.validation_rows > 0,
        backend=backend,
        checkpoints=checkpoints,
        callbacks=tuple(callbacks),
    )
    results = run_tasks(training.frame, num_workers, lambda batches, reporter: run_sync_task(batches, reporter, job),
                        barrier=True, timeout=timeout, on_progress=on_progress, offered={_MODEL: model_bytes})
    return serialization.result_from_bytes(results[0])


def run_sync_task(batches: Iterable[pa.RecordBatch], reporter: TaskReporter, job: SyncJob) -> Optional[bytes]:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # before anything in this worker imports Keras
    x, y, x_val, y_val = job.shapes.split_numpy(batches)
    with trainer_communicator(job.backend, job.secret, job.timeout) as comm:
        # Every rank learns every rank's training and validation row counts, so that all of them take
        # the same decisions below (raise, validate, how to weigh validation metrics) with no further talk.
        counts = comm.allgather(np.array([len(x), len(x_val)], np.int64))
        rows, validation_rows = counts[:, 0], counts[:, 1]
        if rows.min() == 0:
            raise ValueError(
                f"Worker partitions got {rows.tolist()} training rows: every worker needs at least one row. "
                "Use fewer workers or more data."
            )
        if job.validate and validation_rows.sum() == 0:
            raise ValueError("No worker partition got a validation row: the validation set is empty.")
        limit_threads_to_task_cpus()
        start = _starting_point(comm, job.checkpoints, reporter)
        model = serialization.model_from_bytes(start.model_bytes, job.custom_objects)
        initial_epoch, earlier_history = start.epoch, start.history
        validation = sync.Validation(x_val, y_val, validation_rows) if job.validate else None
        callbacks = list(job.callbacks)
        saving = job.checkpoints is not None and comm.rank == 0
        with BackgroundWriter(job.checkpoints) if saving else contextlib.nullcontext() as writer:
            if comm.rank == 0:  # the ranks hold the same model and (averaged) metrics: one of them reports and saves
                reporter.progress({"event": "start", "initial_epoch": initial_epoch})
                callbacks.insert(0, reporting.progress_callback(
                    reporter.progress, steps_per_epoch=job.steps_per_epoch, batch_size=job.batch_size * comm.size))
            if saving:
                callbacks.insert(0, reporting.checkpoint_callback(writer, earlier_history, "sync"))
            history = sync.train(model, x, y, comm=comm, epochs=job.epochs, batch_size=job.batch_size,
                                 steps_per_epoch=job.steps_per_epoch, seed=job.seed, shuffle=job.shuffle,
                                 validation=validation, initial_epoch=initial_epoch, callbacks=callbacks)
        if comm.rank != 0:
            return None
        return serialization.result_to_bytes(serialization.model_to_bytes(model),
                                             reporting.merge_histories(earlier_history, history), initial_epoch)


def _starting_point(comm, checkpoints: Optional[CheckpointStore], reporter: TaskReporter) -> Checkpoint:
    """Rank 0 gets the model to start from, the newest checkpoint's or else the driver's, and sends it to
    every rank: only rank 0 touches storage and fetches from the driver (other ranks get no history).

    Read in the task, not on the driver: when Spark retries the stage after a lost task, the
    retry must start from what the failed attempt saved.
    """
    start = None
    if comm.rank == 0:
        start = (checkpoints.latest() if checkpoints is not None else None) or \
            Checkpoint(0, payloads.fetch(reporter, _MODEL), {}, "sync")
    header = comm.broadcast(np.array([start.epoch, len(start.model_bytes)] if start else [0, 0], np.int64))
    model = comm.broadcast(np.frombuffer(start.model_bytes, np.uint8) if start else np.empty(int(header[1]), np.uint8))
    return start or Checkpoint(int(header[0]), model.tobytes(), {}, "sync")


def limit_threads_to_task_cpus() -> None:
    """Keeps N tasks on one machine from each spawning a thread per core (oversubscription)."""
    import tensorflow as tf

    cpus = TaskContext.get().cpus()
    try:
        tf.config.threading.set_intra_op_parallelism_threads(cpus)
        tf.config.threading.set_inter_op_parallelism_threads(cpus)
    except RuntimeError:
        pass  # TensorFlow already initialised by an earlier task in this reused Python worker
