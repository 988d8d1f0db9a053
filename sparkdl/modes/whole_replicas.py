"""What the barrier modes whose every rank trains a whole replica with Keras's ``fit`` share (sync, sharded, gossip):
the held-out rows, the steps per call, the fits of a resumed epoch's rest and of the whole epochs, the metrics
combined over ranks, and the bytes each rank sent.

The frame around them (the ranks' rows, the starting point, checkpoints, the result) is every barrier mode's
(``modes.barrier``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from sparkdl import _compat
from sparkdl.checkpoint import CheckpointInterval
from sparkdl.data import Rows
from sparkdl.metrics import combine_logs
from sparkdl.position import EpochRest

if TYPE_CHECKING:
    from sparkdl.modes.base import Settings

#: Steps Keras runs per call of its train function, unless the model or a callback says otherwise.
STEPS_PER_CALL = 16


@dataclasses.dataclass(frozen=True)
class Validation:
    """This rank's held-out rows, and every rank's count of them (the same array on every rank).

    A rank with no held-out rows still validates, on a stand-in (one of its training rows), so
    that every rank's epoch logs hold the same keys and every rank makes the same collective
    calls; its stand-in metrics have no rows behind them, so they weigh nothing (``metrics.combine_logs``).
    """

    rows: Rows
    rows_per_rank: np.ndarray

    def keras_data(self, training: Rows, batch_size: int):
        """Keras's ``validation_data`` for this rank: its held-out rows in batches, or the stand-in."""
        from sparkdl.keras.held_out import in_batches

        return in_batches(self.rows, batch_size) if len(self.rows) else training.take(np.arange(1))


def run_steps_per_call(model, callbacks: Sequence, checkpoint_every: CheckpointInterval | None = None) -> None:
    """Lets Keras run up to :data:`STEPS_PER_CALL` steps per call of its train function.

    One call per step costs a Python round trip (Keras's loop, the logs, the callbacks) that a
    small model's step does not hide. The model's own ``compile(steps_per_execution=...)`` wins
    when the user set one; so does a user callback that acts on every batch, as it would
    otherwise be called once per call only (Keras's rule for ``steps_per_execution``). Step checkpoints every so
    many steps (``checkpoint_every``) take the largest divisor of that count as the steps per call, so that they
    fall where asked.
    """
    import keras

    if _compat.keras_major() < 3 or model.steps_per_execution > 1:
        return
    batch_hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
    for callback in callbacks:
        if any(getattr(type(callback), hook) is not getattr(keras.callbacks.Callback, hook) for hook in batch_hooks):
            return
    every = checkpoint_every.steps if checkpoint_every is not None else None
    model.steps_per_execution = max(d for d in range(1, STEPS_PER_CALL + 1) if every is None or every % d == 0)


def fit_epochs(
    model,
    rows: Rows,
    settings: Settings,
    initial_epoch: int,
    rest: EpochRest | None,
    callbacks: Callable[[int], list],
    **options,
) -> dict[str, list[float]]:
    """Keras's ``fit`` of ``model`` on this rank's ``rows``: a fit of the steps left of a resumed epoch first (``rest``,
    where the fit resumed mid-epoch), then one of the whole epochs after it (from ``initial_epoch`` otherwise); the
    history of both. ``callbacks(steps)``: the callbacks of a fit whose epochs take ``steps`` steps; ``options``: the
    other arguments of both fits (``validation_data``)."""
    runs = []
    whole_from = initial_epoch
    if rest is not None:
        runs.append((lambda: settings.rest_stream(rows, rest), range(rest.epoch, rest.epoch + 1), rest.steps_left))
        whole_from = rest.epoch + 1
    if whole_from < settings.epochs:
        whole = range(whole_from, settings.epochs)
        runs.append((lambda: settings.epoch_stream(rows, whole_from), whole, settings.steps_per_epoch))
    history: dict[str, list[float]] = {}
    for stream, epochs, steps in runs:
        done = model.fit(
            stream(),
            epochs=epochs.stop,
            initial_epoch=epochs.start,
            shuffle=False,
            verbose=0,
            callbacks=callbacks(steps),
            **options,
        )
        for name, values in done.history.items():
            history.setdefault(name, []).extend(float(v) for v in values)
    return history


def combine_over_ranks(comm, logs: dict, samples: float, validation_rows: float) -> None:
    """Collective: this rank's epoch ``logs`` replaced, in place, by every rank's combined (``metrics.combine_logs``:
    training metrics weighed by each rank's ``samples``, ``val_*`` by its ``validation_rows``); every rank gathers
    the same rows, so every rank computes the same combination."""
    keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number)))
    local = np.array([logs[k] for k in keys] + [samples, validation_rows], np.float64)
    rows = comm.allgather(local)
    logs.update(
        combine_logs([dict(zip(keys, row[:-2].tolist())) for row in rows], rows[:, -2].tolist(), rows[:, -1].tolist())
    )


def wire_bytes(comm) -> list[dict] | None:
    """Collective, at a barrier task's end: ``FitResult.stats["wire_bytes"]``, every rank's payload bytes sent
    since it connected, by transport, operation and dtype (``SparkdlCommunicator.bytes_sent``), on rank 0; None
    on the other ranks, and on a backend without these counters (Horovod's). Counted before this gather."""
    bytes_sent = getattr(comm, "bytes_sent", None)  # sparkdl's communicator counts them; Horovod's does not
    if bytes_sent is None:
        return None
    own = np.frombuffer(json.dumps(bytes_sent()).encode(), np.uint8)
    gathered = comm.gather(own, root=0)
    return [json.loads(row.tobytes()) for row in gathered] if gathered is not None else None
