"""What each task of pipeline mode's barrier stage does: its stage of one replica, from its rows (or none) to its
trained state.

Task ``t`` is stage ``t % S`` of replica ``t // S``. Every task learns every shard's row counts, so that
all stages of a replica walk one schedule: the first stage feeds each step's features, the last its
labels, and the middle ones, which hold no rows, know each step's size from the shard's count
(``schedule.epoch_steps``). The last stage of replica 0 (the writer) reports progress and, with
checkpoints, gathers replica 0's stages into the whole model once an epoch and saves it; a stage
Spark retries resumes from the newest checkpoint, each task taking its own stage of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
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
from sparkdl.modes.base import Settings
from sparkdl.modes.pipeline import state, timeline
from sparkdl.modes.pipeline.cut import StagePlan, build_stage
from sparkdl.modes.pipeline.epoch import StageEpochs, StageMetrics, epoch_event

MODEL = "model"  # the whole model to start from, offered to the writer, which saves the checkpoints
_STATE_TAG = 1 << 20  # the tag of a stage's state sent to the writer


def stage_payload(stage: int) -> str:
    """The name under which the driver offers stage ``stage``'s weights and optimizer state."""
    return f"stage {stage}"


@dataclasses.dataclass(frozen=True)
class PipelineTask:
    """Everything a task needs but its stage's state (fetched from the driver's relay), shipped in the closure."""

    settings: Settings
    secret: bytes
    plan: StagePlan
    micro_batches: int
    compile_config: dict  # the whole model's: each stage's optimizer, the last stage's loss and metrics
    checkpoints: CheckpointStore | None = None
    start_history: dict = dataclasses.field(default_factory=dict)
    encrypt: bool = False
    profile: bool = False  # every stage records its micro-batches' events (``timeline``); the writer returns them


def read_report(extra: dict[str, np.ndarray]) -> tuple[dict, dict, int, dict | None]:
    """The writer's ``(history, stats, initial epoch, resumed history)``, from its result's extra arrays."""
    report = json.loads(extra["report"].tobytes().decode())
    return report["history"], report["stats"], report["initial_epoch"], report["resumed_history"]


