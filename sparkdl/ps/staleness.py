"""Worker clocks and the bounded-staleness (SSP) gate, shared by all shard servers of a job."""

from __future__ import annotations

import threading
import time


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
    """

    def __init__(self, num_workers: int, max_staleness: int | None):
        """``max_staleness=None``: no gate (async/hogwild), staleness is only measured."""
        self.num_workers = num_workers
        self.max_staleness = max_staleness
        self.clocks = [0] * num_workers
        self.done = [False] * num_workers
        self.max_seen = 0
        self._stopping = False
        self._cond = threading.Condition()

    def _min_active(self) -> int | None:
        active = [c for c, d in zip(self.clocks, self.done) if not d]
        return min(active) if active else None

    def _staleness(self, worker: int) -> int:
        slowest = self._min_active()
        return 0 if slowest is None else self.clocks[worker] - slowest

    def advance(self, worker: int) -> None:
        with self._cond:
            self.clocks[worker] += 1
            self.done[worker] = False
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
            while True:
                if self._stopping:
                    raise ServerStopping()
                staleness = self._staleness(worker)
                if self.max_staleness is None or staleness <= self.max_staleness:
                    self.max_seen = max(self.max_seen, staleness)
                    return staleness
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
                self._cond.wait(remaining)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def snapshot(self) -> tuple[list[int], int]:
        with self._cond:
            return list(self.clocks), self.max_seen
