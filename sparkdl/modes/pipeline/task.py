"""What each task of pipeline mode's barrier stage does: its stage of one replica, from its rows (or none) to its
trained state.

Task ``t`` is stage ``t % S`` of replica ``t // S``. Every task learns every shard's row counts, so that
all stages of a replica walk one schedule: the first stage feeds each step's features, the last its
labels, and the middle ones, which hold no rows, know each step's size from the shard's count
(``schedule.epoch_steps``). The last stage of replica 0 (the writer) reports progress and, with
checkpoints, gathers replica 0's stages into the whole model once an epoch and saves it; a stage
Spark retries resumes from the newest checkpoint, each task taking its own stage of it. Step checkpoints
(``checkpoint_every``) are taken the same way mid-epoch, at the steps every task agrees on
(``Ranks.step_checkpoints``); a stage that resumes from one trains the epoch's steps left first
(``sparkdl.position``: the replicas are its shards), then the whole epochs.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from sparkdl.checkpoint import Checkpoint
from sparkdl.keras import random_state, serialization
from sparkdl.launch import payloads
from sparkdl.modes.barrier import Ranks
from sparkdl.modes.pipeline import state, timeline
from sparkdl.modes.pipeline.cut import build_stage
from sparkdl.modes.pipeline.epoch import AssembledCheckpoints, StageEpochs, StageMetrics, train_epochs

if TYPE_CHECKING:
    from sparkdl.modes.pipeline.mode import PipelinePlan

_STATE_TAG = 1 << 20  # the tag of a stage's state sent to the writer
_DRAWS = "seed_draws"  # a gathered stage state's array: its generators' draws


def stage_payload(stage: int) -> str:
    """The name under which the driver offers stage ``stage``'s weights and optimizer state."""
    return f"stage {stage}"


def read_report(extra: dict[str, np.ndarray]) -> tuple[dict, dict, int, dict | None]:
    """The writer's ``(history, stats, initial epoch, resumed history)``, from its result's extra arrays."""
    report = json.loads(extra["report"].tobytes().decode())
    return report["history"], report["stats"], report["initial_epoch"], report["resumed_history"]


