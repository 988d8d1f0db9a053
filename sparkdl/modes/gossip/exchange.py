"""One gossip round on the wire: this rank's weights to its neighbours and theirs back, started now, finished later.

A round is started with a snapshot of this rank's weights (one float32 vector, sent raw with
point-to-point ``send``, never pickled) and finished with the correction that turns the weights
into their neighbourhood average: ``sum_j w_j * (x_j - snapshot)`` over the neighbours ``j``.
Between the two the caller goes on computing (``hook``: the next step's forward and backward pass).

A communicator runs its operations one at a time, and a ``send`` of a large array returns only once
the peer reads it: two neighbours that both sent first on one queue would wait for each other.
So the messages travel on streams split from the communicator, one per edge colour and direction
(``peers``: no rank has two edges of one colour): on each stream a rank has at most one operation
per round, and every receive is posted while the sends go.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from sparkdl.collective.api import Communicator, Work
from sparkdl.modes.gossip.peers import Neighbour, colours, neighbours
from sparkdl.net.errors import CollectiveTimeout

_TAGS = 1 << 32  # message tags: the round number, modulo this


class Streams:
    """The communicators a rank's gossip messages travel on: two per edge colour, lower to higher rank and back.

    Collective to create: every rank splits the same streams from ``comm`` in the same order.
    """

    def __init__(self, comm: Communicator, colours: int):
        self._streams: list[tuple[Communicator, Communicator]] = []
        for _ in range(colours):
            up, down = comm.split(range(comm.size)), comm.split(range(comm.size))
            assert up is not None and down is not None  # every rank is a member
            self._streams.append((up, down))

    def sending_to(self, rank: int, peer: int, colour: int) -> Communicator:
        """The stream of this rank's messages to ``peer``."""
        return self._streams[colour][0 if rank < peer else 1]

    def receiving_from(self, rank: int, peer: int, colour: int) -> Communicator:
        """The stream of ``peer``'s messages to this rank."""
        return self._streams[colour][0 if peer < rank else 1]

    def close(self) -> None:
        for pair in self._streams:
            for stream in pair:
                stream.close()


@dataclasses.dataclass
class _Round:
    number: int
    snapshot: np.ndarray  # what this rank sent: kept alive (and unchanged) until the sends are done
    receives: list[tuple[Neighbour, Work]]
    sends: list[tuple[Neighbour, Work]]


class Gossip:
    """A rank's rounds of averaging with its neighbours (``peers``: "ring" or "random", with ``seed``).

    At most one round is in flight. ``timeout`` bounds every wait for a neighbour.
    """

    def __init__(self, comm: Communicator, peers: str, *, seed: int, timeout: float):
        self.rank, self.size = comm.rank, comm.size
        self.peers, self.seed, self.timeout = peers, seed, timeout
        self._streams = Streams(comm, colours(peers, comm.size))
        self._round: _Round | None = None
        self._buffers: dict[int, np.ndarray] = {}  # by neighbour position: where its weights land, reused
        self.rounds = 0  # rounds finished (a drained one included: its bytes went over the wire)
        self.bytes_sent = 0  # payload bytes of the weights this rank sent
        self.wait_seconds = 0.0  # time the caller spent waiting for a round to finish

    @property
    def in_flight(self) -> bool:
        return self._round is not None

    def start(self, weights: np.ndarray, number: int) -> None:
        """Starts round ``number`` with ``weights`` (a float32 vector this rank must not change until it finishes)."""
        if self._round is not None:
            raise RuntimeError(
                f"rank {self.rank}: gossip round {number} started before round {self._round.number} ended"
            )
        if weights.dtype != np.float32 or weights.ndim != 1:
            raise TypeError(f"Expected a float32 vector of weights. Received: {weights.dtype} of shape {weights.shape}")
        tag = number % _TAGS
        receives, sends = [], []
        mine = neighbours(self.peers, self.rank, self.size, seed=self.seed, round=number)
        for position, neighbour in enumerate(mine):  # receives first: posted before any send can wait for one
            buffer = self._buffers.get(position)
            if buffer is None or buffer.shape != weights.shape:
                buffer = self._buffers[position] = np.empty_like(weights)
            stream = self._streams.receiving_from(self.rank, neighbour.rank, neighbour.colour)
            receives.append((neighbour, stream.recv_async(neighbour.rank, tag=tag, out=buffer)))
        for neighbour in mine:
            stream = self._streams.sending_to(self.rank, neighbour.rank, neighbour.colour)
            sends.append((neighbour, stream.send_async(weights, neighbour.rank, tag=tag)))
        self._round = _Round(number, weights, receives, sends)

    def finish(self) -> np.ndarray:
        """Waits for the round in flight; returns ``sum_j w_j * (x_j - snapshot)``, the change that makes the
        snapshot the neighbourhood's weighted average (zeros for a rank without neighbours this round).

        The change is computed in place in the neighbours' receive buffers (no temporary the size of the
        model): the array returned is one of them, valid until the next round starts.
        """
        current = self._take()
        started = time.monotonic()
        correction = None
        for neighbour, work in current.receives:
            theirs = self._wait(work, current.number, f"receive the weights of rank {neighbour.rank}")
            np.subtract(theirs, current.snapshot, out=theirs)
            theirs *= np.float32(neighbour.weight)
            if correction is None:
                correction = theirs
            else:
                correction += theirs
        for neighbour, work in current.sends:
            self._wait(work, current.number, f"send its weights to rank {neighbour.rank}")
        self.wait_seconds += time.monotonic() - started
        self.rounds += 1
        self.bytes_sent += current.snapshot.nbytes * len(current.sends)
        return np.zeros_like(current.snapshot) if correction is None else correction

    def drain(self) -> None:
        """Completes a round still in flight without using it (training stopped before the step it was for)."""
        if self._round is not None:
            self.finish()

    def close(self) -> None:
        """Ends the streams (the communicator they were split from stays open)."""
        self._streams.close()

    def _take(self) -> _Round:
        current, self._round = self._round, None
        if current is None:
            raise RuntimeError(f"rank {self.rank}: no gossip round in flight to finish")
        return current

    def _wait(self, work: Work, number: int, what: str):
        try:
            return work.wait(self.timeout)
        except CollectiveTimeout as exc:
            raise CollectiveTimeout(
                f"rank {self.rank}: gossip round {number}: waited {self.timeout}s to {what}; check that rank's "
                "worker, or raise `timeout`"
            ) from exc
