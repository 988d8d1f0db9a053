"""How a shard turns the pushes it receives into updates: the parameter server's update rules.

Every shard server (:mod:`sparkdl.ps.shard_server`) reads, checks and answers requests the same
way; what a push does and when a pull may read is its rule's. A rule is an :class:`UpdateRule`,
chosen once from the mode's name (``sparkdl.modes.parameter_server``), small and picklable (it
travels to server tasks), which makes each shard's side of it (``updates``), the worker clocks
(``clocks``) and, for rounds, the roster the shards share (``roster``):

=========================  ===========================================  ==========================================
rule (mode)                a push                                       a pull
=========================  ===========================================  ==========================================
``Immediate`` (async)      applied as it arrives, under the shard's     reads the weights as they are
                           lock (:class:`ImmediateUpdates`)
``Hogwild`` (hogwild)      applied as it arrives, without a lock        reads the weights as they are, not waiting
                           (SGD's concurrently; another optimizer's     for applies
                           one at a time: ``server_model``)
``BoundedStaleness``       as ``Immediate``                             waits at the server-wide staleness gate
(ssp)                                                                   (:mod:`sparkdl.ps.staleness`), then reads
``SyncRounds`` (sync_ps)   kept as its worker's part of the step it     waits until the round of the worker's last
                           names; once every worker's push of that      push is applied, then reads: every worker
                           step is in, their mean, each weighted by     pulls the same weights for the next step
                           the rows behind it, is applied once with
                           the shard's optimizer (:class:`RoundUpdates`)
=========================  ===========================================  ==========================================

``SyncRounds`` is the synchronous parameter server (the lectures' "centralized synchronous" SGD): per
shard, one update per step, the mean over all of the step's rows, which is what ``mode="sync"``
applies (``sparkdl.schedule.gradient_scales`` weighs its ranks' gradients the same way). A push is
kept where it was received, in its connection's buffer, until its round is applied (the connection
takes a fresh buffer if another push comes first), and the mean is summed in worker order, so the
result does not depend on the order the pushes arrived in. A worker whose task Spark retried starts
again from the fit's first step: its pushes of steps already applied are dropped (``replayed``) and
its pulls answered at once, until it catches up with the round being collected. Every wait is
bounded by the server's ``timeout``, and its error names the workers waited for.

:class:`Roster` is what the shards of a synchronous server share: the workers' training rows, which
every worker learns before its first step (:data:`~sparkdl.ps.protocol.Msg.JOIN`) so that all follow
one schedule of equal steps per epoch (``Settings.for_rows``), and, where the driver checkpoints, the
epochs whose rounds may be applied: the first round of an epoch waits until the driver has saved the
server's state at the end of the epoch before (:meth:`Roster.epoch_saved`), so that a checkpoint holds
exactly the weights after that epoch's last step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import typing
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from sparkdl.keras import adopted
from sparkdl.ps.positions import UNKNOWN
from sparkdl.ps.staleness import ClockTracker, ServerStopping

_log = logging.getLogger(__name__)


class RoundTimeout(Exception):
    """A pull (or a join) waited the server's ``timeout`` for other workers; the message names them."""


class RoundFailed(Exception):
    """A round's update raised: every worker waiting for it fails with the message."""


class PushRefused(Exception):
    """A push the rule cannot take (a step ahead of the round being collected, a join refused): ``BAD_REQUEST``."""


