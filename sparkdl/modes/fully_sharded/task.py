"""What each task of a fully sharded fit does: its replica trained on its rows, holding 1/N of the weights, and rank
0's writing (progress, the whole model in checkpoints and in the result).

Every rank receives only its part of the model from the driver (``state.rank_part``) and builds its
units without weights (``engine.FullyShardedReplica``). Its epochs run as a pipeline stage's do
(``pipeline.epoch.StageEpochs``, the whole model being one stage): each rank's rows on the schedule
every mode follows, its gradient weighed by its rows, the loss and metrics combined over the ranks by
rows, BatchNorm's statistics averaged after each epoch's last step. Rank 0 gathers the shards into the
whole model for each checkpoint (at epoch ends, and mid-epoch at the steps every rank agrees on:
``Ranks.step_checkpoints``) and for the result; a stage Spark retries resumes from the newest
checkpoint, each rank cutting its own part of it, inside its epoch where that is a step checkpoint (the
epoch's steps left, ``sparkdl.position``, then the whole epochs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sparkdl import schedule
from sparkdl.checkpoint import Checkpoint
from sparkdl.keras import random_state, serialization
from sparkdl.launch import payloads
from sparkdl.modes import whole_replicas
from sparkdl.modes.barrier import Ranks
from sparkdl.modes.fully_sharded import state
from sparkdl.modes.pipeline.epoch import AssembledCheckpoints, StageEpochs, StageMetrics, train_epochs
from sparkdl.modes.sync import sharded
from sparkdl.position import step_scales

if TYPE_CHECKING:
    from sparkdl.modes.fully_sharded.driver import Zero3Plan


def rank_payload(rank: int) -> str:
    """The name under which the driver offers rank ``rank``'s part of the model."""
    return f"rank {rank}"


def train(plan: Zero3Plan, ranks: Ranks) -> bytes | None:
    import keras

    from sparkdl.modes.fully_sharded.engine import FullyShardedReplica  # imports TensorFlow

    comm, settings = ranks.comm, ranks.settings
    assert plan.sharding is not None  # placed on the driver (``Zero3Plan.run``)
    keras.utils.set_random_seed(settings.seed + comm.rank)  # dropout differs per rank, as in sync mode
    sharded.count_optimizers_from_now()  # an earlier fit's in this reused worker are not this one's
    start, part = _starting_point(plan, ranks)
    rest = ranks.epoch_rest(start)
    per_epoch = schedule.gradient_scales(ranks.counts[:, 0].tolist(), comm.rank, settings.steps_per_epoch)
    replica = FullyShardedReplica.from_part(
        plan.units,
        plan.sharding,
        comm,
        part,
        plan.compile_config,
        scales=step_scales(per_epoch, rest, comm.rank),
        compression=plan.compression,
        overlap=plan.overlap,
        kept_gathered=plan.kept_gathered,
        timeout=settings.timeout,
    )
    del part
    replica.start_random_state(seed=settings.seed, rank=comm.rank, saved=start.arrays.get(random_state.DRAWS))
    metrics = StageMetrics(replica.model)
    replica.observe = metrics.update
    epochs = StageEpochs(
        replica,
        settings,
        replica=comm.rank,
        shard_rows=(len(ranks.rows), len(ranks.held_out)),
        pipeline=None,
        replicas=comm,
        metrics=metrics,
        report=ranks.reporter.progress if ranks.writer else None,
        settle=replica.average_statistics,
        validation_steps=max(-(-int(v) // settings.batch_size) for v in ranks.counts[:, 1]),
    )
    ranks.reporter.phase("model in")
    whole = None  # the writer's whole model, for checkpoints and the result
    step_checkpoints = ranks.step_checkpoints(every_rank=True)  # every rank sends its shards for each
    with ranks.checkpointing(start) as checkpointer:

        def assemble():
            nonlocal whole
            gathered = replica.gather_state()  # collective: every rank takes part
            if checkpointer is None:
                return None
            whole = _assembled(whole, plan, ranks, start, gathered)
            return whole

        saves = (
            AssembledCheckpoints(ranks, checkpointer, assemble, rest, replica.seed_draws)
            if ranks.task.checkpoints
            else None
        )
        own_rows = (ranks.rows, ranks.held_out)
        history = train_epochs(
            epochs, ranks, start.epoch, own_rows, saves, rest=rest, step_checkpoints=step_checkpoints
        )
    stats: dict = {"fully_sharded": _stats(replica, comm), **ranks.checkpoint_stats(start, step_checkpoints)}
    gathered = replica.gather_state()
    stats["wire_bytes"] = whole_replicas.wire_bytes(comm)
    replica.close()
    ranks.reporter.phase("train")
    if not ranks.writer:
        return None
    whole = _assembled(whole, plan, ranks, start, gathered)
    result = ranks.result(serialization.model_to_bytes(whole), history, start, stats)
    ranks.reporter.phase("model out")
    return result


def _starting_point(plan: Zero3Plan, ranks: Ranks) -> tuple[Checkpoint, dict]:
    """The checkpoint training starts from (the writer's view of it) and this rank's part of the model: the driver's
    offer, or this rank's part of a newer checkpoint (each rank loads it whole for a moment to cut its part)."""
    assert plan.sharding is not None
    newer = ranks.newer_checkpoint()
    if newer is None:
        return ranks.part_start(), state.read_part(payloads.fetch(ranks.reporter, rank_payload(ranks.rank)))
    whole = serialization.model_from_bytes(newer.model_bytes, ranks.settings.custom_objects)
    return newer, state.read_part(state.rank_part(whole, plan.units, plan.sharding, ranks.rank))


def _assembled(whole, plan: Zero3Plan, ranks: Ranks, start: Checkpoint, gathered):
    """The writer's whole model (loaded once: the start's architecture and compile settings) holding ``gathered``."""
    if whole is None:
        whole = ranks.whole_model(start)
    state.assemble(whole, plan.units, *gathered)
    return whole


def _stats(replica, comm) -> dict:
    """``FitResult.stats["fully_sharded"]``: the bytes every rank held (measured in its task: of optimizer state,
    whatever its process holds), its seconds, the units and how many kept their gathered weights to their backward
    pass."""
    held = {**replica.held_bytes(), "optimizer_bytes": sharded.held_optimizer_bytes()}
    keys = sorted(held)
    rows = comm.allgather(np.array([held[k] for k in keys], np.int64))
    summary = replica.summary()
    return {
        "ranks": [dict(zip(keys, (int(v) for v in row))) for row in rows],
        "units": len(replica.units),
        "kept_gathered": replica.kept_gathered,
        **summary,
    }
