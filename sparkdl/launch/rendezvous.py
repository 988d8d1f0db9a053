"""A barrier stage's rendezvous through the driver's relay: every rank's record, given to every rank at once.

Spark's own ``BarrierTaskContext.allGather`` looks for its answer once a second (``runBarrier``
sleeps a second between two looks), so every call takes a second or more, even when every task is
there already: the ring's set-up paid that in every fit. Here each task sends its record (its
listener's address and host, ``sparkdl.collective.topology``) over the connection it holds to the
driver's relay anyway (``sparkdl.launch.relay``), and the relay answers every rank as soon as the
last one's record arrives. A task waits for the others at most ``timeout`` seconds (``fit``'s
``timeout``, which bounds every network wait).

When Spark retries the stage, the tasks of the new attempt must meet among themselves. A task's
record is dropped when its connection closes (Spark kills the other tasks of a failed barrier
stage), and a rank's newer task (a higher task attempt id: Spark numbers tasks in the order it
launches them) replaces its older one, whose record a late message can no longer bring back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Collection

from sparkdl.collective import topology
from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.relay_frames import MAX_FRAME_BYTES, recv_bytes, send_frame
from sparkdl.net.io import parse_address
from sparkdl.net.secure import Channel

_log = logging.getLogger(__name__)

# Frame kinds on the relay's connection, after the relay's own (1-4) and the payloads' (5-8).
_JOIN, _MEMBERS = 9, 10  # task -> driver: its task attempt id and record; driver -> task: every rank's record


class Rendezvous:
    """Driver side: holds one record per rank; answers every rank once all of them have one."""

    def __init__(self, num_workers: int):
        self._num_workers = num_workers
        self._lock = threading.Lock()
        self._joined: dict[int, _Joined] = {}  # rank -> the record its newest task sent, not yet answered
        self._newest: dict[int, int] = {}  # rank -> the highest task attempt id that joined
        self._met: list[str] | None = None  # every rank's record, at the last time they all met

    def open(self, rank: int) -> _Session:
        """The handler of one task connection's rendezvous frames (the relay calls it for the kinds it names)."""
        return _Session(self, rank)

    def _join(self, joined: _Joined, stopping: threading.Event) -> None:
        rank = joined.rank
        with self._lock:
            if joined.task < self._newest.get(rank, -1):
                raise ValueError(
                    f"rank {rank}'s task {joined.task} joined the rendezvous after a newer task of its rank"
                )
            self._newest[rank] = joined.task
            self._joined[rank] = joined
            if len(self._joined) < self._num_workers:
                return
            members, self._joined = self._joined, {}
            self._met = [members[r].record for r in range(self._num_workers)]
        answer = json.dumps(self._met).encode()
        for member in members.values():
            # The member waits for this answer and sends the driver nothing that needs one meanwhile: no other
            # thread writes to its connection now.
            try:
                send_frame(member.channel, _MEMBERS, answer, stopping=stopping)
            except OSError as exc:  # that task is gone: its stage fails without this rendezvous
                _log.warning("sparkdl relay: could not answer rank %d's rendezvous: %s", member.rank, exc)

    def ranks_on(self, hosts: Collection[str]) -> list[int]:
        """The ranks that ran on ``hosts`` (Spark's executor host names) when the ranks last met: none before."""
        with self._lock:
            met = self._met or []
        addresses, _ = topology.parse_records(met)
        return [rank for rank, address in enumerate(addresses) if parse_address(address)[0] in hosts]

    def _leave(self, joined: _Joined) -> None:
        with self._lock:
            if self._joined.get(joined.rank) is joined:
                del self._joined[joined.rank]


@dataclasses.dataclass(frozen=True, eq=False)
class _Joined:
    rank: int
    task: int  # the task attempt id (Spark's task id, unique in the application)
    record: str
    channel: Channel


class _Session:
    """One task connection's rendezvous: its join, dropped when the connection closes unanswered."""

    KINDS = (_JOIN,)

    def __init__(self, rendezvous: Rendezvous, rank: int):
        self._rendezvous = rendezvous
        self._rank = rank
        self._joined: _Joined | None = None

    def handle(self, channel: Channel, kind: int, length: int, stopping: threading.Event) -> None:
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"rank {self._rank} sent a malformed frame (kind {kind}, {length} bytes)")
        message = recv_bytes(channel, length, stopping)
        if message is None:
            return
        try:
            request = json.loads(message)
            task, record = int(request["task"]), request["record"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"rank {self._rank} sent a malformed rendezvous record: {exc!r}") from None
        if not isinstance(record, str):
            raise ValueError(f"rank {self._rank} sent a rendezvous record that is not a string: {record!r}")
        self._joined = _Joined(self._rank, task, record, channel)
        self._rendezvous._join(self._joined, stopping)

    def close(self) -> None:
        if self._joined is not None:
            self._rendezvous._leave(self._joined)


def join(reporter: TaskReporter, rank: int, task: int, record: str, timeout: float) -> list[str]:
    """Inside barrier task ``task`` (its task attempt id) of rank ``rank``: every rank's record, by rank, once every
    rank has sent its own; ``timeout`` is the connection's, which bounds the wait."""
    connection = reporter.connection
    connection.send(_JOIN, json.dumps({"task": task, "record": record}).encode(), must_arrive=True)
    try:
        kind, length = connection.receive_header()
    except TimeoutError:
        raise TimeoutError(
            f"rank {rank}: not every rank of the stage reached the rendezvous within timeout={timeout} seconds "
            "(a rank still reading a large partition, or one that was lost)"
        ) from None
    if kind != _MEMBERS or length > MAX_FRAME_BYTES:
        raise ConnectionError(f"The driver's relay sent a malformed frame (kind {kind}, {length} bytes).")
    message = bytearray(length)
    connection.receive_into(memoryview(message))
    members = json.loads(message)
    if not isinstance(members, list) or not all(isinstance(member, str) for member in members):
        raise ConnectionError("The driver's relay sent a malformed rendezvous answer.")
    return members
