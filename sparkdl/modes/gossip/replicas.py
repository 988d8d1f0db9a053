"""The gossip replicas seen together once an epoch: their metrics combined, how far apart they are, their average.

No collective runs over all ranks during an epoch's steps; at each epoch end every rank takes part in
three: an ``allgather`` of its metrics (combined by ``metrics.combine_logs``, weighted by rows, as in
every mode), an ``allreduce`` of its weights (their mean, from which each rank's distance to it
follows) and an ``allgather`` of those distances. Where a checkpoint is due, a ``reduce`` of the
optimizer's state to rank 0 as well, which saves the *average* of the replicas.

The spread of an epoch is ``max_r ||w_r - mean|| / ||mean||`` over the ranks ``r``, with ``w_r`` rank
``r``'s trainable weights as one vector (the ones gossip mixes) and ``mean`` their mean over ranks.

The average model holds the mean of every floating-point variable: the weights, the non-trainable
statistics (BatchNorm's moving means, which each replica keeps for itself while training) and the
optimizer's slots (each replica's own); integer variables (the optimizer's step count, the same on
every rank) are rank 0's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np

from sparkdl import _compat
from sparkdl.collective.api import ReduceOp
from sparkdl.modes import whole_replicas


def _is_float(variable) -> bool:
    return bool(np.issubdtype(_compat.numpy_dtype(variable.dtype), np.floating))


def model_variables(model) -> list:
    """The model's floating-point variables, trainable ones first (in ``trainable_weights`` order)."""
    trainable = list(model.trainable_weights)
    known = {id(v) for v in trainable}
    return [*trainable, *(v for v in model.weights if id(v) not in known and _is_float(v))]


def optimizer_variables(model) -> list:
    """The optimizer's floating-point variables (its slots; the learning rate where it is a variable)."""
    optimizer = model.optimizer
    _compat.build_optimizer(optimizer, model.trainable_variables)
    return [v for v in optimizer.variables if _is_float(v)]


def flat(variables: Sequence) -> np.ndarray:
    """The variables' values as one float64 vector."""
    if not variables:
        return np.empty(0, np.float64)
    return np.concatenate([np.asarray(v.numpy(), np.float64).reshape(-1) for v in variables])


def assign(variables: Sequence, values: np.ndarray) -> None:
    """Gives ``variables`` the values of the flat vector ``values`` (each in its own dtype)."""
    offset = 0
    for variable in variables:
        size = int(np.prod(variable.shape))
        part = values[offset : offset + size].reshape(tuple(variable.shape))
        variable.assign(part.astype(_compat.numpy_dtype(variable.dtype)))
        offset += size


def spread(comm, trainable: int, weights: np.ndarray, mean: np.ndarray) -> tuple[float, list[float]]:
    """Every rank's distance to the replicas' mean over the first ``trainable`` elements, relative to the mean's
    norm: ``(largest, by rank)``. Collective (an allgather of one number per rank)."""
    distance = float(np.linalg.norm(weights[:trainable] - mean[:trainable]))
    distances = comm.allgather(np.array([distance], np.float64))[:, 0]
    norm = float(np.linalg.norm(mean[:trainable]))
    relative = (distances / norm if norm > 0 else distances).tolist()
    return max(relative, default=0.0), relative


@contextlib.contextmanager
def averaged(model, comm, *, weights_mean: np.ndarray | None = None, keep: bool = False) -> Iterator[bool]:
    """While the block runs, rank 0's model holds the replicas' average (yields True on rank 0, False elsewhere);
    afterwards its own values again, unless ``keep``. Collective: every rank enters it.

    ``weights_mean``: the mean of :func:`model_variables` over ranks, where the caller has it already.
    """
    variables, slots = model_variables(model), optimizer_variables(model)
    if weights_mean is None:
        weights_mean = comm.allreduce(flat(variables), ReduceOp.MEAN)
    slots_mean = comm.reduce(flat(slots), root=0, op=ReduceOp.MEAN) if slots else np.empty(0)
    if comm.rank != 0:
        yield False
        return
    own = None if keep else (flat(variables), flat(slots))
    assign(variables, weights_mean)
    assign(slots, slots_mean)
    try:
        yield True
    finally:
        if own is not None:
            assign(variables, own[0])
            assign(slots, own[1])


def trainable_size(model) -> int:
    """How many elements the model's trainable weights hold (the first part of :func:`model_variables`)."""
    return sum(int(np.prod(v.shape)) for v in model.trainable_weights)


def epoch_end_callback(comm, *, samples: int, validation_rows: float, saves: bool = False, save=None):
    """The first callback of every rank at each epoch end. It combines the epoch's metrics over ranks (so History,
    the checkpoints and the user's callbacks see the global values), measures the spread (kept in its ``spreads``:
    one ``{"epoch", "spread", "distances"}`` per epoch) and, with ``saves`` (every rank, where checkpoints are
    asked for), averages the replicas and calls ``save(epoch, logs)`` (rank 0's) while rank 0's model holds the
    average.

    ``samples`` and ``validation_rows``: this rank's training and held-out rows, the weights of its metrics.
    """
    import keras

    class GossipEpochEnd(keras.callbacks.Callback):
        """Every rank makes the same collective calls here, in the same order."""

        def __init__(self):
            super().__init__()
            self.spreads: list[dict] = []

        def on_epoch_end(self, epoch, logs=None):
            if logs:
                whole_replicas.combine_over_ranks(comm, logs, samples, validation_rows)
            weights = flat(model_variables(self.model))
            mean = comm.allreduce(weights, ReduceOp.MEAN)
            largest, by_rank = spread(comm, trainable_size(self.model), weights, mean)
            self.spreads.append({"epoch": epoch, "spread": largest, "distances": by_rank})
            if saves:
                with averaged(self.model, comm, weights_mean=mean) as on_rank_0:
                    if on_rank_0 and save is not None:
                        save(epoch, logs or {})

    return GossipEpochEnd()