def run_pipeline_task(batches: Iterable[pa.RecordBatch], reporter: TaskReporter, task: PipelineTask) -> bytes | None:
    use_tensorflow_backend()
    from sparkdl.modes.pipeline.engine import PipelineStage  # imports TensorFlow

    reporter.phase("import")
    settings, stages = task.settings, task.plan.num_stages
    rows, held_out = read_partition(settings.layout, batches)
    reporter.phase("read")
    with connect_collective(reporter, task.secret, settings.timeout, encrypt=task.encrypt) as comm:
        replica, stage = divmod(comm.rank, stages)
        counts = comm.allgather(np.array([len(rows), len(held_out)], np.int64))[::stages]  # each shard's, once
        schedule.require_rows(dict(enumerate(counts[:, 0].tolist())))  # no replica trains without rows
        settings = settings.for_rows(counts[:, 0].tolist())
        # Every rank forms every group (the communicator numbers them in call order): one per replica, one per stage.
        pipelines = [comm.split(range(r * stages, (r + 1) * stages)) for r in range(comm.size // stages)]
        copies = [comm.split(range(s, comm.size, stages)) for s in range(stages)] if comm.size > stages else None
        pipeline, replicas = pipelines[replica], (copies[stage] if copies else None)
        reporter.phase("connect")
        limit_threads_to_task_cpus()
        writer = comm.rank == stages - 1
        start, (weights, optimizer_state) = _starting_point(comm, task, reporter, stage, writer)
        model = build_stage(task.plan, stage, weights)
        model.compile_from_config(task.compile_config)
        state.restore_optimizer(model.optimizer, model.trainable_variables, optimizer_state)
        metrics = StageMetrics(model) if stage == stages - 1 else None
        events = timeline.StageTimeline() if task.profile else None
        epochs = StageEpochs(
            PipelineStage(
                model,
                pipeline,
                task.micro_batches,
                model.loss,
                model.optimizer,
                replicas=replicas,
                timeout=settings.timeout,
                observe=metrics.update if metrics is not None else None,
                timeline=events,
            ),
            settings,
            replica=replica,
            shard_rows=(int(counts[replica, 0]), int(counts[replica, 1])),
            pipeline=pipeline,
            replicas=replicas,
            metrics=metrics,
            report=reporter.progress if writer else None,
        )
        reporter.phase("model in")
        own_rows = (rows, held_out) if stage in (0, stages - 1) else (None, None)
        saving = task.checkpoints if writer else None
        history: dict[str, list[float]] = {}
        with Checkpointer(saving, start, "pipeline") if saving else contextlib.nullcontext() as checkpointer:
            if writer:
                event = {"event": "start", "initial_epoch": start.epoch, "steps_per_epoch": settings.steps_per_epoch}
                reporter.progress(event)
            whole = None  # the writer's whole model, for checkpoints
            for epoch in range(start.epoch, settings.epochs):
                started = time.monotonic()
                logs = epochs.run(epoch, *own_rows)
                for name, value in logs.items():
                    history.setdefault(name, []).append(value)
                if writer:
                    reporter.progress(epoch_event(epoch, logs, counts, time.monotonic() - started))
                if task.checkpoints is not None and replica == 0:
                    states = _gather_states(pipeline, model, writer)
                    if checkpointer is not None:
                        whole = whole or _whole_model(task, reporter, start)
                        state.assemble_state(whole, task.plan, states)
                        checkpointer.record(logs)
                        checkpointer.save(epoch + 1, serialization.model_to_bytes(whole))
        rows_of_stats = comm.allgather(epochs.summary_row())
        timelines = pipeline.gather(events.array(), root=stages - 1) if events is not None else None
        epochs.close()
        reporter.phase("train")
        if replica != 0:
            return None
        extra = {}
        if writer:
            stats = epochs.stats(task.plan, rows_of_stats[:stages])
            if timelines is not None:
                stats["timeline"] = timeline.events(timelines)
            report = {
                "history": history,
                "stats": {"pipeline": stats},
                "initial_epoch": start.epoch,
                "resumed_history": start.history if start.epoch != task.settings.initial_epoch else None,
            }
            extra["report"] = np.frombuffer(json.dumps(report).encode(), np.uint8)
        result = state.to_bytes(model.get_weights(), _optimizer_state(model), **extra)
        reporter.phase("model out")
        return result


def _optimizer_state(model) -> dict[str, np.ndarray]:
    return state.optimizer_arrays(model.optimizer, model.trainable_variables)


def _starting_point(comm, task: PipelineTask, reporter: TaskReporter, stage: int, writer: bool):
    """The checkpoint training starts from (the writer's view of it) and this stage's ``(weights, optimizer
    arrays)``: the driver's offer, or, where the writer finds a newer checkpoint (a stage Spark retried after
    its failed attempt saved), this stage's part of that one."""
    initial = task.settings.initial_epoch
    newer = task.checkpoints.latest(newer_than=initial) if writer and task.checkpoints is not None else None
    epoch = int(
        comm.broadcast(np.array([newer.epoch if newer else initial], np.int64), root=task.plan.num_stages - 1)[0]
    )
    if epoch == initial:
        weights, optimizer, _ = state.from_bytes(payloads.fetch(reporter, stage_payload(stage)))
        return Checkpoint(initial, b"", task.start_history, "pipeline"), (weights, optimizer)
    if newer is None:  # every other stage reads the checkpoint the writer found
        assert task.checkpoints is not None
        newer = task.checkpoints.latest(newer_than=initial)
        if newer is None or newer.epoch != epoch:
            raise RuntimeError(f"Pipeline stage {stage} found no checkpoint of epoch {epoch} in {task.checkpoints.uri}")
    whole = serialization.model_from_bytes(newer.model_bytes, task.settings.custom_objects)
    weights, optimizer, _ = state.from_bytes(state.stage_states(whole, task.plan, [stage])[0])
    return newer, (weights, optimizer)


def _gather_states(pipeline, model, writer: bool) -> list[bytes]:
    """Replica 0's stages' states at the writer (the others send theirs and get an empty list)."""
    own = state.to_bytes(model.get_weights(), _optimizer_state(model))
    if not writer:
        pipeline.send(np.frombuffer(own, np.uint8), pipeline.size - 1, tag=_STATE_TAG)
        return []
    return [pipeline.recv(s, tag=_STATE_TAG).tobytes() for s in range(pipeline.size - 1)] + [own]


def _whole_model(task: PipelineTask, reporter: TaskReporter, start: Checkpoint):
    """The whole model the writer saves checkpoints of (loaded once: the start's architecture and compile settings)."""
    model_bytes = start.model_bytes or payloads.fetch(reporter, MODEL)
    return serialization.model_from_bytes(model_bytes, task.settings.custom_objects)
