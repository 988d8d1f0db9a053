"""Where an epoch stands: which of its rows the steps so far have trained, saved in a step checkpoint and found again
by a fit that resumes mid-epoch, on the same number of workers or on another.

A fit deals each row to the shard its key gives (``shard_of``: row by row, or by whole input partitions;
``launch.layout``) and each shard trains its rows in the order of their
sort values (``schedule.sort_values``, per epoch): after ``j`` of an epoch's ``S`` steps, shard ``r`` holding ``n_r``
rows has trained the ``j * n_r // S`` first of its order. So a position needs no row ids, only a ``Segment`` per run
that trained part of the epoch: its number of shards, its steps done and planned, and each shard's rows trained.

A fit that resumes mid-epoch (``EpochRest.resume``) finds, on every worker, which of its rows the saved segments
trained: for each segment and shard ``r``, the rows with ``key mod shards == r`` (not trained by an earlier segment)
whose sort value is among the ``trained[r]`` smallest of all workers' such rows. The threshold is found by a
bisection over the 64-bit sort values, one allreduce of a count per shard and round, and the rows it marks are
counted again over all workers: a count that differs from the checkpoint's (other rows than the fit that saved
it) is refused. Then:

- on as many workers as the last segment had, it goes on: each worker's rows of that segment, in the same order,
  from the step after the saved one, with the same steps planned: the batches of the run without the fault;
- otherwise a new segment deals the epoch's untrained rows over the workers there are now (each worker's own rows,
  not trained yet, in their sort order), over the steps its largest share needs at ``batch_size`` rows a step.

The epochs after it are whole again (``schedule.epoch_steps``). Where the shards are not the ranks (a pipeline's
replicas: its first and last stage hold a copy of their replica's shard, its middle stages none), the ranks whose rows
are the shards count, one each; a rank holding a copy finds the same rows from the same counts, and one holding none
walks its shard's steps by their sizes (``EpochRest.parts``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparkdl import schedule
from sparkdl.collective.api import ReduceOp

_BITS = 64
VECTOR_FORMAT = 1  # EpochPosition.to_vector's layout: 1 since segments say how their rows were dealt


def shard_of(keys: np.ndarray, shards: int, by_partition: bool = False) -> np.ndarray:
    """The shard each row of ``keys`` is dealt to (``launch.layout``; a key is its input partition's number << 33 plus
    its place there): dealt row by row, its place plus its partition's number, modulo ``shards``, so that each input
    partition's round-robin starts at another shard; dealt ``by_partition`` (as many input partitions as shards), its
    partition's number."""
    if by_partition:
        return keys >> 33
    return np.mod((keys & ((1 << 33) - 1)) + (keys >> 33), shards)