def train(plan: PipelinePlan, ranks: Ranks) -> bytes | None:
    from sparkdl.modes.pipeline.engine import PipelineStage  # imports TensorFlow

    comm, settings, stages = ranks.comm, ranks.settings, plan.stages.num_stages
    replica, stage = divmod(comm.rank, stages)
    # Every rank forms every group (the communicator numbers them in call order): one per replica, one per stage.
    pipelines = [comm.split(range(r * stages, (r + 1) * stages)) for r in range(comm.size // stages)]
    copies = [comm.split(range(s, comm.size, stages)) for s in range(stages)] if comm.size > stages else None
    pipeline, replicas = pipelines[replica], (copies[stage] if copies else None)
    start, (weights, optimizer_state) = _starting_point(plan, ranks, stage)
    model = build_stage(plan.stages, stage, weights)
    model.compile_from_config(plan.compile_config)
    state.restore_optimizer(model.optimizer, model.trainable_variables, optimizer_state)
    _start_random_state(model, pipeline, settings.seed, replica, start.arrays.get(random_state.DRAWS))
    metrics = StageMetrics(model) if stage == stages - 1 else None
    events = timeline.StageTimeline() if plan.profile else None
    epochs = StageEpochs(
        PipelineStage(
            model,
            pipeline,
            plan.micro_batches,
            model.loss,
            model.optimizer,
            schedule=plan.schedule,
            replicas=replicas,
            timeout=settings.timeout,
            observe=metrics.update_state if metrics is not None else None,
            timeline=events,
        ),
        settings,
        replica=replica,
        shard_rows=(int(ranks.counts[replica, 0]), int(ranks.counts[replica, 1])),
        pipeline=pipeline,
        replicas=replicas,
        metrics=metrics,
        report=ranks.reporter.progress if ranks.writer else None,
    )
    ranks.reporter.phase("model in")
    own_rows = (ranks.rows, ranks.held_out) if stage in (0, stages - 1) else (None, None)
    rest = ranks.epoch_rest(start)  # the replicas are the shards: each one's first and last stage hold its rows
    step_checkpoints = ranks.step_checkpoints(every_rank=True)  # replica 0's stages send their state for each
    with ranks.checkpointing(start) as checkpointer:
        whole = None  # the writer's whole model, for checkpoints
        draws = np.empty(0, np.int64)  # its generators' draws, the stages' in order, with the last states gathered

        def assemble():
            nonlocal whole, draws
            states = _gather_states(pipeline, model, ranks.writer)  # replica 0's stages send theirs to the writer
            if checkpointer is None:
                return None
            whole = whole or ranks.whole_model(start)
            extras = state.assemble_state(whole, plan.stages, states)
            draws = np.concatenate([extra[_DRAWS] for extra in extras])
            return whole

        saving = ranks.task.checkpoints is not None and replica == 0
        saves = AssembledCheckpoints(ranks, checkpointer, assemble, rest, lambda: draws) if saving else None
        history = train_epochs(
            epochs, ranks, start.epoch, own_rows, saves, rest=rest, step_checkpoints=step_checkpoints
        )
    rows_of_stats = comm.allgather(epochs.summary_row())
    timelines = pipeline.gather(events.array(), root=stages - 1) if events is not None else None
    epochs.close()
    ranks.reporter.phase("train")
    if replica != 0:
        return None
    extra = {}
    if ranks.writer:
        stats = epochs.stats(plan.stages, rows_of_stats[:stages])
        if timelines is not None:
            stats["timeline"] = timeline.events(timelines)
        report = {
            "history": history,
            "stats": {"pipeline": stats, **ranks.checkpoint_stats(start, step_checkpoints)},
            "initial_epoch": start.epoch,
            "resumed_history": start.history if start.epoch != settings.initial_epoch else None,
        }
        extra["report"] = np.frombuffer(json.dumps(report).encode(), np.uint8)
    result = state.to_bytes(model.get_weights(), _optimizer_state(model), **extra)
    ranks.reporter.phase("model out")
    return result


def _optimizer_state(model) -> dict[str, np.ndarray]:
    return state.optimizer_arrays(model.optimizer, model.trainable_variables)


def _starting_point(plan: PipelinePlan, ranks: Ranks, stage: int) -> tuple[Checkpoint, tuple]:
    """The checkpoint training starts from (the writer's view of it) and this stage's ``(weights, optimizer
    arrays)``: the driver's offer, or this stage's part of a newer checkpoint."""
    newer = ranks.newer_checkpoint()
    if newer is None:
        weights, optimizer, _ = state.from_bytes(payloads.fetch(ranks.reporter, stage_payload(stage)))
        return ranks.part_start(), (weights, optimizer)
    whole = serialization.model_from_bytes(newer.model_bytes, ranks.settings.custom_objects)
    weights, optimizer, _ = state.from_bytes(state.stage_states(whole, plan.stages, [stage])[0])
    return newer, (weights, optimizer)


def _start_random_state(model, pipeline, seed: int, replica: int, saved: np.ndarray | None) -> None:
    """Collective over the replica's stages: seeds the stage's generators (Dropout's) as ``random_state.start`` seeds
    the whole model's, for ``replica``, at ``saved`` draws (a checkpoint's): the stages' generators, in stage order,
    are the whole model's."""
    own = len(random_state.generators(model))
    counts = [int(np.asarray(count).reshape(-1)[0]) for count in pipeline.allgather(np.array([own], np.int64))]
    first = sum(counts[: pipeline.rank])
    random_state.start(model, seed=seed, rank=replica, saved=saved, first=first, total=sum(counts))


def _gather_states(pipeline, model, writer: bool) -> list[bytes]:
    """Replica 0's stages' states at the writer (the others send theirs and get an empty list), each with its
    generators' draws."""
    own = state.to_bytes(model.get_weights(), _optimizer_state(model), **{_DRAWS: random_state.draws(model)})
    if not writer:
        pipeline.send(np.frombuffer(own, np.uint8), pipeline.size - 1, tag=_STATE_TAG)
        return []
    return [pipeline.recv(s, tag=_STATE_TAG).tobytes() for s in range(pipeline.size - 1)] + [own]
