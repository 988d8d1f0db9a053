"""A barrier stage's rendezvous through the driver's relay: every rank's record, given to every rank at once.

Spark's own ``BarrierTaskContext.allGather`` looks for its answer once a second (``runBarrier``
sleeps a second between two looks), so every call takes a second or more, even when every task is
there already: the ring's set-up paid that in every fit. Here each task sends its record (its
listener's address and host, ``sparkdl.collective.topology``) over the connection it holds to the
driver's relay anyway (``sparkdl.launch.relay``), and the relay answers every rank as soon as the
last one's record arrives.

A task waits for the others at most ``timeout`` seconds (``fit``'s ``timeout``, which bounds every
network wait) from the last sign that the stage is coming together: another rank's task starting
(its connection to the relay) or joining. Each such sign reaches the ranks already waiting as a
frame naming the ranks still missing, which renews their wait and which the timeout's error quotes.
The ranks of a stage do not start together: when Spark retries a stage after losing an executor,
the ranks on the executors that stayed are at the rendezvous within a second, while the rank on the
replacement executor first starts a Python worker and imports TensorFlow, which on a busy machine
took longer than a 20 s timeout counted from the first rank's arrival, and longer than a 10 s one after
it had started. Spark launches a barrier stage's tasks together or not at all, so once a rank is at
the rendezvous, the ranks missing whose task has not connected yet are starting: the driver's stage
watch (``stage.StageWatch``) renews the ranks' wait for them (:meth:`Rendezvous.tell_starting`) up to
``worker_python.STARTUP_SECONDS`` from the first waiting rank's arrival (a retried stage's ranks arrive anew).

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
import time
from collections.abc import Collection

from sparkdl.collective import topology
from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.relay_frames import MAX_FRAME_BYTES, recv_bytes, send_frame
from sparkdl.launch.worker_python import STARTUP_SECONDS
from sparkdl.net.io import parse_address
from sparkdl.net.secure import Channel

_log = logging.getLogger(__name__)

# Frame kinds on the relay's connection, after the relay's own (1-4) and the payloads' (5-8).
_JOIN, _MEMBERS = 9, 10  # task -> driver: its task attempt id and record; driver -> task: every rank's record
# driver -> a task that joined: the ranks not yet joined, those whose task has not connected, and whether these are
# starting (their Python worker)
_WAITING = 11


class Rendezvous:
    """Driver side: holds one record per rank; answers every rank once all of them have one."""

    def __init__(self, num_workers: int):
        self._num_workers = num_workers
        self._lock = threading.Lock()
        self._joined: dict[int, _Joined] = {}  # rank -> the record its newest task sent, not yet answered
        self._newest: dict[int, int] = {}  # rank -> the highest task attempt id that joined
        self._met: list[str] | None = None  # every rank's record, at the last time they all met
        self._met_tasks: list[int] | None = None  # every rank's task attempt id, at the last time they all met
        self._connections = [0] * num_workers  # rank -> its tasks' connections open now

    def open(self, rank: int) -> _Session:
        """The handler of one task connection's rendezvous frames (the relay calls it for the kinds it names, once
        the task has connected: that rank's task has started, which the ranks waiting are told)."""
        with self._lock:
            self._connections[rank] += 1
        self._tell_waiting()
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
            complete = len(self._joined) == self._num_workers
            if complete:
                members, self._joined = self._joined, {}
                self._met = [members[r].record for r in range(self._num_workers)]
                self._met_tasks = [members[r].task for r in range(self._num_workers)]
        if not complete:
            self._tell_waiting(stopping)
            return
        answer = json.dumps(self._met).encode()
        for member in members.values():
            member.tell(_MEMBERS, answer, stopping, last=True)

    def tell_starting(self) -> bool:
        """Tells the ranks waiting that the missing ranks whose task has not connected are starting (launched with
        theirs, a barrier stage's tasks are: a Python worker starting, importing what the task imports), which
        renews their wait, up to ``STARTUP_SECONDS`` from the first of them's arrival: past it they give up after
        their timeout, naming those ranks. A retried stage's ranks are new arrivals, waited for as long again.
        Returns whether it told them."""
        return self._tell_waiting(starting=True)

    def _tell_waiting(self, stopping: threading.Event | None = None, *, starting: bool = False) -> bool:
        """Tells every rank waiting which ranks it still waits for: a sign of progress, which renews its wait.
        Returns whether a rank waits for one whose task has not connected (``starting``: and was told so)."""
        with self._lock:
            waiting = list(self._joined.values())
            missing = [rank for rank in range(self._num_workers) if rank not in self._joined]
            not_started = [rank for rank in missing if not self._connections[rank]]
        if starting and not (waiting and not_started):
            return False
        if starting and time.monotonic() - min(member.arrived for member in waiting) > STARTUP_SECONDS:
            return False
        news = {
            "missing": missing,
            "not_started": not_started,
            "starting": not_started if starting else [],
            "startup_seconds": STARTUP_SECONDS,  # the driver's: how long the starting ranks are waited for
        }
        message = json.dumps(news).encode()
        for member in waiting:
            member.tell(_WAITING, message, stopping)
        return bool(waiting and not_started)

    def task_at_last_meeting(self, rank: int) -> int | None:
        """The task attempt id of rank ``rank`` when the ranks last met (None: they never did)."""
        with self._lock:
            return None if self._met_tasks is None else self._met_tasks[rank]

    def ranks_on(self, hosts: Collection[str]) -> list[int]:
        """The ranks that ran on ``hosts`` (Spark's executor host names) when the ranks last met: none before."""
        with self._lock:
            met = self._met or []
        addresses, _ = topology.parse_records(met)
        return [rank for rank, address in enumerate(addresses) if parse_address(address)[0] in hosts]

    def _leave(self, rank: int, joined: _Joined | None) -> None:
        with self._lock:
            self._connections[rank] -= 1
            if joined is not None and self._joined.get(rank) is joined:
                del self._joined[rank]


