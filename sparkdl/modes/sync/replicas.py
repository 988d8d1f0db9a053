"""Keeps sync mode's replicas one model: Keras ``fit`` with gradients averaged every step, metrics combined.

The model's own optimizer is hooked (see ``optimizer_hooks``) so that every
step's gradients are averaged across ranks (``reducer``: fused buckets,
started while backprop runs) before the optimizer applies them.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sparkdl import _compat, schedule
from sparkdl.collective.api import ReduceOp
from sparkdl.data import Rows
from sparkdl.keras import compiled_update, random_state
from sparkdl.keras.optimizer_hooks import intercept_apply
from sparkdl.modes import whole_replicas
from sparkdl.modes.base import Settings
from sparkdl.modes.sync import sharded
from sparkdl.modes.sync.reducer import GradientReducer
from sparkdl.modes.sync.step_profile import StepProfile
from sparkdl.position import EpochRest, step_scales

if TYPE_CHECKING:
    from sparkdl.modes.sync.mode import SyncPlan

logger = logging.getLogger(__name__)

# Ranks whose final weights differ by more than this (after an exact hash
# comparison failed) are reported as diverged rather than accepted.
_REPLICA_TOLERANCE = 1e-5


@contextlib.contextmanager
def distributed_optimizer(
    optimizer,
    comm,
    scales: schedule.StepScales | None = None,
    *,
    compression: str | None = None,
    overlap: bool = True,
    profile: StepProfile | None = None,
    timeout=600.0,
    compile_update: bool = False,
) -> Iterator[None]:
    """Makes ``optimizer`` average its gradients over ``comm`` while the block runs.

    A communicator with its own in-graph collective (Horovod's) averages them there; otherwise
    :class:`~sparkdl.modes.sync.reducer.GradientReducer` sends them: ``compression`` (gradients on the wire as
    "bf16"/"fp16"), in buckets that start moving while backprop runs (``overlap``), each step timed by ``profile``.
    ``scales`` (per step from the fit's first: ``schedule.StepScales``) weigh this rank's gradient by its rows when
    the ranks' batches differ in size. ``compile_update``:
    the optimizer's update runs XLA-compiled (``sparkdl.keras.compiled_update``; not with Horovod).
    """
    if comm.capabilities.in_graph_allreduce:
        steps = itertools.count()

        def next_scale() -> np.float32:
            assert scales is not None  # called only when there are scales
            return np.float32(scales.at(next(steps)))

        def allreduce_in_graph(apply, grads, variables):
            if scales is not None:
                import tensorflow as tf

                scale = tf.ensure_shape(tf.numpy_function(next_scale, [], tf.float32, stateful=True), [])
                grads = [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]
            return apply(comm.allreduce_tensors(grads, op=ReduceOp.MEAN), variables)

        intercept = allreduce_in_graph
    else:
        intercept = GradientReducer(
            comm,
            timeout=timeout,
            scales=scales,
            compression=compression,
            overlap=overlap,
            compile_update=compile_update,
            profile=profile,
        )
    with intercept_apply(optimizer, intercept):
        yield


def _average_across_workers_callback(
    comm, *, samples: int, steps_per_epoch: int | None = None, validation: whole_replicas.Validation | None = None
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
            if logs:
                whole_replicas.combine_over_ranks(comm, logs, samples, validation_rows)
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
                    variable.assign(value.astype(_compat.numpy_dtype(variable.dtype)))

    return AverageAcrossWorkers()


def _is_float(dtype) -> bool:
    return np.issubdtype(_compat.numpy_dtype(dtype), np.floating)


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
    rest: EpochRest | None = None,
    draws: np.ndarray | None = None,
    validation: whole_replicas.Validation | None = None,
    callbacks: Sequence = (),
    plan: SyncPlan,
    profile: StepProfile | None = None,
    saves_each_epoch: bool = False,
    step_saving: Callable[[Callable[[], contextlib.AbstractContextManager] | None], Any] | None = None,
) -> tuple[dict[str, list[float]], dict]:
    """Trains ``model`` in place on this rank's rows, in lockstep with the other ranks; returns the history.

    ``settings.steps_per_epoch`` is the ranks' common count (``Settings.for_rows(rows_per_rank)``):
    each rank trains each of its rows once per epoch, its gradient weighed by its rows at each step.
    ``rest``: the steps left of epoch ``initial_epoch``, resumed mid-epoch (``sparkdl.position``), trained by a
    ``fit`` of their own before the whole epochs after it. ``draws``: the start checkpoint's count of its seed
    generators' draws (``keras.random_state``), so that dropout goes on where it stopped.

    With ``validation``, every rank evaluates its held-out rows at each epoch end (Keras's own
    ``validation_data``) and the history gains the combined ``val_*`` metrics. Training runs
    epochs ``initial_epoch..epochs-1`` (the history holds those); ``callbacks`` run after the
    combination of metrics over ranks, so they see the global values. ``plan`` says how the
    gradients travel (and whether each rank keeps 1/N of the optimizer state), ``profile`` times each step.
    ``saves_each_epoch``: rank 0's ``callbacks`` save the model at every epoch's end (a sharded optimizer's state
    is gathered for it first). ``step_saving(around_save)``: the Keras callback that saves the step checkpoints,
    around each save on every rank ``around_save()`` (a sharded optimizer's state gathered; None: nothing). Returns
    the history and this mode's counters (every rank's, the same on every rank).
    """
    import keras

    keras.utils.set_random_seed(settings.seed + comm.rank)  # dropout and the like differ per rank, by design
    random_state.start(model, seed=settings.seed, rank=comm.rank, saved=draws)
    model.jit_compile = False  # the allreduce runs through tf.numpy_function, which XLA cannot compile
    broadcast_weights(model, comm)
    steps = settings.steps_per_epoch
    # the user's callbacks: sparkdl's own take any number of steps per call
    whole_replicas.run_steps_per_call(model, settings.callbacks, settings.checkpoint_every)
    validation_data = validation.keras_data(rows, settings.batch_size) if validation is not None else None
    scales = step_scales(schedule.gradient_scales(rows_per_rank, comm.rank, steps), rest, comm.rank)
    compile_update = compiled_update.pays(model.optimizer, model.trainable_variables)
    first = []
    if profile is not None:  # an attribute of this replica only, removed before the model is saved
        model.train_step = profile.wrap_train_step(model.train_step)
        first.append(profile.callback())
        profile.compiled_update = compile_update
    options: dict[str, Any] = dict(timeout=settings.timeout, compile_update=compile_update)
    stats: dict = {}

    def callbacks_of(steps_in_epoch: int) -> list:
        combine = _average_across_workers_callback(
            comm, samples=len(rows), steps_per_epoch=steps_in_epoch, validation=validation
        )
        return [*first, combine, *callbacks]

    try:
        exchanging: contextlib.AbstractContextManager[Any]
        traffic: dict[str, Any] = dict(compression=plan.compression, overlap=plan.overlap, profile=profile)
        if plan.shards_optimizer:
            exchanging = sharded.sharded_optimizer(model, comm, scales=scales, **traffic, **options)
        else:
            exchanging = distributed_optimizer(model.optimizer, comm, scales, **traffic, **options)
        with exchanging as state:
            if state is not None and saves_each_epoch:
                first.append(state.consolidating_callback())
            if step_saving is not None:
                first.append(step_saving(state.consolidated if state is not None else None))
            history = whole_replicas.fit_epochs(
                model, rows, settings, initial_epoch, rest, callbacks_of, validation_data=validation_data
            )
            if state is not None:
                stats["sharded"] = state.summary()
                state.finish()
    finally:
        if profile is not None:
            del model.train_step
    check_replicas_identical(model, comm)
    return history, stats