class UpdatedShard(typing.Protocol):
    """What a rule updates: one shard server's shard (``sparkdl.ps.shard_server.ShardServer``)."""

    index: int  # the shard's index in the model's layout
    size: int  # its float32 parameters
    lock: threading.Lock | None  # serialises its updates and reads (None under hogwild)
    version: int  # updates applied

    def locked(self) -> contextlib.AbstractContextManager:
        """The shard's lock, or nothing where it has none."""

    def apply(self, gradient: np.ndarray) -> int:
        """Applies ``gradient`` and counts the update; returns the shard's version after it."""


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    """How a parameter server turns pushes into updates: one of :class:`Immediate`, :class:`Hogwild`,
    :class:`BoundedStaleness` and :class:`SyncRounds` (see the module doc)."""

    name: ClassVar[str]  # the mode it is, for messages
    locked: ClassVar[bool] = True  # a lock serialises each shard's updates and reads (so XLA may fuse an update)
    synchronous: ClassVar[bool] = False  # workers join, push numbered steps and pull each step's one update
    waits_for_every_worker: ClassVar[bool] = False  # a worker that never comes stops the others (after ``timeout``)

    def clocks(self, num_workers: int, spare: int = 0) -> ClockTracker:
        """The server's worker clocks: measured, gating no pull (no worker waits for another: ``spare``, the workers
        the others may go on without, changes nothing)."""
        return ClockTracker(num_workers, None)

    def roster(self, num_workers: int, epoch_steps: Callable[[list[int]], int] | None) -> Roster | None:
        """What the server's shards share beyond the clocks: nothing."""
        return None

    def updates(
        self, shard: UpdatedShard, roster: Roster | None, next_steps: Sequence[int]
    ) -> ImmediateUpdates | RoundUpdates:
        """``shard``'s side of the rule: each push applied as it arrives. ``next_steps``: each worker's first step
        the shard has not applied (``sparkdl.ps.positions``; ``UNKNOWN`` where none)."""
        return ImmediateUpdates(shard, next_steps)


@dataclasses.dataclass(frozen=True)
class Immediate(UpdateRule):
    """async: each push applied as it arrives, under its shard's lock."""

    name: ClassVar[str] = "async"


@dataclasses.dataclass(frozen=True)
class Hogwild(UpdateRule):
    """hogwild: each push applied as it arrives, with no lock: concurrent pushes update a shard concurrently."""

    name: ClassVar[str] = "hogwild"
    locked: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class BoundedStaleness(UpdateRule):
    """ssp: as :class:`Immediate`, and a worker's pull waits while it is more than ``max_staleness`` pushes ahead of
    the slowest active worker."""

    name: ClassVar[str] = "ssp"
    waits_for_every_worker: ClassVar[bool] = True  # but with ``spare`` (``clocks``) for those it may go on without
    max_staleness: int = 0

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def clocks(self, num_workers: int, spare: int = 0) -> ClockTracker:
        """The gate: up to ``spare`` workers silent for a held pull's timeout are set aside (``ClockTracker``)."""
        return ClockTracker(num_workers, self.max_staleness, spare)


@dataclasses.dataclass(frozen=True)
class SyncRounds(UpdateRule):
    """sync_ps: one round per step, every worker's push of it in, their row-weighted mean applied once."""

    name: ClassVar[str] = "sync_ps"
    synchronous: ClassVar[bool] = True
    waits_for_every_worker: ClassVar[bool] = True

    def roster(self, num_workers: int, epoch_steps: Callable[[list[int]], int] | None) -> Roster:
        """The workers' rows, and (with ``epoch_steps``) the epochs whose rounds may run."""
        return Roster(num_workers, epoch_steps)

    def updates(self, shard: UpdatedShard, roster: Roster | None, next_steps: Sequence[int]) -> RoundUpdates:
        assert roster is not None, "SyncRounds.roster made one"
        return RoundUpdates(shard, roster, next_steps)


