"""What a parameter server's shards did, summed over shards and connections: the counters behind its ``stats``.

One :class:`ServerCounters` per server, which the server hands to each of its shard servers
(:mod:`sparkdl.ps.shard_server`): they add to it, the server reads it.
"""

from __future__ import annotations

import threading

#: Counts: worker operations (``pushes``, ``pulls``: each counted once, on the server's first shard), request and
#: response bytes (headers and payloads, handshakes excluded), connections closed for breaking the protocol.
COUNTS = ("pushes", "pulls", "bytes_in", "bytes_out", "protocol_errors")
#: Seconds the shards spent checking pushes for NaN and infinity, applying them, and reading weights for pulls.
SECONDS = ("check_seconds", "apply_seconds", "read_seconds")


class ServerCounters:
    """The counters of :data:`COUNTS` and :data:`SECONDS`, added to from many connection threads at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[str, float] = {**dict.fromkeys(COUNTS, 0), **dict.fromkeys(SECONDS, 0.0)}

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def snapshot(self) -> dict[str, float]:
        """Every counter's value now, by name."""
        with self._lock:
            return dict(self._values)
