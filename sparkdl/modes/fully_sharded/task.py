"""What each task of a fully sharded fit does: its replica trained on its rows, holding 1/N of the weights, and rank
0's writing (progress, the whole model in checkpoints and in the result).

Every rank receives only its part of the model from the driver (``state.rank_part``) and builds its
units without weights (``engine.FullyShardedReplica``). Its epochs run as a pipeline stage's do
(``pipeline.epoch.StageEpochs``, the whole model being one stage): each rank's rows on the schedule
every mode follows, its gradient weighed by its rows, the loss and metrics combined over the ranks by
rows, BatchNorm's statistics averaged after each epoch's last step. Rank 0 gathers the shards into the
whole model for each checkpoint and for the result; a stage Spark retries resumes from the newest
checkpoint, each rank cutting its own part of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from sparkdl import schedule
from sparkdl.checkpoint import Checkpoint, Checkpointer, CheckpointStore
from sparkdl.data import read_partition
from sparkdl.keras import serialization
from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend
from sparkdl.launch import payloads
from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.stage import connect_collective
from sparkdl.modes import whole_replicas
from sparkdl.modes.base import Settings
from sparkdl.modes.fully_sharded import state
from sparkdl.modes.pipeline.cut import StagePlan
from sparkdl.modes.pipeline.epoch import StageEpochs, StageMetrics, epoch_event
from sparkdl.modes.sync import sharded
from sparkdl.modes.sync.sharded import ShardLayout

MODE = "sharded"  # the mode checkpoints record


def rank_payload(rank: int) -> str:
    """The name under which the driver offers rank ``rank``'s part of the model."""
    return f"rank {rank}"


@dataclasses.dataclass(frozen=True)
class FullyShardedTask:
    """Everything a task needs but its part of the model (fetched from the driver's relay), shipped in the closure."""

    settings: Settings
    secret: bytes
    plan: StagePlan  # the units
    layout: ShardLayout  # where each unit's weights lie in each rank's shard
    compile_config: dict  # the whole model's: its loss, metrics and optimizer
    compression: str | None = None  # gradients on the wire as "bf16"/"fp16"
    overlap: bool = True  # gathers run ahead of the compute, reduce-scatters behind it
    checkpoints: CheckpointStore | None = None
    start_history: dict = dataclasses.field(default_factory=dict)
    encrypt: bool = False