@dataclasses.dataclass(eq=False)
class _Joined:
    """A rank's task waiting at the rendezvous: what it sent, and the driver's side of its connection."""

    rank: int
    task: int  # the task attempt id (Spark's task id, unique in the application)
    record: str
    channel: Channel
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    _sending: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _answered: bool = False

    def tell(self, kind: int, message: bytes, stopping: threading.Event | None, *, last: bool = False) -> None:
        """Sends the task one frame, unless it has had its answer (``last``: this is the answer). The task waits and
        sends the driver nothing that needs an answer meanwhile; relay threads of other ranks may tell it at once,
        so they take turns."""
        with self._sending:
            if self._answered:
                return
            self._answered = last
            try:
                send_frame(self.channel, kind, message, stopping=stopping)
            except OSError as exc:  # that task is gone: its stage fails without this rendezvous
                _log.warning("sparkdl relay: could not send rank %d its rendezvous frame: %s", self.rank, exc)


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
        self._rendezvous._leave(self._rank, self._joined)


def join(reporter: TaskReporter, rank: int, task: int, record: str, timeout: float) -> list[str]:
    """Inside barrier task ``task`` (its task attempt id) of rank ``rank``: every rank's record, by rank, once every
    rank has sent its own; ``timeout`` is the connection's, which bounds the wait."""
    connection = reporter.connection
    connection.send(_JOIN, json.dumps({"task": task, "record": record}).encode(), must_arrive=True)
    news: dict = {}
    while True:
        try:
            kind, length = connection.receive_header()
        except TimeoutError:
            raise TimeoutError(f"rank {rank}: {_not_met(news, timeout)}") from None
        if kind not in (_MEMBERS, _WAITING) or length > MAX_FRAME_BYTES:
            raise ConnectionError(f"The driver's relay sent a malformed frame (kind {kind}, {length} bytes).")
        message = bytearray(length)
        connection.receive_into(memoryview(message))
        answer = json.loads(message)
        if kind == _MEMBERS:
            break
        if not isinstance(answer, dict):
            raise ConnectionError("The driver's relay sent a malformed rendezvous frame.")
        news = answer  # the wait starts again
    if not isinstance(answer, list) or not all(isinstance(member, str) for member in answer):
        raise ConnectionError("The driver's relay sent a malformed rendezvous answer.")
    return answer


def _not_met(news: dict, timeout: float) -> str:
    """Why a rank gave up waiting at the rendezvous, naming the ranks missing as the driver last said."""
    missing, not_started, starting = news.get("missing", []), news.get("not_started", []), news.get("starting", [])
    started = [rank for rank in missing if rank not in not_started]
    never = [rank for rank in not_started if rank not in starting]
    why = []
    if never:
        why.append(f"rank(s) {_listed(never)} never started (an executor lost, or no free slot for it)")
    if starting:
        why.append(
            f"rank(s) {_listed(starting)} were launched by Spark, but their Python had not started within "
            f"{news.get('startup_seconds')} s (a Python worker that does not start, or an import that hangs)"
        )
    if started:
        why.append(f"rank(s) {_listed(started)} started but had not joined (still reading a large partition?)")
    return (
        f"not every rank of the stage reached the rendezvous within timeout={timeout} seconds of the last rank's "
        "start or arrival" + (": " + "; ".join(why) if why else "")
    )


def _listed(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)
