"""What each task of sync mode's barrier stage does, from its Arrow partition to rank 0's result."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from sparkdl import schedule
from sparkdl.checkpoint import Checkpoint, Checkpointer, CheckpointStore
from sparkdl.data import read_partition
from sparkdl.keras import callbacks, serialization
from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend
from sparkdl.launch import payloads
from sparkdl.launch.backends import trainer_communicator
from sparkdl.launch.forward import TaskReporter
from sparkdl.modes.base import Settings
from sparkdl.modes.sync import replicas
from sparkdl.modes.sync.step_profile import StepProfile

MODEL = "model"  # the name the driver offers the model to start from


@dataclasses.dataclass(frozen=True)
class SyncTask:
    """Everything a task needs but the model, shipped from the driver in the task closure.

    The model, which may be far larger than a closure should be (a Spark Connect
    message, the driver JVM's heap), is fetched from the driver's relay by rank 0.
    """

    settings: Settings
    secret: bytes
    start_history: dict = dataclasses.field(default_factory=dict)  # of the epochs a resumed fit trained already
    backend: str = "ring"  # whose collectives average the gradients: sparkdl's ring or Horovod's
    checkpoints: CheckpointStore | None = None  # rank 0 saves after every epoch (and a retried stage resumes)
    encrypt: bool = False  # seal the ring's links: the session runs with spark.network.crypto.enabled
    compression: str | None = None  # gradients on the wire as "bf16"/"fp16" (``sparkdl.collective.compression``)
    overlap: bool = True  # gradient buckets start moving while backprop runs (``reducer``)
    profile: bool = False  # every rank times each step's phases (``step_profile``); rank 0 returns them
    shard: bool = False  # mode="sharded": each rank keeps 1/N of the optimizer state (``sharded``)

    @property
    def mode(self) -> str:
        return "sharded" if self.shard else "sync"


def run_sync_task(batches: Iterable[pa.RecordBatch], reporter: TaskReporter, task: SyncTask) -> bytes | None:
    use_tensorflow_backend()  # before anything in this worker imports Keras
    import keras  # noqa: F401 -- loads TensorFlow unless this Python worker has it already

    reporter.phase("import")
    settings = task.settings
    rows, held_out = read_partition(settings.layout, batches)
    reporter.phase("read")
    with trainer_communicator(task.backend, reporter, task.secret, settings.timeout, encrypt=task.encrypt) as comm:
        # Every rank learns every rank's training and validation row counts, so that all of them take
        # the same decisions below (raise, validate, how to weigh validation metrics) with no further talk.
        counts = comm.allgather(np.array([len(rows), len(held_out)], np.int64))
        rows_per_rank, validation_rows = counts[:, 0], counts[:, 1]
        schedule.require_rows(dict(enumerate(rows_per_rank.tolist())))
        settings = settings.for_rows(rows_per_rank.tolist())  # every rank: the same steps per epoch
        if comm.rank == 0:
            schedule.warn_fillers(rows_per_rank.tolist(), settings.steps_per_epoch)
        if settings.validate and validation_rows.sum() == 0:
            raise ValueError("No worker partition got a validation row: the validation set is empty.")
        reporter.phase("connect")
        limit_threads_to_task_cpus()
        start = _starting_point(comm, task, reporter)
        model = serialization.model_from_bytes(start.model_bytes, settings.custom_objects)
        reporter.phase("model in")
        validation = replicas.Validation(held_out, validation_rows) if settings.validate else None
        extra = list(settings.callbacks)
        saving = task.checkpoints if comm.rank == 0 else None  # rank 0 saves, where checkpoints are asked for
        with Checkpointer(saving, start, task.mode) if saving is not None else contextlib.nullcontext() as checkpointer:
            if comm.rank == 0:  # the ranks hold the same model and (combined) metrics: one of them reports and saves
                reporter.progress(
                    {"event": "start", "initial_epoch": start.epoch, "steps_per_epoch": settings.steps_per_epoch}
                )
                extra.insert(
                    0,
                    callbacks.progress_callback(  # for all ranks: every training row, all held-out rows
                        reporter.progress,
                        steps_per_epoch=settings.steps_per_epoch,
                        rows_per_epoch=int(rows_per_rank.sum()),
                        validation_rows=int(validation_rows.sum()),
                    ),
                )
            if checkpointer is not None:
                extra.insert(0, callbacks.checkpoint_callback(checkpointer))
            profile = StepProfile() if task.profile else None
            history, stats = replicas.train(
                model,
                rows,
                comm=comm,
                settings=settings,
                rows_per_rank=rows_per_rank.tolist(),
                initial_epoch=start.epoch,
                validation=validation,
                callbacks=extra,
                exchange=replicas.Exchange(task.compression, task.overlap, profile, task.shard),
                saves_each_epoch=task.checkpoints is not None,
            )
        if profile is not None:
            stats["step_profile"] = profile.summary(comm)
        reporter.phase("train")
        if comm.rank != 0:
            return None
        result = serialization.result_to_bytes(
            serialization.model_to_bytes(model),
            history,
            start.epoch,
            stats,
            start.history if start.epoch != task.settings.initial_epoch else None,
        )
        reporter.phase("model out")
        return result


def _starting_point(comm, task: SyncTask, reporter: TaskReporter) -> Checkpoint:
    """Rank 0 gets the model to start from and sends it to every rank (other ranks get no history).

    The driver offers what it resumes from (``Job.start``); rank 0 prefers a newer checkpoint, which
    exists only when Spark retried the stage after a lost task and the failed attempt saved more.
    """
    start = None
    if comm.rank == 0:
        settings = task.settings
        if task.checkpoints is not None:
            start = task.checkpoints.latest(newer_than=settings.initial_epoch)
        if start is None:
            start = Checkpoint(settings.initial_epoch, payloads.fetch(reporter, MODEL), task.start_history, task.mode)
    header = comm.broadcast(np.array([start.epoch, len(start.model_bytes)] if start else [0, 0], np.int64))
    model = comm.broadcast(np.frombuffer(start.model_bytes, np.uint8) if start else np.empty(int(header[1]), np.uint8))
    return start or Checkpoint(int(header[0]), model.tobytes(), {}, task.mode)
