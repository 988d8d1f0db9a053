"""Sync mode: the barrier stage, and what each of its tasks does from its Arrow partition to rank 0's result."""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Iterable, Optional

import numpy as np
import pyarrow as pa
from pyspark import TaskContext

from sparkdl import data
from sparkdl.launch import run_tasks
from sparkdl.launch.backends import trainer_communicator
from sparkdl.train import serialization, sync


@dataclasses.dataclass(frozen=True)
class SyncJob:
    """Everything a task needs, shipped from the driver in the task closure."""

    model_bytes: bytes
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


def run_sync(training: data.TrainingData, *, model_bytes: bytes, num_workers: int, epochs: int, batch_size: int,
             steps_per_epoch: int, seed: int, shuffle: bool, timeout: float,
             custom_objects: Optional[dict], backend: str = "ring") -> tuple[bytes, dict[str, list[float]]]:
    """Runs sync training as one barrier stage; returns rank 0's trained ``.keras`` bytes and the history."""
    job = SyncJob(
        model_bytes=model_bytes,
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
    )
    results = run_tasks(training.frame, num_workers, lambda batches: run_sync_task(batches, job), barrier=True,
                        timeout=timeout)
    return serialization.result_from_bytes(results[0])


def run_sync_task(batches: Iterable[pa.RecordBatch], job: SyncJob) -> Optional[bytes]:
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
        model = serialization.model_from_bytes(job.model_bytes, job.custom_objects)
        validation = sync.Validation(x_val, y_val, validation_rows) if job.validate else None
        history = sync.train(model, x, y, comm=comm, epochs=job.epochs, batch_size=job.batch_size,
                             steps_per_epoch=job.steps_per_epoch, seed=job.seed, shuffle=job.shuffle,
                             validation=validation)
        if comm.rank != 0:
            return None
        return serialization.result_to_bytes(serialization.model_to_bytes(model), history)


def limit_threads_to_task_cpus() -> None:
    """Keeps N tasks on one machine from each spawning a thread per core (oversubscription)."""
    import tensorflow as tf

    cpus = TaskContext.get().cpus()
    try:
        tf.config.threading.set_intra_op_parallelism_threads(cpus)
        tf.config.threading.set_inter_op_parallelism_threads(cpus)
    except RuntimeError:
        pass  # TensorFlow already initialised by an earlier task in this reused Python worker
