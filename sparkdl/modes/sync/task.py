"""What each task of sync mode's barrier stage trains, in the frame every barrier mode shares (``modes.barrier``):
its replica, kept one model with the others by averaged gradients; rank 0's result."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from sparkdl.keras import callbacks, random_state, serialization
from sparkdl.modes import whole_replicas
from sparkdl.modes.barrier import Ranks
from sparkdl.modes.sync import replicas, sharded
from sparkdl.modes.sync.step_profile import StepProfile

if TYPE_CHECKING:
    from sparkdl.modes.sync.mode import SyncPlan


def train(plan: SyncPlan, ranks: Ranks) -> bytes | None:
    comm, settings = ranks.comm, ranks.settings
    start = ranks.whole_model_start()
    if plan.shards_optimizer:
        sharded.count_optimizers_from_now()  # an earlier fit's in this reused worker are not this one's
    model = serialization.model_from_bytes(start.model_bytes, settings.custom_objects)
    ranks.reporter.phase("model in")
    validation = whole_replicas.Validation(ranks.held_out, ranks.counts[:, 1]) if settings.validate else None
    rest = ranks.epoch_rest(start)
    # the ranks hold the same model and (combined) metrics: one of them reports and saves, where the others take part
    # in a step checkpoint only to gather a sharded optimizer's state for it
    step_checkpoints = ranks.step_checkpoints(every_rank=plan.shards_optimizer)
    with ranks.checkpointing(start) as checkpointer:
        progress = ranks.progress_callback()
        saving = [callbacks.checkpoint_callback(checkpointer)] if checkpointer is not None else []
        step_saving = None
        if step_checkpoints is not None:  # made by ``replicas.train`` once a sharded optimizer exists
            position_at = functools.partial(ranks.position_at, rest)
            step_saving = functools.partial(
                callbacks.step_checkpoint_callback, step_checkpoints, checkpointer, position_at
            )
        profile = StepProfile() if plan.profile else None
        history, stats = replicas.train(
            model,
            ranks.rows,
            comm=comm,
            settings=settings,
            rows_per_rank=ranks.counts[:, 0].tolist(),
            initial_epoch=start.epoch,
            rest=rest,
            draws=start.arrays.get(random_state.DRAWS),
            validation=validation,
            callbacks=[*saving, *([progress] if progress else []), *settings.callbacks],
            plan=plan,
            profile=profile,
            saves_each_epoch=ranks.task.checkpoints is not None,
            step_saving=step_saving,
        )
    if profile is not None:
        stats["step_profile"] = profile.summary(comm)
    stats.update(ranks.checkpoint_stats(start, step_checkpoints))
    stats["wire_bytes"] = whole_replicas.wire_bytes(comm)
    ranks.reporter.phase("train")
    if not ranks.writer:
        return None
    result = ranks.result(serialization.model_to_bytes(model), history, start, stats)
    ranks.reporter.phase("model out")
    return result
