"""Keeps sync mode's replicas one model: Keras ``fit`` with gradients averaged every step, metrics combined.

The model's own optimizer is hooked (see ``optimizer_hooks``) so that every
step's gradients, fused into one float32 buffer, are averaged across ranks
by one ring allreduce before the optimizer applies them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
from collections.abc import Iterator, Sequence

import numpy as np

from sparkdl import schedule
from sparkdl.collective.api import ReduceOp
from sparkdl.data import Rows
from sparkdl.keras.held_out import in_batches
from sparkdl.keras.optimizer_hooks import fused_numpy_call, intercept_apply
from sparkdl.metrics import combine_logs
from sparkdl.modes.base import Settings

logger = logging.getLogger(__name__)

# Ranks whose final weights differ by more than this (after an exact hash
# comparison failed) are reported as diverged rather than accepted.
_REPLICA_TOLERANCE = 1e-5


@contextlib.contextmanager
def distributed_optimizer(optimizer, comm, scales: np.ndarray | None = None, first_step: int = 0) -> Iterator[None]:
    """Makes ``optimizer`` average its gradients over ``comm`` while the block runs.

    A communicator with its own in-graph collective (Horovod's) averages them
    there; otherwise they cross into Python once per step, fused, for ``comm.allreduce``.
    ``scales`` (per step of an epoch, from global step ``first_step`` on: ``schedule.gradient_scales``)
    weigh this rank's gradient by its rows when the ranks' batches differ in size.
    """
    steps = itertools.count(first_step)

    def next_scale() -> np.float32:
        return np.float32(1.0 if scales is None else scales[next(steps) % len(scales)])

    def mean_over_ranks(fused: np.ndarray) -> np.ndarray:
        scale = next_scale()
        return comm.allreduce(fused if scale == 1 else fused * scale, ReduceOp.MEAN)

    def allreduce_then_apply(apply, grads, variables):
        if comm.capabilities.in_graph_allreduce:
            if scales is not None:
                import tensorflow as tf

                scale = tf.ensure_shape(tf.numpy_function(next_scale, [], tf.float32, stateful=True), [])
                grads = [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]
            return apply(comm.allreduce_tensors(grads, op=ReduceOp.MEAN), variables)
        return apply(fused_numpy_call(grads, mean_over_ranks, "sparkdl_allreduce"), variables)

    with intercept_apply(optimizer, allreduce_then_apply):
        yield


@dataclasses.dataclass(frozen=True)
class Validation:
    """This rank's held-out rows, and every rank's count of them (the same array on every rank).

    A rank with no held-out rows still validates, on a stand-in (one of its training rows), so
    that every rank's epoch logs hold the same keys and every rank makes the same collective
    calls; its stand-in metrics have no rows behind them, so they weigh nothing (``metrics.combine_logs``).
    """

    rows: Rows
    rows_per_rank: np.ndarray


def _average_across_workers_callback(
    comm, *, samples: int, steps_per_epoch: int | None = None, validation: Validation | None = None
):
    import keras

    validation_rows = float(validation.rows_per_rank[comm.rank]) if validation is not None else 0.0

    class AverageAcrossWorkers(keras.callbacks.Callback):
        """Averages epoch metrics, and statistics such as BatchNorm's moving means, over ranks.

        Runs first among the callbacks, so History, EarlyStopping and the
        user's callbacks all see the global values. Every rank gathers every
        rank's metrics and combines them by the one rule (``metrics.combine_logs``):
        ``val_*`` metrics weighted by each rank's held-out rows, so they equal the
        metrics of the (common) model on all held-out rows; a rank with none
        weighs nothing (see ``Validation``). Statistics are averaged after the
        epoch's last step, before Keras validates, so that validation sees the
        averaged model (and again at the epoch end only if that did not happen).
        """

        def on_epoch_begin(self, epoch, logs=None):
            self._statistics_averaged = False

        def on_train_batch_end(self, batch, logs=None):
            if steps_per_epoch is not None and batch + 1 >= steps_per_epoch and not self._statistics_averaged:
                self._average_statistics()

        def on_epoch_end(self, epoch, logs=None):
            if logs:  # every rank gathers the same rows, so every rank computes the same combination
                keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number)))
                local = np.array([logs[k] for k in keys] + [samples, validation_rows], np.float64)
                rows = comm.allgather(local)
                logs.update(
                    combine_logs(
                        [dict(zip(keys, row[:-2].tolist())) for row in rows], rows[:, -2].tolist(), rows[:, -1].tolist()
                    )
                )
            if not self._statistics_averaged:
                self._average_statistics()

        def _average_statistics(self):
            self._statistics_averaged = True
            statistics = [v for v in self.model.non_trainable_variables if _is_float(v.dtype)]
            if statistics:
                averaged = comm.allreduce(
                    _concat([np.asarray(v.numpy(), np.float64) for v in statistics]), ReduceOp.MEAN
                )
                for variable, value in zip(statistics, _split(averaged, statistics)):
                    variable.assign(value.astype(_numpy_dtype(variable.dtype)))

    return AverageAcrossWorkers()


def _numpy_dtype(dtype) -> np.dtype:
    """A variable's dtype as numpy's: Keras 3 gives a name ("float32"), tf.keras 2 a ``tf.DType``."""
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))


def _is_float(dtype) -> bool:
    return np.issubdtype(_numpy_dtype(dtype), np.floating)


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(a) for a in arrays]) if arrays else np.empty(0)


def _split(flat: np.ndarray, like: list) -> list[np.ndarray]:
    sizes = [int(np.prod(v.shape)) for v in like]
    return [part.reshape(tuple(v.shape)) for part, v in zip(np.split(flat, np.cumsum(sizes)[:-1]), like)]


def _weights_as_bytes(weights: list[np.ndarray]) -> np.ndarray:
    return _concat([np.ascontiguousarray(w).view(np.uint8) for w in weights]).astype(np.uint8, copy=False)


def broadcast_weights(model, comm) -> None:
    """Gives every rank rank 0's weights, byte for byte, before the first step."""
    weights = model.get_weights()
    received = comm.broadcast(_weights_as_bytes(weights), root=0)
    restored, offset = [], 0
    for w in weights:
        restored.append(received[offset : offset + w.nbytes].view(w.dtype).reshape(w.shape))
        offset += w.nbytes
    model.set_weights(restored)


def check_replicas_identical(model, comm) -> None:
    """Raises if the ranks finished with different weights: a silent divergence would ship a wrong model."""
    weights = model.get_weights()
    digest = np.frombuffer(hashlib.sha256(_weights_as_bytes(weights).tobytes()).digest(), np.uint8)
    digests = comm.allgather(digest)
    if (digests == digests[0]).all():
        return
    flat = _concat([np.asarray(w, np.float64) for w in weights])
    reference = comm.broadcast(flat, root=0)
    differences = comm.allgather(np.array([np.max(np.abs(flat - reference), initial=0.0)]))[:, 0]
    if differences.max() > _REPLICA_TOLERANCE:
        raise RuntimeError(
            "Replicas diverged: the largest difference from rank 0's weights per rank is "
            f"{differences.tolist()}. Every rank must apply the same averaged gradients."
        )
    logger.warning("Replicas differ by at most %.3g after training (within tolerance).", differences.max())


def train(
    model,
    rows: Rows,
    *,
    comm,
    settings: Settings,
    rows_per_rank: Sequence[int],
    initial_epoch: int,
    validation: Validation | None = None,
    callbacks: Sequence = (),
) -> dict[str, list[float]]:
    """Trains ``model`` in place on this rank's rows, in lockstep with the other ranks; returns the history.

    ``settings.steps_per_epoch`` is the ranks' common count (``Settings.for_rows(rows_per_rank)``):
    each rank trains each of its rows once per epoch, its gradient weighed by its rows at each step.

    With ``validation``, every rank evaluates its held-out rows at each epoch end (Keras's own
    ``validation_data``) and the history gains the combined ``val_*`` metrics. Training runs
    epochs ``initial_epoch..epochs-1`` (the history holds those); ``callbacks`` run after the
    combination of metrics over ranks, so they see the global values.
    """
    import keras

    keras.utils.set_random_seed(settings.seed + comm.rank)  # dropout and the like differ per rank, by design
    model.jit_compile = False  # the allreduce runs through tf.numpy_function, which XLA cannot compile
    broadcast_weights(model, comm)
    steps = settings.steps_per_epoch
    stream = settings.batches(rows, comm.rank, start=initial_epoch * steps)
    validation_data = None
    if validation is not None:  # a rank without held-out rows validates on a stand-in, which weighs 0
        if len(validation.rows):
            validation_data = in_batches(validation.rows, settings.batch_size)
        else:
            validation_data = rows.take(np.arange(1))
    callback = _average_across_workers_callback(comm, samples=len(rows), steps_per_epoch=steps, validation=validation)
    scales = schedule.gradient_scales(rows_per_rank, comm.rank, steps)
    with distributed_optimizer(model.optimizer, comm, scales, first_step=initial_epoch * steps):
        history = model.fit(
            stream,
            epochs=settings.epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps,
            shuffle=False,
            verbose=0,
            validation_data=validation_data,
            callbacks=[callback, *callbacks],
        )
    check_replicas_identical(model, comm)
    return {name: [float(v) for v in values] for name, values in history.history.items()}