class ImmediateUpdates:
    """One shard's side of ``Immediate``, ``Hogwild`` and ``BoundedStaleness``: each push applied as it arrives, under
    the shard's lock where it has one, but one of a step the shard applied already from a worker that asked where
    it resumes (an earlier attempt of it pushed the step: ``sparkdl.ps.positions``), which is dropped."""

    carries_rows = False  # a push's header ``tag`` stays 0

    def __init__(self, shard: UpdatedShard, next_steps: Sequence[int]):
        self._shard = shard
        self._next = list(next_steps)  # worker -> the first of its steps not applied here (UNKNOWN: none yet)
        self._resumed: set[int] = set()  # the workers that asked where they resume: held to their steps
        self.replayed = 0  # pushes of steps applied already, dropped

    def push(self, worker: int, gradient: np.ndarray, step: int, rows: int) -> int:
        """Applies ``gradient``, the worker's push of global ``step``; returns the shard's version after it."""
        with self._shard.locked():
            if worker in self._resumed and step < self._next[worker]:
                self.replayed += 1
                return self._shard.version
            version = self._shard.apply(gradient)
            self._next[worker] = max(self._next[worker], step + 1)
            return version

    def resume(self, worker: int) -> int:
        """Where ``worker`` resumes: the first of its steps this shard has not applied (``UNKNOWN``: none yet); from
        now on its pushes of steps before that are dropped."""
        with self._shard.locked():
            self._resumed.add(worker)
            return self._next[worker]

    def next_steps(self) -> list[int]:
        """Every worker's :meth:`next_step` (the caller holds the shard's lock, for a state of one moment)."""
        return list(self._next)

    def admit_pull(self, worker: int, timeout: float) -> None:
        """A pull reads the weights as they are."""

    def holds(self, buffer: np.ndarray) -> bool:
        """Whether ``buffer`` (a connection's receive buffer) still holds a push the rule will read: never."""
        return False

    def stats(self) -> dict[str, int]:
        """``replayed_pushes``: pushes of steps applied already, dropped."""
        return {"replayed_pushes": self.replayed}

    def stop(self) -> None:
        pass


class Roster:
    """A synchronous server's workers: their training rows (the join), and the epochs whose rounds may be applied.

    ``epoch_steps`` (where the driver checkpoints): the steps per epoch of workers holding the joined rows
    (``sparkdl.schedule.steps_per_epoch``). With it, the rounds of the fit's first epoch may be applied, and
    those of each later epoch once :meth:`epoch_saved` says the epoch before is saved.
    """

    def __init__(self, num_workers: int, epoch_steps: Callable[[list[int]], int] | None = None):
        self.num_workers = num_workers
        self._epoch_steps = epoch_steps
        self._rows: list[int | None] = [None] * num_workers
        self._steps: int | None = None  # per epoch, once every worker joined (with epoch_steps)
        self._open_through: int | None = None  # the last epoch whose rounds may be applied
        self._held_after: int | None = None  # a step checkpoint's step: later rounds wait until it is saved
        self._stopping = False
        self._cond = threading.Condition()
        self._rules: list[RoundUpdates] = []

    def join(self, worker: int, rows: int, timeout: float) -> list[int]:
        """Records ``worker``'s training rows and waits until every worker has joined; returns every worker's.

        A retried worker joins again, with the rows of its first attempt (another count would put it on another
        schedule than the others: :class:`PushRefused`).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            known = self._rows[worker]
            if known is not None and known != rows:
                raise PushRefused(
                    f"worker {worker} joined with {rows} training rows, but an earlier attempt of it joined with "
                    f"{known}: its partition changed between attempts (a DataFrame whose rows are not "
                    "deterministic: cache or checkpoint it before fit)"
                )
            self._rows[worker] = rows
            if self._epoch_steps is not None and self._steps is None and None not in self._rows:
                self._steps = self._epoch_steps(typing.cast(list[int], self._rows))
            self._cond.notify_all()
            while None in self._rows:
                if self._stopping:
                    raise ServerStopping()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [w for w, n in enumerate(self._rows) if n is None]
                    raise RoundTimeout(
                        f"worker {worker} waited timeout={timeout}s for every worker to join the synchronous "
                        f"parameter server; worker(s) {missing} never joined (joined: "
                        f"{[w for w, n in enumerate(self._rows) if n is not None]}): check that their tasks are "
                        "running (the cluster has a free task slot for each worker), or raise timeout"
                    )
                self._cond.wait(remaining)
            return typing.cast(list[int], list(self._rows))

    def is_open(self, step: int) -> bool:
        """Whether the round of ``step`` may be applied now (the first round asked about opens the fit's first
        epoch)."""
        with self._cond:
            if self._held_after is not None and step > self._held_after:
                return False
            if self._steps is None:
                return True
            epoch = step // self._steps
            if self._open_through is None:
                self._open_through = epoch
            return epoch <= self._open_through

    def epoch_of(self, step: int) -> int | None:
        """The epoch ``step`` belongs to, where the roster knows the steps per epoch."""
        with self._cond:
            return None if self._steps is None else step // self._steps

    def epoch_saved(self, epoch: int) -> None:
        """The driver saved the state after ``epoch``: the rounds of the next epoch may be applied (those complete
        already are, here)."""
        with self._cond:
            self._open_through = epoch + 1 if self._open_through is None else max(self._open_through, epoch + 1)
            rules = list(self._rules)
        for rule in rules:
            rule.apply_if_ready()

    def hold_after(self, step: int) -> None:
        """A worker asked for a step checkpoint after ``step``: the rounds after it wait for :meth:`step_saved`, so
        that every shard's state is the one after that step."""
        with self._cond:
            self._held_after = step

    def held_after(self) -> int | None:
        """The step after which the rounds wait for a step checkpoint, if any."""
        with self._cond:
            return self._held_after

    def step_saved(self) -> None:
        """The driver saved (or read, for its checkpoint) the state after the held step: the next rounds may run."""
        with self._cond:
            self._held_after = None
            rules = list(self._rules)
        for rule in rules:
            rule.apply_if_ready()

    def attach(self, rule: RoundUpdates) -> None:
        with self._cond:
            self._rules.append(rule)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