def key_sum(keys: np.ndarray) -> int:
    """What identifies a set of rows by their keys: the sum of their keys' mix, modulo 2**64 (add workers' sums
    modulo 2**64 for all their rows)."""
    with np.errstate(over="ignore"):
        return int(schedule.sort_values(keys, seed=0, epoch=0, shuffle=True).sum(dtype=np.uint64))


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of steps over one epoch's rows on ``shards`` workers: each shard ``r`` holding ``rows[r]`` rows (those
    with ``key mod shards == r`` that earlier segments left), spread over ``planned`` steps, ``done`` of them
    trained."""

    shards: int
    rows: tuple[int, ...]
    planned: int
    done: int
    by_partition: bool = False  # the rows were dealt by whole input partitions, not row by row (``shard_of``)

    @property
    def trained(self) -> tuple[int, ...]:
        """Each shard's rows trained so far: the first ``done * rows[r] // planned`` of its order."""
        return tuple(self.done * n // self.planned for n in self.rows)

    def after(self, done: int) -> Segment:
        return dataclasses.replace(self, done=done)


@dataclasses.dataclass(frozen=True)
class EpochPosition:
    """Epoch ``epoch`` (``epoch`` epochs complete) partly trained, by ``segments`` in the order they ran, its rows
    ordered by ``seed`` and ``shuffle`` (``schedule.sort_values``); ``key_sum`` identifies the epoch's rows (``key_sum``
    of all workers' keys), so that a resume on other rows is refused."""

    epoch: int
    seed: int
    shuffle: bool
    key_sum: int
    segments: tuple[Segment, ...]

    @property
    def steps(self) -> int:
        """The steps trained into the epoch, over all its segments."""
        return sum(segment.done for segment in self.segments)

    def to_vector(self) -> np.ndarray:
        """As one int64 vector (for a checkpoint's ``.npz``, or a broadcast): ``from_vector`` reads it back.

        Its first value is ``-VECTOR_FORMAT``: a vector written before segments said how their rows were dealt starts
        with the epoch (>= 0), and its segments were dealt row by row."""
        head = [
            -VECTOR_FORMAT,
            self.epoch,
            self.seed,
            int(self.shuffle),
            int(np.uint64(self.key_sum).view(np.int64)),
            len(self.segments),
        ]
        body = [n for s in self.segments for n in (s.shards, s.planned, s.done, int(s.by_partition), *s.rows)]
        return np.array(head + body, np.int64)

    @classmethod
    def from_vector(cls, vector: np.ndarray) -> EpochPosition:
        values = vector.tolist()
        version = -values.pop(0) if values[0] < 0 else 0
        if version not in (0, VECTOR_FORMAT):
            raise ValueError(
                f"Expected an epoch position of format {VECTOR_FORMAT} or earlier. Received format {version}: a "
                "checkpoint written by a newer sparkdl."
            )
        epoch, seed, shuffle, key_sum, count = values[:5]
        segments, offset = [], 5
        fields = 4 if version else 3  # shards, planned, done[, by_partition]
        for _ in range(count):
            shards, planned, done = values[offset : offset + 3]
            by_partition = bool(values[offset + 3]) if version else False
            rows = tuple(values[offset + fields : offset + fields + shards])
            segments.append(Segment(shards, rows, planned, done, by_partition))
            offset += fields + shards
        return cls(epoch, seed, bool(shuffle), int(np.int64(key_sum).view(np.uint64)), tuple(segments))


@dataclasses.dataclass(frozen=True)
class EpochRest:
    """On one worker, what is left of an epoch: the segment it trains (every shard's rows in it, its steps planned
    and done), the shard whose steps it walks and its own rows of that shard's part of the segment in order (row
    numbers; none on a worker that holds none of its shard's rows)."""

    start: EpochPosition  # the epoch's identity (and, resumed, where it stood); its segments are not read here
    earlier: tuple[Segment, ...]  # segments of earlier runs, complete as far as this one is concerned
    segment: Segment  # the segment this run trains, from step ``segment.done``
    order: np.ndarray  # this worker's rows of the segment, in the order they are trained
    shard: int  # the shard of the segment whose steps this worker walks

    @classmethod
    def resume(
        cls,
        position: EpochPosition,
        keys: np.ndarray,
        key_sum: int,
        comm,
        *,
        batch_size: int,
        shards: range | None = None,
        shard: int | None = None,
        by_partition: bool = False,
    ) -> EpochRest:
        """Collective: the rest of ``position``'s epoch on this worker of ``comm``, holding ``keys`` of all shards'
        ``key_sum`` (see the module's docstring).

        ``shards``: the ranks of ``comm`` whose rows are the shards, one each in order (default: every rank);
        ``shard``: the shard whose steps this rank walks (default: its own rank's place in ``shards``). A rank outside
        ``shards`` holds a copy of its shard's rows (``keys``), or none, and adds nothing to the counts.
        ``by_partition``: this run's rows were dealt by whole input partitions (a new segment says so).
        """
        shards = range(comm.size) if shards is None else shards
        counted = comm.rank in shards
        if shard is None:
            shard = shards.index(comm.rank)
        if key_sum != position.key_sum:
            raise ValueError(
                f"Expected the rows the checkpoint of epoch {position.epoch} (step {position.steps}) was taken on. "
                "Received other rows (their keys differ): the input changed, or its partitions did (a row's key is "
                "its input partition and place there). Resume on the same input, or start another checkpoint_dir."
            )
        values = schedule.sort_values(keys, seed=position.seed, epoch=position.epoch, shuffle=position.shuffle)
        trained = np.zeros(len(keys), bool)
        last = position.segments[-1]
        goes_on = last.shards == len(shards) and last.by_partition == by_partition
        done_before = position.segments[:-1] if goes_on else position.segments
        for segment in done_before:
            trained |= _trained_by(segment, keys, values, trained, comm, counted)
        left = np.flatnonzero(~trained)
        order = left[np.argsort(values[left], kind="stable")]
        counts = comm.allgather(np.array([len(order)], np.int64))[list(shards), 0].tolist()
        if goes_on:
            if tuple(counts) != last.rows:
                raise ValueError(
                    f"Expected the rows the checkpoint of epoch {position.epoch} was saved on: {list(last.rows)} "
                    f"rows per worker in its last segment. Received: {counts}. The input changed since."
                )
            return cls(position, position.segments[:-1], last, order, shard)
        steps = schedule.steps_per_epoch([max(1, n) for n in counts], batch_size)
        if not len(order) and len(keys):  # nothing of the epoch left here: filler steps on one of its rows
            order = np.zeros(1, np.int64)
        segment = Segment(len(shards), tuple(counts), steps, 0, by_partition)
        return cls(position, position.segments, segment, order, shard)

    @property
    def epoch(self) -> int:
        return self.start.epoch

    @property
    def steps_left(self) -> int:
        return self.segment.planned - self.segment.done

    @property
    def rows_left(self) -> int:
        """The rows of this worker's shard the steps left train."""
        segment, n = self.segment, self.segment.rows[self.shard]
        return n - segment.done * n // segment.planned

    def position_after(self, steps: int) -> EpochPosition:
        """The position once ``steps`` more of the segment's steps are trained."""
        segments = (*self.earlier, self.segment.after(self.segment.done + steps))
        return dataclasses.replace(self.start, segments=segments)

    def parts(self, *, fillers: bool = True) -> list[schedule.EpochSteps]:
        """This worker's steps left, as the schedule's one part (``schedule.EpochSteps``: its shard's steps, whose
        spans a worker holding none of the shard's rows reads for their sizes only)."""
        segment, n = self.segment, self.segment.rows[self.shard]
        bounds = np.arange(segment.planned + 1, dtype=np.int64) * n // segment.planned
        spans = []
        for step in range(segment.done, segment.planned):
            if bounds[step] < bounds[step + 1]:
                spans.append((int(bounds[step]), int(bounds[step + 1])))
            elif fillers:  # a one-row step whose gradient weighs nothing (``scales``), as the schedule's fillers
                spans.append((0, 1))
        return [schedule.EpochSteps(self.order, spans)] if spans else []

    def scales(self, rank: int) -> np.ndarray | None:
        """Per step left, what this worker's gradient weighs (``schedule.gradient_scales`` of the segment)."""
        full = schedule.gradient_scales(self.segment.rows, rank, self.segment.planned)
        return None if full is None else full[self.segment.done :]


def step_scales(per_epoch: np.ndarray | None, rest: EpochRest | None, shard: int) -> schedule.StepScales | None:
    """What shard ``shard``'s gradient weighs at each step of a fit, from its first (``schedule.StepScales``): the
    steps left of a resumed epoch (``rest``, where it resumed mid-epoch) by their own segment's rows, then every
    whole epoch's by ``per_epoch`` (``schedule.gradient_scales``)."""
    if rest is None:
        return schedule.StepScales.of(per_epoch)
    return schedule.StepScales.of(per_epoch, rest.scales(shard), rest.steps_left)


def _trained_by(
    segment: Segment, keys: np.ndarray, values: np.ndarray, before: np.ndarray, comm, counted: bool
) -> np.ndarray:
    """Collective: the rows (of this worker's ``keys``) ``segment`` trained, among those not trained ``before``; the
    counts are of the ``counted`` workers' rows (a worker holding a copy of another's finds the same rows)."""
    shard = shard_of(keys, segment.shards, segment.by_partition)
    candidates = ~before
    counts_of = candidates & counted  # the rows this worker adds to the counts
    wanted = np.array(segment.trained, np.int64)
    # the smallest threshold t per shard with count(value <= t) >= wanted, over every worker's candidates
    low = np.zeros(segment.shards, np.uint64)
    high = np.full(segment.shards, np.iinfo(np.uint64).max, np.uint64)
    for _ in range(_BITS):
        middle = low + (high - low) // np.uint64(2)
        below = values <= middle[shard]
        counts = np.bincount(shard[counts_of & below], minlength=segment.shards).astype(np.int64)
        counts = comm.allreduce(counts, ReduceOp.SUM)
        enough = counts >= wanted
        high = np.where(enough, middle, high)
        low = np.where(enough, low, middle + np.uint64(1))
    marked = candidates & (values <= high[shard]) & (wanted[shard] > 0)
    found = np.bincount(shard[marked & counts_of], minlength=segment.shards).astype(np.int64)
    found = comm.allreduce(found, ReduceOp.SUM)
    if not np.array_equal(found, wanted):
        raise ValueError(
            f"Expected the rows a checkpoint's segment trained: {wanted.tolist()} per shard of {segment.shards}. "
            f"Received: {found.tolist()} among the rows read now. The input changed since the checkpoint."
        )
    return marked
