"""Where each worker of a parameter server stands: the rows it trains, and per shard the first of its steps the shard
has not applied yet; what a checkpoint saves so that every worker resumes at its own last step.

A worker's steps are global: the steps of its own schedule since the fit's first epoch (``sparkdl.schedule``;
under sync_ps every worker's one schedule). A push names its step (the last of the steps it sums, with
``push_every``), and a shard applies a worker's pushes in order, dropping one of a step it has applied already (an
earlier attempt of the worker pushed it). So a worker that starts again, a task Spark retried or a fit resumed from
a checkpoint of the shards' state with these positions, asks every shard where it stands (``Msg.RESUME``) and
resumes at the least step they name: each step is then applied once on every shard, though the shards' states were
read one after the other.

A worker tells the shards its training rows and their keys' sum (``sparkdl.position.key_sum``) when it asks; a
shard refuses a worker whose rows differ from those its positions were taken on (the input changed: its steps would
be other rows).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from sparkdl import schedule
from sparkdl.position import EpochPosition, Segment

UNKNOWN = -1  # a step no shard has applied, or rows no worker has told yet


class RowsChanged(Exception):
    """A worker's rows differ from those its positions were taken on."""


class WorkerRows:
    """What a server's shards know of each worker's rows: its training row count and their keys' sum, as it told them
    (or as the checkpoint a server resumed from holds them)."""

    def __init__(self, rows: Sequence[int], key_sums: Sequence[int]):
        self._rows = list(rows)
        self._key_sums = list(key_sums)
        self._lock = threading.Lock()

    @classmethod
    def unknown(cls, num_workers: int) -> WorkerRows:
        return cls([UNKNOWN] * num_workers, [0] * num_workers)

    def register(self, worker: int, rows: int, key_sum: int) -> None:
        """Worker ``worker`` trains ``rows`` rows whose keys sum to ``key_sum``; raises :class:`RowsChanged` where it
        told (or the checkpoint held) others."""
        with self._lock:
            known = (self._rows[worker], self._key_sums[worker])
            if known[0] != UNKNOWN and known != (rows, key_sum):
                raise RowsChanged(
                    f"worker {worker} trains {rows} rows{' with other keys' if known[0] == rows else ''}, but the "
                    f"positions of its steps were taken on {known[0]}: its partition changed since (another input, "
                    "or a DataFrame whose rows are not deterministic: cache or checkpoint it before fit)"
                )
            self._rows[worker], self._key_sums[worker] = rows, key_sum

    def snapshot(self) -> tuple[list[int], list[int]]:
        with self._lock:
            return list(self._rows), list(self._key_sums)


@dataclasses.dataclass(frozen=True)
class WorkerPositions:
    """The positions of a fit's workers at one moment: each worker's training rows and their keys' sum
    (``UNKNOWN`` rows: it has not told), and per shard (in the model's shard order) the first step of each worker
    the shard has not applied (``UNKNOWN``: none yet); with the schedule those steps are of: ``lockstep`` (sync_ps:
    every worker's steps per epoch those of the largest share) or each worker's own rows' steps, and the order its
    epochs were shuffled in (``seed``, ``shuffle``: ``sparkdl.schedule.sort_values``)."""

    seed: int
    shuffle: bool
    lockstep: bool
    rows: tuple[int, ...]
    key_sums: tuple[int, ...]  # as unsigned 64-bit integers
    next_steps: tuple[tuple[int, ...], ...]  # [shard][worker]

    ARRAY: ClassVar[str] = "sparkdl/worker_positions"  # the name of :meth:`to_vector` in a checkpoint's arrays

    @property
    def num_workers(self) -> int:
        return len(self.rows)

    def resumed(self, worker: int) -> int:
        """The first step of ``worker`` some shard has not applied: where it resumes (``UNKNOWN``: its first)."""
        steps = [shard[worker] for shard in self.next_steps]
        return UNKNOWN if UNKNOWN in steps else min(steps)

    def on_shards(self, num_shards: int) -> WorkerPositions:
        """These positions for a layout of ``num_shards`` shards: as they are on as many, else every worker's
        :meth:`resumed` step on each (a shard of another layout holds parts of several)."""
        if len(self.next_steps) == num_shards:
            return self
        steps = tuple(self.resumed(worker) for worker in range(self.num_workers))
        return dataclasses.replace(self, next_steps=(steps,) * num_shards)

    def steps_per_epoch(self, batch_size: int) -> list[int]:
        """Each worker's steps per epoch (its rows known)."""
        if self.lockstep:
            return [schedule.steps_per_epoch(self.rows, batch_size)] * self.num_workers
        return [schedule.steps_per_epoch([rows], batch_size) for rows in self.rows]

    def epoch_position(
        self, batch_size: int, initial_epoch: int, by_partition: bool = False
    ) -> tuple[int, EpochPosition | None] | None:
        """The epochs every worker has completed and where the next one stands (``sparkdl.position``): one segment of
        every worker's rows (lockstep), or a segment per worker over its own rows (``key mod workers`` of it, the
        others none), its steps capped at the epoch's; None where a worker's rows are not known. A worker no shard
        has a step of yet stands at epoch ``initial_epoch``'s first step. ``by_partition``: the rows were dealt by
        whole input partitions (``Segment.by_partition``)."""
        if UNKNOWN in self.rows:
            return None
        steps = self.steps_per_epoch(batch_size)
        done = [initial_epoch * p if (n := self.resumed(w)) == UNKNOWN else n for w, p in enumerate(steps)]
        epoch = min(n // p for n, p in zip(done, steps))
        workers = self.num_workers
        segments: tuple[Segment, ...]
        if self.lockstep:
            segments = (Segment(workers, self.rows, steps[0], done[0] - epoch * steps[0], by_partition),)
        else:
            segments = tuple(
                Segment(
                    workers,
                    tuple(n if r == w else 0 for r, n in enumerate(self.rows)),
                    p,
                    min(d - epoch * p, p),
                    by_partition,
                )
                for w, (d, p) in enumerate(zip(done, steps))
            )
        if not any(segment.done for segment in segments):
            return epoch, None
        key_sum = int(np.array(self.key_sums, np.uint64).sum(dtype=np.uint64))
        return epoch, EpochPosition(epoch, self.seed, self.shuffle, key_sum, segments)

    def to_vector(self) -> np.ndarray:
        """As one int64 vector (for a checkpoint's ``.npz``): ``from_vector`` reads it back."""
        sums = np.array(self.key_sums, np.uint64).view(np.int64).tolist()
        flat = [step for shard in self.next_steps for step in shard]
        head = [self.seed, int(self.shuffle), int(self.lockstep), self.num_workers, len(self.next_steps)]
        return np.array(head + list(self.rows) + sums + flat, np.int64)

    @classmethod
    def from_vector(cls, vector: np.ndarray) -> WorkerPositions:
        values = vector.tolist()
        seed, shuffle, lockstep, workers, shards = values[:5]
        rows = tuple(values[5 : 5 + workers])
        sums = tuple(np.array(values[5 + workers : 5 + 2 * workers], np.int64).view(np.uint64).tolist())
        flat = values[5 + 2 * workers :]
        if len(flat) != workers * shards:
            raise ValueError(f"Expected {workers * shards} worker positions. Received: {len(flat)}")
        steps = tuple(tuple(flat[k * workers : (k + 1) * workers]) for k in range(shards))
        return cls(seed, bool(shuffle), bool(lockstep), rows, sums, steps)
