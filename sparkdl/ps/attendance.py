"""Which workers of a parameter server have finished, and when any last sent a request: how a server knows its job is
over, or lost.

A server task (``server_placement="executors"``) serves until every worker has said DONE; should a worker vanish
without Spark ending the stage, the wait ends once no worker has sent a request for the server's ``timeout``.
"""

from __future__ import annotations

import threading
import time


class Attendance:
    """Workers ``0..num_workers-1``: those whose DONE a shard answered, and the time of the last request of any."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.last_request = time.monotonic()  # when a shard last read a request (the server's start, before any)
        self._finished: set[int] = set()
        self._stopping = False
        self._cond = threading.Condition()

    def heard(self) -> None:
        """A shard read a request."""
        self.last_request = time.monotonic()

    def finished(self, worker: int) -> None:
        """A shard answered ``worker``'s DONE."""
        with self._cond:
            self._finished.add(worker)
            self._cond.notify_all()

    def wait(self, timeout: float, shards: list[int], poll: float = 1.0) -> bool:
        """Waits until every worker has finished (True), or :meth:`stop` (False); raises ``TimeoutError`` naming the
        workers that never said DONE (and ``shards``, the server's) once no request came for ``timeout`` seconds."""
        with self._cond:
            while len(self._finished) < self.num_workers:
                if self._stopping:
                    return False
                if time.monotonic() - self.last_request > timeout:
                    missing = sorted(set(range(self.num_workers)) - self._finished)
                    raise TimeoutError(
                        f"parameter server shard(s) {shards}: no worker sent a request for timeout={timeout}s, and "
                        f"worker(s) {missing} never said they were done (their tasks were lost?); raise timeout if a "
                        "worker's step, validation or callbacks take that long"
                    )
                self._cond.wait(poll)
            return True

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
