"""Worker clocks and the bounded-staleness (SSP) gate, shared by all shard servers of a job."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)
_POLL_SECONDS = 1.0  # how often a held pull looks for a silent worker to set aside


class StalenessTimeout(Exception):
    """A pull waited ``timeout`` seconds for the slowest worker to catch up."""


class ServerStopping(Exception):
    """The server stopped while a pull was waiting."""


class ClockTracker:
    """Clocks of workers ``0..num_workers-1``: the number of pushes each has completed.

    A worker's clock is global across shards: the shard-0 server advances it
    once per push, after applying that push (every push goes to every shard,
    and a client waits for all shards' acknowledgements before it pulls
    again, so the clock is current by the worker's next pull).

    The slowest worker is the minimum clock over the *active* workers: every
    worker id that has not called ``done()``.  Workers that have not connected
    yet count with clock 0, so a fast worker cannot run away before the others
    start; a worker that crashed keeps its clock (and holds back the others)
    until Spark's retry connects with the same id and carries on.  A pull or
    push from a worker that called ``done()`` makes it active again.

    With ``spare`` (``num_workers - min_workers``), up to that many workers that
    hold a pull back and have sent nothing for the pull's ``timeout`` (a lost
    host, a task waiting for a slot) are set aside: they hold nobody back until
    they come back and catch up with the slowest active worker, and the others
    go on without them (``set_aside`` lists every worker set aside so far).
    """

    def __init__(self, num_workers: int, max_staleness: int | None, spare: int = 0):
        """``max_staleness=None``: no gate (async/hogwild), staleness is only measured."""
        self.num_workers = num_workers
        self.max_staleness = max_staleness
        self.spare = spare
        self.clocks = [0] * num_workers
        self.done = [False] * num_workers
        self.max_seen = 0
        self.set_aside: list[int] = []  # every worker set aside, in order (once each time)
        self._aside: set[int] = set()  # set aside now: silent, or back but behind the slowest active worker
        self._heard = [time.monotonic()] * num_workers  # when each worker last pulled or pushed
        self._stopping = False
        self._cond = threading.Condition()

    def _min_active(self) -> int | None:
        active = [c for w, (c, d) in enumerate(zip(self.clocks, self.done)) if not d and w not in self._aside]
        return min(active) if active else None

    def _heard_from(self, worker: int) -> None:
        self._heard[worker] = time.monotonic()
        if worker in self._aside:  # back: it holds the others again once it has caught up with them
            slowest = self._min_active()
            if slowest is None or self.clocks[worker] >= slowest:
                self._aside.discard(worker)
                logger.warning("sparkdl ps: worker %d is back at clock %d", worker, self.clocks[worker])

    def _set_aside_silent(self, timeout: float) -> bool:
        """Sets aside the slowest active workers silent for ``timeout`` seconds, while ``spare`` allows; True if any."""
        silent_since = time.monotonic() - timeout
        changed = False
        while len(self._aside) < self.spare:
            slowest = self._min_active()
            silent = [
                w
                for w in range(self.num_workers)
                if not self.done[w]
                and w not in self._aside
                and self.clocks[w] == slowest
                and self._heard[w] < silent_since
            ]
            if not silent:
                break
            worker = silent[0]
            self._aside.add(worker)
            self.set_aside.append(worker)
            changed = True
            logger.warning(
                "sparkdl ps: worker %d sent nothing for timeout=%ss at clock %d: the others go on without it "
                "(min_workers=%d)",
                worker,
                timeout,
                self.clocks[worker],
                self.num_workers - self.spare,
            )
        return changed

    def _staleness(self, worker: int) -> int:
        slowest = self._min_active()
        return 0 if slowest is None else self.clocks[worker] - slowest

    def advance(self, worker: int) -> None:
        with self._cond:
            self.clocks[worker] += 1
            self.done[worker] = False
            self._heard_from(worker)
            self._cond.notify_all()

    def finish(self, worker: int) -> None:
        with self._cond:
            self.done[worker] = True
            self._cond.notify_all()

    def admit_pull(self, worker: int, timeout: float) -> int:
        """Wait until ``worker`` may pull; record and return its staleness.

        Under ssp the pull is admitted once ``clock[worker] - min(active clocks)
        <= max_staleness``; raises :class:`StalenessTimeout` after ``timeout``
        seconds and :class:`ServerStopping` when the server stops.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            self.done[worker] = False
            self._heard_from(worker)
            while True:
                if self._stopping:
                    raise ServerStopping()
                staleness = self._staleness(worker)
                if self.max_staleness is None or staleness <= self.max_staleness:
                    self.max_seen = max(self.max_seen, staleness)
                    return staleness
                if self.spare and self._set_aside_silent(timeout):
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StalenessTimeout(
                        f"worker {worker} is at clock {self.clocks[worker]}, more than "
                        f"max_staleness={self.max_staleness} ahead of the slowest active worker "
                        f"(clock {self._min_active()}; clocks {self.clocks}), and waited "
                        f"timeout={timeout}s for it; check that all workers are running "
                        f"(a worker that never starts holds the others at clock "
                        f"{self.max_staleness}), or raise max_staleness or timeout"
                    )
                self._cond.wait(min(remaining, _POLL_SECONDS) if self.spare else remaining)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def snapshot(self) -> tuple[list[int], int, list[int]]:
        """The clocks, the largest staleness a granted pull saw, and the workers set aside so far."""
        with self._cond:
            return list(self.clocks), self.max_seen, list(self.set_aside)
