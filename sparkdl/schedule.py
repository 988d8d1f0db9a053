"""Which rows each worker trains on at each step: the one batch schedule every mode follows.

Every training row is used exactly once per epoch, however unevenly Spark split the rows: a worker
spreads its epoch's order of its ``n`` rows over the epoch's ``steps``, step ``s`` taking positions
``[s*n//steps, (s+1)*n//steps)``, so its batches differ by at most one
row and none is repeated or left out. Workers that step in lockstep (sync mode's ranks, average
mode's rounds) share ``steps = ceil(max n / batch_size)``; a worker whose partition holds fewer rows
than that has empty steps, where sync mode's rank still takes part in the collective (with a
one-row *filler* batch whose gradient weighs nothing: :func:`gradient_scales`) and average mode's
worker trains nothing. Any range of global steps (a resumed fit, an average-mode round) gives
exactly the batches an uninterrupted run gives for those steps.

An epoch's order is the rows sorted by a seeded mix of their keys (``sparkdl.data.ROW_KEY``): a bijection of the
64-bit key for each ``(seed, epoch)`` (SplitMix64's finalizer), so no two rows tie, the order does not depend on
the order the rows arrived in, and whoever holds a row's key knows where it falls in its epoch
(``sparkdl.position``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence

import numpy as np

logger = logging.getLogger(__name__)


def require_rows(rows_by_worker: dict[int, int]) -> None:
    """The one "at least one training row per worker" rule of every mode: a worker without rows fails the job.

    ``plan().check`` ensures there are at least as many rows as workers, but Spark's repartition
    may still leave a partition empty. Every mode refuses that rather than train with fewer
    workers than asked (sync mode could not: its ranks step in lockstep).
    """
    empty = sorted(worker for worker, rows in rows_by_worker.items() if rows == 0)
    if empty:
        counts = ", ".join(f"worker {worker}: {rows}" for worker, rows in sorted(rows_by_worker.items()))
        raise ValueError(
            f"Expected at least one training row on every worker. Received: no rows on worker(s) "
            f"{empty} ({counts}). Use fewer workers or more data."
        )


def steps_per_epoch(rows_per_worker: Sequence[int], batch_size: int) -> int:
    """Steps per epoch for workers holding ``rows_per_worker`` rows: the largest partition in batches of ``batch_size``."""
    return max(1, -(-max(rows_per_worker) // batch_size))


def estimated_steps(num_rows: int, num_workers: int, batch_size: int) -> int:
    """The steps per epoch of evenly split rows: what the driver shows until the workers report their counts."""
    return steps_per_epoch([-(-num_rows // num_workers)], batch_size)


def step_sizes(num_rows: int, steps: int) -> np.ndarray:
    """The rows of each of an epoch's ``steps`` steps for a worker holding ``num_rows`` rows (0 for an empty step)."""
    return np.diff(np.arange(steps + 1, dtype=np.int64) * num_rows // steps)


def gradient_scales(rows_per_rank: Sequence[int], rank: int, steps: int) -> np.ndarray | None:
    """Per step of an epoch, what rank ``rank`` multiplies its gradient by before the ranks average them.

    Rank r's gradient is the mean over its k_r rows of the step; scaled by ``k_r * N / sum(k)`` and
    averaged over the N ranks, the update is the mean over all rows of the global step, as one
    process training on them in one batch. ``None`` when every rank has the same rows at every step
    (all scales are 1).
    """
    sizes = np.stack([step_sizes(n, steps) for n in rows_per_rank])
    if (sizes == sizes[0]).all():
        return None
    return sizes[rank] * len(rows_per_rank) / sizes.sum(axis=0)


@dataclasses.dataclass(frozen=True)
class StepScales:
    """What a rank's gradient weighs at each step of a fit, counted from the fit's first step: ``first`` for the
    ``first_steps`` steps left of a resumed epoch (None: 1 each), then ``per_epoch`` (:func:`gradient_scales`;
    None: 1 each) for every whole epoch after them."""

    first: np.ndarray | None
    first_steps: int
    per_epoch: np.ndarray | None

    @classmethod
    def of(cls, per_epoch: np.ndarray | None, first: np.ndarray | None = None, first_steps: int = 0):
        """The scales, or None where every step's scale is 1."""
        return None if per_epoch is None and first is None else cls(first, first_steps, per_epoch)

    def at(self, step: int) -> float:
        if step < self.first_steps:
            return 1.0 if self.first is None else float(self.first[step])
        if self.per_epoch is None:
            return 1.0
        return float(self.per_epoch[(step - self.first_steps) % len(self.per_epoch)])


def warn_fillers(rows_per_rank: Sequence[int], steps: int) -> None:
    """Logs the workers whose partitions are too small for ``steps`` steps (they run filler steps)."""
    for rank, rows in enumerate(rows_per_rank):
        if rows < steps:
            logger.warning(
                "sparkdl: worker %d holds %d rows for %d steps per epoch: it runs %d filler steps on one of its "
                "rows each epoch, whose gradient weighs nothing but which its own unweighted metrics count. "
                "Spread the rows more evenly (repartition the DataFrame) or use a larger batch_size.",
                rank,
                rows,
                steps,
                steps - rows,
            )


def epoch_order(keys: np.ndarray, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The rows of ``keys`` in the order they are trained in one epoch (each exactly once), as row numbers: by
    :func:`sort_values`."""
    return np.argsort(sort_values(keys, seed=seed, epoch=epoch, shuffle=shuffle), kind="stable")


def sort_values(keys: np.ndarray, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """What orders the rows of ``keys`` in epoch ``epoch``: the keys themselves without ``shuffle``, else a
    bijection of them seeded by ``(seed, epoch)``, as uint64 (distinct keys, distinct values)."""
    unsigned = keys.astype(np.uint64)
    if not shuffle:
        return unsigned ^ np.uint64(1 << 63)  # the signed keys' order
    # np.uint64 on both sides of ^: NumPy 1 (the Horovod stack's) cannot mix a Python int with a uint64
    salt = _mix(np.array([np.uint64(seed & _MASK64) ^ _mix(np.array([epoch & _MASK64], np.uint64))[0]]))[0]
    with np.errstate(over="ignore"):
        return _mix(unsigned + salt)


_MASK64 = (1 << 64) - 1


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 whose outputs look independent of its inputs."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@dataclasses.dataclass(frozen=True)
class EpochSteps:
    """Consecutive steps of one epoch: the rank's rows in the epoch's order, and each step's rows as a span of it.

    Readers that can plan (``sparkdl.data.windows``) read a whole part at once; a step's row indices are
    ``order[start:stop]``; a filler step's span is ``(0, 1)``. ``order`` is None for a task that holds no rows
    and only needs the steps' sizes (a pipeline's middle stage).
    """

    order: np.ndarray | None
    spans: list[tuple[int, int]]


def epoch_steps(
    num_rows: int,
    *,
    keys: np.ndarray | None,
    steps: int,
    seed: int,
    shuffle: bool,
    start: int,
    stop: int,
    fillers: bool = True,
) -> Iterator[EpochSteps]:
    """The one batch schedule of every mode: global steps ``start..stop-1`` of a worker holding ``num_rows`` rows
    whose keys are ``keys`` (None: the steps' sizes alone), a part per epoch they reach.

    An empty step (fewer rows than steps) is a one-row filler with ``fillers``, left out otherwise.
    """
    bounds = np.arange(steps + 1, dtype=np.int64) * num_rows // steps
    position = start
    while position < stop:
        epoch, first = divmod(position, steps)
        end = min(stop, (epoch + 1) * steps)
        spans = []
        for step in range(first, end - epoch * steps):
            if bounds[step] < bounds[step + 1]:
                spans.append((int(bounds[step]), int(bounds[step + 1])))
            elif fillers:
                spans.append((0, 1))
        order = None if keys is None else epoch_order(keys, seed=seed, epoch=epoch, shuffle=shuffle)
        yield EpochSteps(order, spans)
        position = end
