"""Which rows each worker trains on at each step: the one batch schedule every mode follows.

Ranks must agree on the number of steps per epoch (the ring would deadlock otherwise), so it depends on
the total row count only; each rank's order within an epoch is a seeded permutation of its own rows, and
any range of global steps (a resumed fit's remaining epochs, an average-mode round) gives exactly the
batches an uninterrupted run gives for those steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


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


def steps_per_epoch(num_rows: int, num_workers: int, batch_size: int) -> int:
    """Steps every rank runs per epoch: one pass over the data at the global batch size.

    Ranks must agree on this number or the ring deadlocks, so it depends on the
    total row count only, never on a partition's own size.
    """
    return max(1, -(-num_rows // (num_workers * batch_size)))


def epoch_order(num_rows: int, num_samples: int, *, seed: int, rank: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Row indices a rank trains on in one epoch.

    ``num_samples`` (steps x batch size) may exceed ``num_rows``: the order then
    continues with further permutations so that every rank runs full batches.
    """
    if not shuffle:
        return np.arange(num_samples) % num_rows
    rng = np.random.default_rng([seed, rank, epoch])
    passes = -(-num_samples // num_rows)
    return np.concatenate([rng.permutation(num_rows) for _ in range(passes)])[:num_samples]


def batches(
    num_rows: int,
    *,
    batch_size: int,
    steps: int,
    seed: int,
    rank: int,
    shuffle: bool,
    start: int,
    stop: int,
) -> Iterator[np.ndarray]:
    """The one batch schedule of every mode: the row indices of each batch of global steps ``start..stop-1``.

    An epoch is ``steps`` steps over the rank's rows in ``epoch_order`` (reshuffled every epoch), so
    any range of steps (a resumed fit's remaining epochs, an average-mode round) gives exactly the
    batches an uninterrupted run gives for those steps.
    """
    position = start
    while position < stop:
        epoch, first = divmod(position, steps)
        end = min(stop, (epoch + 1) * steps)
        order = epoch_order(num_rows, steps * batch_size, seed=seed, rank=rank, epoch=epoch, shuffle=shuffle)
        for step in range(first, end - epoch * steps):
            yield order[step * batch_size : (step + 1) * batch_size]
        position = end
