"""What each task of sync mode's barrier stage does, from its Arrow partition to rank 0's result."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable

import pyarrow as pa

from sparkdl.checkpoint import Checkpointer, CheckpointStore
from sparkdl.data import read_partition
from sparkdl.keras import callbacks, serialization
from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend
from sparkdl.launch.backends import trainer_communicator
from sparkdl.launch.forward import TaskReporter
from sparkdl.modes import whole_replicas
from sparkdl.modes.base import Settings
from sparkdl.modes.sync import replicas, sharded
from sparkdl.modes.sync.step_profile import StepProfile


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
        settings, counts = whole_replicas.rows_of_ranks(comm, rows, held_out, settings)
        rows_per_rank, validation_rows = counts[:, 0], counts[:, 1]
        reporter.phase("connect")
        limit_threads_to_task_cpus()
        start = whole_replicas.starting_point(
            comm, reporter, task.settings, task.checkpoints, task.start_history, task.mode
        )
        if task.shard:
            sharded.count_optimizers_from_now()  # an earlier fit's in this reused worker are not this one's
        model = serialization.model_from_bytes(start.model_bytes, settings.custom_objects)
        reporter.phase("model in")
        validation = whole_replicas.Validation(held_out, validation_rows) if settings.validate else None
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
        stats["wire_bytes"] = whole_replicas.wire_bytes(comm)
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