def run_fully_sharded_task(batches: Iterable[pa.RecordBatch], reporter: TaskReporter, task: FullyShardedTask):
    use_tensorflow_backend()
    import keras

    from sparkdl.modes.fully_sharded.engine import FullyShardedReplica  # imports TensorFlow

    reporter.phase("import")
    settings = task.settings
    rows, held_out = read_partition(settings.layout, batches)
    reporter.phase("read")
    with connect_collective(reporter, task.secret, settings.timeout, encrypt=task.encrypt) as comm:
        settings, counts = whole_replicas.rows_of_ranks(comm, rows, held_out, settings)
        rows_per_rank = counts[:, 0].tolist()
        reporter.phase("connect")
        limit_threads_to_task_cpus()
        keras.utils.set_random_seed(settings.seed + comm.rank)  # dropout differs per rank, as in sync mode
        writer = comm.rank == 0
        sharded.count_optimizers_from_now()  # an earlier fit's in this reused worker are not this one's
        start, part = _starting_point(comm, task, reporter)
        replica = FullyShardedReplica.from_part(
            task.plan,
            task.layout,
            comm,
            part,
            task.compile_config,
            scales=schedule.gradient_scales(rows_per_rank, comm.rank, settings.steps_per_epoch),
            first_step=start.epoch * settings.steps_per_epoch,
            compression=task.compression,
            overlap=task.overlap,
            timeout=settings.timeout,
        )
        del part
        metrics = StageMetrics(replica.model)
        replica.observe = metrics.update
        epochs = StageEpochs(
            replica,
            settings,
            replica=comm.rank,
            shard_rows=(len(rows), len(held_out)),
            pipeline=None,
            replicas=comm,
            metrics=metrics,
            report=reporter.progress if writer else None,
            settle=replica.average_statistics,
            validation_steps=max(-(-int(v) // settings.batch_size) for v in counts[:, 1]),
        )
        reporter.phase("model in")
        history: dict[str, list[float]] = {}
        whole = None  # rank 0's whole model, for checkpoints and the result
        saving = task.checkpoints if writer else None
        with Checkpointer(saving, start, MODE) if saving else contextlib.nullcontext() as checkpointer:
            if writer:
                event = {"event": "start", "initial_epoch": start.epoch, "steps_per_epoch": settings.steps_per_epoch}
                reporter.progress(event)
            for epoch in range(start.epoch, settings.epochs):
                started = time.monotonic()
                logs = epochs.run(epoch, rows, held_out)
                for name, value in logs.items():
                    history.setdefault(name, []).append(value)
                if writer:
                    reporter.progress(epoch_event(epoch, logs, counts, time.monotonic() - started))
                if task.checkpoints is not None:
                    gathered = replica.gather_state()
                    if checkpointer is not None:
                        whole = _assembled(whole, task, reporter, start, gathered)
                        checkpointer.record(logs)
                        checkpointer.save(epoch + 1, serialization.model_to_bytes(whole))
        stats: dict = {"fully_sharded": _stats(replica, comm)}
        gathered = replica.gather_state()
        stats["wire_bytes"] = whole_replicas.wire_bytes(comm)
        replica.close()
        reporter.phase("train")
        if not writer:
            return None
        whole = _assembled(whole, task, reporter, start, gathered)
        resumed = start.history if start.epoch != task.settings.initial_epoch else None
        result = serialization.result_to_bytes(
            serialization.model_to_bytes(whole), history, start.epoch, stats, resumed
        )
        reporter.phase("model out")
        return result


def _starting_point(comm, task: FullyShardedTask, reporter: TaskReporter) -> tuple[Checkpoint, dict]:
    """The checkpoint training starts from (rank 0's view of it) and this rank's part of the model: the driver's
    offer, or, where rank 0 finds a newer checkpoint (a stage Spark retried after its failed attempt saved), this
    rank's part of that one (each rank loads it whole for a moment to cut its part)."""
    initial = task.settings.initial_epoch
    newer = task.checkpoints.latest(newer_than=initial) if comm.rank == 0 and task.checkpoints is not None else None
    epoch = int(comm.broadcast(np.array([newer.epoch if newer else initial], np.int64), root=0)[0])
    if epoch == initial:
        part = state.read_part(payloads.fetch(reporter, rank_payload(comm.rank)))
        return Checkpoint(initial, b"", task.start_history, MODE), part
    if newer is None:  # every other rank reads the checkpoint rank 0 found
        assert task.checkpoints is not None
        newer = task.checkpoints.latest(newer_than=initial)
        if newer is None or newer.epoch != epoch:
            raise RuntimeError(f"Rank {comm.rank} found no checkpoint of epoch {epoch} in {task.checkpoints.uri}")
    whole = serialization.model_from_bytes(newer.model_bytes, task.settings.custom_objects)
    return newer, state.read_part(state.rank_part(whole, task.plan, task.layout, comm.rank))


def _assembled(whole, task: FullyShardedTask, reporter: TaskReporter, start: Checkpoint, gathered):
    """Rank 0's whole model (loaded once: the start's architecture and compile settings) holding ``gathered``."""
    if whole is None:
        model_bytes = start.model_bytes or payloads.fetch(reporter, whole_replicas.MODEL)
        whole = serialization.model_from_bytes(model_bytes, task.settings.custom_objects)
    state.assemble(whole, task.plan, *gathered)
    return whole


def _stats(replica, comm) -> dict:
    """``FitResult.stats["fully_sharded"]``: the bytes every rank held (measured in its task: of optimizer state,
    whatever its process holds) and its seconds."""
    held = {**replica.held_bytes(), "optimizer_bytes": sharded.held_optimizer_bytes()}
    keys = sorted(held)
    rows = comm.allgather(np.array([held[k] for k in keys], np.int64))
    summary = replica.summary()
    return {
        "ranks": [dict(zip(keys, (int(v) for v in row))) for row in rows],
        "units": len(replica.units),
        **summary,
    }
