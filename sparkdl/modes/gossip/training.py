"""One replica's training in gossip mode: Keras's own ``fit`` on this rank's rows, with the rounds in its steps.

Every rank runs the same steps (``Settings.for_rows``: the ranks' common count), so every rank
reaches each exchange step and each epoch end; a rank's neighbours wait for it there only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from sparkdl import _compat
from sparkdl.data import Rows
from sparkdl.keras.optimizer_hooks import intercept_apply
from sparkdl.modes import whole_replicas
from sparkdl.modes.base import Settings
from sparkdl.modes.gossip import replicas
from sparkdl.modes.gossip.exchange import Gossip
from sparkdl.modes.gossip.hook import GossipHook
from sparkdl.position import EpochRest


def train(
    model,
    rows: Rows,
    *,
    comm,
    settings: Settings,
    initial_epoch: int,
    rest: EpochRest | None = None,
    gossip_every: int,
    peers: str,
    validation: whole_replicas.Validation | None = None,
    callbacks: Sequence = (),
    save=None,
    saves_each_epoch: bool = False,
) -> tuple[dict[str, list[float]], dict]:
    """Trains this rank's replica in place on its rows, averaging with its neighbours every ``gossip_every`` steps.

    ``rest``: the steps left of epoch ``initial_epoch``, resumed mid-epoch (``sparkdl.position``), trained by a
    ``fit`` of their own before the whole epochs after it; the global steps that number the rounds go on from
    there. ``callbacks`` run after the metrics were combined over ranks. With ``saves_each_epoch`` (every
    rank, where checkpoints are asked for) the replicas are averaged at each epoch end and
    ``save(epoch, logs)`` (rank 0's) called while rank 0's model holds the average. Returns the
    history and this rank's counters (``rounds``, ``bytes_sent``, ``wait_seconds``, ``spreads``).
    """
    import keras

    keras.utils.set_random_seed(settings.seed + comm.rank)  # dropout and the like differ per rank, by design
    model.jit_compile = False  # the rounds run through tf.numpy_function, which XLA cannot compile
    steps = settings.steps_per_epoch
    whole_replicas.run_steps_per_call(model, settings.callbacks, settings.checkpoint_every)
    validation_data = validation.keras_data(rows, settings.batch_size) if validation is not None else None
    validation_rows = float(validation.rows_per_rank[comm.rank]) if validation is not None else 0.0
    epoch_end = replicas.epoch_end_callback(
        comm, samples=len(rows), validation_rows=validation_rows, saves=saves_each_epoch, save=save
    )
    gossip = Gossip(comm, peers, seed=settings.seed, timeout=settings.timeout)
    # a resumed epoch's steps left are the last of its global steps (those of the run without the fault, on as many
    # workers as it had)
    first_step = initial_epoch * steps if rest is None else (rest.epoch + 1) * steps - rest.steps_left
    hook = GossipHook(gossip, every=gossip_every, first_step=first_step, stop_step=settings.epochs * steps)
    # On an error the streams are left to the communicator they came from: closing it (the task does) fails a
    # round still in flight at once, where closing a stream would wait for that round's receives.
    _compat.build_optimizer(model.optimizer, model.trainable_variables)
    alone = comm.size == 1  # no one to average with: Keras's fit alone
    if not alone:
        hook.begin(model.trainable_weights)
    with contextlib.nullcontext() if alone else intercept_apply(model.optimizer, hook):
        history = whole_replicas.fit_epochs(
            model,
            rows,
            settings,
            initial_epoch,
            rest,
            lambda steps: [epoch_end, *callbacks],
            validation_data=validation_data,
        )
    if not alone:
        hook.end()
    gossip.close()
    counters = {
        "rounds": gossip.rounds,
        "bytes_sent": gossip.bytes_sent,
        "wait_seconds": gossip.wait_seconds,
        "spreads": epoch_end.spreads,
    }
    return history, counters
