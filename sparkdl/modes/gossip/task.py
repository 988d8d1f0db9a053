"""What each task of gossip mode's barrier stage does, from its Arrow partition to rank 0's averaged result."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from sparkdl.checkpoint import Checkpointer, CheckpointStore
from sparkdl.data import read_partition
from sparkdl.keras import callbacks, serialization
from sparkdl.keras.optimizer_hooks import saved_form
from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend
from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.stage import connect_collective
from sparkdl.modes import whole_replicas
from sparkdl.modes.base import Settings
from sparkdl.modes.gossip import replicas, training

MODE = "gossip"


@dataclasses.dataclass(frozen=True)
class GossipTask:
    """Everything a task needs but the model (fetched from the driver's relay by rank 0), shipped in the closure."""

    settings: Settings
    secret: bytes
    gossip_every: int = 1
    peers: str = "ring"
    start_history: dict = dataclasses.field(default_factory=dict)  # of the epochs a resumed fit trained already
    checkpoints: CheckpointStore | None = None  # rank 0 saves the average after every epoch; a retried stage resumes
    encrypt: bool = False  # seal the links: the session runs with spark.network.crypto.enabled


def run_gossip_task(batches: Iterable[pa.RecordBatch], reporter: TaskReporter, task: GossipTask) -> bytes | None:
    use_tensorflow_backend()  # before anything in this worker imports Keras
    import keras  # noqa: F401 -- loads TensorFlow unless this Python worker has it already

    reporter.phase("import")
    settings = task.settings
    rows, held_out = read_partition(settings.layout, batches)
    reporter.phase("read")
    with connect_collective(reporter, task.secret, settings.timeout, encrypt=task.encrypt) as comm:
        settings, counts = whole_replicas.rows_of_ranks(comm, rows, held_out, settings)
        rows_per_rank, validation_rows = counts[:, 0], counts[:, 1]
        reporter.phase("connect")
        limit_threads_to_task_cpus()
        start = whole_replicas.starting_point(comm, reporter, task.settings, task.checkpoints, task.start_history, MODE)
        model = serialization.model_from_bytes(start.model_bytes, settings.custom_objects)
        reporter.phase("model in")
        validation = whole_replicas.Validation(held_out, validation_rows) if settings.validate else None
        extra = list(settings.callbacks)
        saving = task.checkpoints if comm.rank == 0 else None
        with Checkpointer(saving, start, MODE) if saving is not None else contextlib.nullcontext() as checkpointer:
            if comm.rank == 0:  # the metrics are combined on every rank: one of them reports for all
                reporter.progress(
                    {"event": "start", "initial_epoch": start.epoch, "steps_per_epoch": settings.steps_per_epoch}
                )
                extra.insert(
                    0,
                    callbacks.progress_callback(
                        reporter.progress,
                        steps_per_epoch=settings.steps_per_epoch,
                        rows_per_epoch=int(rows_per_rank.sum()),
                        validation_rows=int(validation_rows.sum()),
                    ),
                )
            history, counters = training.train(
                model,
                rows,
                comm=comm,
                settings=settings,
                initial_epoch=start.epoch,
                gossip_every=task.gossip_every,
                peers=task.peers,
                validation=validation,
                callbacks=extra,
                save=_saver(model, checkpointer) if checkpointer is not None else None,
                saves_each_epoch=task.checkpoints is not None,
            )
        stats = _stats(comm, task, counters)
        with replicas.averaged(model, comm, keep=True) as on_rank_0:  # the result: the replicas' average
            result = serialization.model_to_bytes(model) if on_rank_0 else None
        reporter.phase("train")
        if result is None:
            return None
        answer = serialization.result_to_bytes(
            result,
            history,
            start.epoch,
            {"gossip": stats},
            start.history if start.epoch != task.settings.initial_epoch else None,
        )
        reporter.phase("model out")
        return answer


def _saver(model, checkpointer: Checkpointer):
    """Rank 0's checkpoint writer: records the epoch's (combined) metrics and saves the model it holds now, the
    replicas' average (``replicas.averaged``), as the user's own optimizer class."""

    def save(epoch: int, logs: dict) -> None:
        checkpointer.record(callbacks.numeric_logs(logs))
        with saved_form(model):
            model_bytes = serialization.model_to_bytes(model)
        checkpointer.save(epoch + 1, model_bytes)

    return save


def _stats(comm, task: GossipTask, counters: dict) -> dict:
    """``FitResult.stats["gossip"]``: the settings, each rank's traffic and waiting, and the spread per epoch.
    Collective (an allgather of three numbers per rank)."""
    rounds = counters["rounds"]
    row = np.array([rounds, counters["bytes_sent"], counters["wait_seconds"]], np.float64)
    table = comm.allgather(row)
    return {
        "peers": task.peers,
        "gossip_every": task.gossip_every,
        "rounds": int(rounds),  # the same on every rank
        "bytes_sent": [int(b) for b in table[:, 1]],
        "bytes_per_exchange": [int(b // r) if r else 0 for r, b in zip(table[:, 0], table[:, 1])],
        "wait_seconds": table[:, 2].tolist(),
        "epochs": [s["epoch"] for s in counters["spreads"]],
        "spread": [s["spread"] for s in counters["spreads"]],
        "distances": [s["distances"] for s in counters["spreads"]],
    }
