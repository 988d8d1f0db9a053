"""What each task of gossip mode's barrier stage trains, in the frame every barrier mode shares (``modes.barrier``):
its replica, averaged with its peers'; rank 0's result, the replicas' average."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from sparkdl.checkpoint import Checkpointer
from sparkdl.keras import callbacks, serialization
from sparkdl.keras.optimizer_hooks import saved_form
from sparkdl.modes import whole_replicas
from sparkdl.modes.barrier import Ranks
from sparkdl.modes.gossip import replicas, training

if TYPE_CHECKING:
    from sparkdl.modes.gossip.mode import GossipPlan


def train(plan: GossipPlan, ranks: Ranks) -> bytes | None:
    comm, settings = ranks.comm, ranks.settings
    start = ranks.whole_model_start()
    model = serialization.model_from_bytes(start.model_bytes, settings.custom_objects)
    ranks.reporter.phase("model in")
    validation = whole_replicas.Validation(ranks.held_out, ranks.counts[:, 1]) if settings.validate else None
    rest = ranks.epoch_rest(start)
    step_checkpoints = ranks.step_checkpoints(every_rank=True)  # each holds the replicas' average: every rank's
    with ranks.checkpointing(start) as checkpointer:  # the metrics are combined on every rank: the writer reports
        progress = ranks.progress_callback()
        step_saving = []
        if step_checkpoints is not None:
            step_saving.append(
                callbacks.step_checkpoint_callback(
                    step_checkpoints,
                    checkpointer,
                    functools.partial(ranks.position_at, rest),
                    functools.partial(replicas.averaged, model, comm),  # the writer, rank 0, holds the average
                )
            )
        history, counters = training.train(
            model,
            ranks.rows,
            comm=comm,
            settings=settings,
            initial_epoch=start.epoch,
            rest=rest,
            gossip_every=plan.gossip_every,
            peers=plan.peers,
            validation=validation,
            callbacks=[*step_saving, *([progress] if progress else []), *settings.callbacks],
            save=_saver(model, checkpointer) if checkpointer is not None else None,
            saves_each_epoch=ranks.task.checkpoints is not None,
        )
    stats = _stats(comm, plan, counters)
    with replicas.averaged(model, comm, keep=True) as on_rank_0:  # the result: the replicas' average
        result = serialization.model_to_bytes(model) if on_rank_0 else None
    ranks.reporter.phase("train")
    if result is None:
        return None
    answer = ranks.result(result, history, start, {"gossip": stats, **ranks.checkpoint_stats(start, step_checkpoints)})
    ranks.reporter.phase("model out")
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


def _stats(comm, plan: GossipPlan, counters: dict) -> dict:
    """``FitResult.stats["gossip"]``: the settings, each rank's traffic and waiting, and the spread per epoch.
    Collective (an allgather of three numbers per rank)."""
    rounds = counters["rounds"]
    row = np.array([rounds, counters["bytes_sent"], counters["wait_seconds"]], np.float64)
    table = comm.allgather(row)
    return {
        "peers": plan.peers,
        "gossip_every": plan.gossip_every,
        "rounds": int(rounds),  # the same on every rank
        "bytes_sent": [int(b) for b in table[:, 1]],
        "bytes_per_exchange": [int(b // r) if r else 0 for r, b in zip(table[:, 0], table[:, 1])],
        "wait_seconds": table[:, 2].tolist(),
        "epochs": [s["epoch"] for s in counters["spreads"]],
        "spread": [s["spread"] for s in counters["spreads"]],
        "distances": [s["distances"] for s in counters["spreads"]],
    }