class RoundUpdates:
    """One shard's side of ``SyncRounds``, one round per step: every worker's push in, their row-weighted mean applied
    once."""

    carries_rows = True  # a push's header ``tag`` carries the rows behind it

    def __init__(self, shard: UpdatedShard, roster: Roster, next_steps: Sequence[int]):
        self._shard = shard
        self._roster = roster
        self._num_workers = roster.num_workers
        self._cond = threading.Condition(shard.lock)
        # the step whose pushes are being collected: where the shard's positions resume (the same for every worker),
        # else from the fit's first push
        self.step: int | None = None if UNKNOWN in next_steps else min(next_steps)
        self.rounds = 0  # rounds applied
        self.replayed = 0  # pushes of steps applied already (a retried worker catching up), dropped
        self._pushes: dict[int, tuple[np.ndarray, int]] = {}  # worker -> (its gradient, its rows) for self.step
        self._last: dict[int, int] = {}  # worker -> the step of its newest push
        self._mean: np.ndarray | None = None  # float32 buffers of the shard's size, reused every round
        self._scratch: np.ndarray | None = None
        self._failed: str | None = None
        self._stopping = False
        roster.attach(self)

    def push(self, worker: int, gradient: np.ndarray, step: int, rows: int) -> int:
        """Keeps ``gradient`` (``rows`` rows behind it) as ``worker``'s part of ``step``; applies the round when it is
        the last part. Returns the shard's version."""
        with self._cond:
            if self._failed is not None:
                raise RoundFailed(self._failed)
            if self.step is None:
                self.step = step  # the fit's first push: every worker starts at the same step
            if step < self.step:  # applied already: a retried worker catching up
                self.replayed += 1
                self._last[worker] = step
                return self._shard.version
            if step > self.step:
                raise PushRefused(
                    f"worker {worker} pushed step {step}, but shard {self._shard.index} collects step {self.step}: "
                    "a worker pulls the update of each step before it pushes the next"
                )
            self._pushes[worker] = (gradient, rows)  # a retried worker's push replaces its failed attempt's
            self._last[worker] = step
            self._apply_if_complete()
            return self._shard.version

    def admit_pull(self, worker: int, timeout: float) -> None:
        """Waits until the round of ``worker``'s newest push is applied (at once for a worker that has not pushed, or
        whose push was of a step applied already)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._stopping:
                    raise ServerStopping()
                if self._failed is not None:
                    raise RoundFailed(self._failed)
                last = self._last.get(worker)
                if last is None or self.step is None or last < self.step:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RoundTimeout(self._waiting(worker, timeout))
                self._cond.wait(remaining)

    def resume(self, worker: int) -> int:
        """Where ``worker`` resumes: the first of its steps this shard has not applied, every worker's: the round being
        collected (``UNKNOWN`` before the first push)."""
        with self._cond:
            return UNKNOWN if self.step is None else self.step

    def next_steps(self) -> list[int]:
        """Every worker's :meth:`next_step` (the caller holds the shard's lock, for a state of one moment)."""
        return [UNKNOWN if self.step is None else self.step] * self._num_workers

    def holds(self, buffer: np.ndarray) -> bool:
        """Whether ``buffer`` holds a push of the round being collected (the connection must receive elsewhere)."""
        with self._cond:
            return any(gradient is buffer for gradient, _ in self._pushes.values())

    def stats(self) -> dict[str, int]:
        """``rounds``: the rounds applied; ``replayed_pushes``: pushes of steps applied already, dropped."""
        with self._cond:
            return {"rounds": self.rounds, "replayed_pushes": self.replayed}

    def apply_if_ready(self) -> None:
        """Applies the round being collected if it is complete and open (after :meth:`Roster.epoch_saved`)."""
        with self._cond, contextlib.suppress(RoundFailed):
            if self.step is not None:  # (before the first push: nothing to apply)
                self._apply_if_complete()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _apply_if_complete(self) -> None:
        """With the lock held: the mean of the round's pushes, each weighted by its rows, applied once."""
        assert self.step is not None
        if len(self._pushes) < self._num_workers or not self._roster.is_open(self.step):
            return
        pushes = [self._pushes[worker] for worker in range(self._num_workers)]
        try:
            self._shard.apply(self._weighted_mean(pushes))
        except Exception as exc:
            _log.exception("parameter server shard %d: the update of step %d failed", self._shard.index, self.step)
            self._failed = f"shard {self._shard.index} failed to apply the update of step {self.step}: {exc!r}"
            self._cond.notify_all()
            raise RoundFailed(self._failed) from exc
        self._pushes.clear()
        self.step += 1
        self.rounds += 1
        self._cond.notify_all()

    def _weighted_mean(self, pushes: Sequence[tuple[np.ndarray, int]]) -> np.ndarray:
        """``sum(rows_w * g_w) / sum(rows_w)`` in float32, summed in worker order: the mean over all of the step's
        rows. A filler step's push (no rows) weighs nothing."""
        total = sum(rows for _, rows in pushes)
        if total <= 0:
            raise ValueError(f"no worker had rows at step {self.step}")
        if self._mean is None:
            self._mean = adopted.aligned_empty(self._shard.size, np.float32)
            self._scratch = np.empty(self._shard.size, np.float32)
        mean, scratch = self._mean, self._scratch
        assert scratch is not None
        first = True
        for gradient, rows in pushes:
            if rows == 0:
                continue
            weight = np.float32(rows / total)
            if first:
                np.multiply(gradient, weight, out=mean, dtype=np.float32)
                first = False
            else:
                np.multiply(gradient, weight, out=scratch, dtype=np.float32)
                np.add(mean, scratch, out=mean)
        return mean

    def _waiting(self, worker: int, timeout: float) -> str:
        """The timeout's message: which workers' pushes the round lacks (or that the driver's checkpoint holds it)."""
        step = self.step
        missing = [w for w in range(self._num_workers) if w not in self._pushes]
        if not missing:
            held = self._roster.held_after()
            if held is not None and step is not None and step > held:
                return (
                    f"worker {worker} waited timeout={timeout}s for the update of step {step} on shard "
                    f"{self._shard.index}, which waits until the driver has saved the step checkpoint after step "
                    f"{held}; check the driver's log for a failed checkpoint, or raise timeout"
                )
            epoch = self._roster.epoch_of(step) if step is not None else None
            return (
                f"worker {worker} waited timeout={timeout}s for the update of step {step} on shard "
                f"{self._shard.index}, the first of epoch {'?' if epoch is None else epoch + 1}, which waits until "
                "the driver has saved the checkpoint of the epoch before; check the driver's log for a failed "
                "checkpoint, or raise timeout"
            )
        return (
            f"worker {worker} waited timeout={timeout}s for the update of step {step} on shard "
            f"{self._shard.index}, which lacks the push(es) of worker(s) {missing} (pushed: {sorted(self._pushes)}); "
            "every worker pushes every step in mode='sync_ps': check that those tasks are running (one that died "
            "is retried by Spark and catches up), or raise timeout"
        )
