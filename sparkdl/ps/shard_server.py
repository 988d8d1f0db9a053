"""One shard of the parameter server: its listener, and the request loop of each worker connection.

Every authenticated connection (a plain or sealed :class:`~sparkdl.net.secure.Channel`)
gets a thread that answers its requests in order (:mod:`sparkdl.ps.protocol`): a push's
gradient is read into the connection's own buffer of this shard's size and push dtype
(:mod:`sparkdl.ps.wire`: float32, or half-width under compression), refused with
``BAD_REQUEST`` if it holds NaN or infinity, else handed to the shard's update rule
(:mod:`sparkdl.ps.rules`: applied at once, or kept for its synchronous round); a pull waits
for what its rule says first (a synchronous round, ``ssp``'s staleness gate).  A connection
that breaks the protocol is closed, after a ``BAD_REQUEST`` answer where one can still be read.
The controller's connection (the driver's, where the server takes one) asks for the shard's state
only: its variables and its optimizer's, copied under the shard's lock and sent end to end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
import typing
from collections.abc import Sequence

import numpy as np

from sparkdl.keras import adopted
from sparkdl.net.frames import HEADER, FrameError, Header, Kind, dtype_name
from sparkdl.net.io import ReadTimeout
from sparkdl.net.listener import ServingListener
from sparkdl.net.secure import Channel, IntegrityError
from sparkdl.ps import protocol, wire
from sparkdl.ps.attendance import Attendance
from sparkdl.ps.counters import ServerCounters
from sparkdl.ps.positions import RowsChanged, WorkerRows
from sparkdl.ps.protocol import FLOAT, ROWS, Msg, Status
from sparkdl.ps.rules import PushRefused, Roster, RoundFailed, RoundTimeout, UpdateRule
from sparkdl.ps.staleness import ClockTracker, ServerStopping, StalenessTimeout

_log = logging.getLogger(__name__)

#: What a request that its rule refuses is answered with: the status for the exception the rule raised, and the
#: message, the exception's own where None.
_REFUSALS: dict[type[Exception], tuple[Status, str | None]] = {
    PushRefused: (Status.BAD_REQUEST, None),
    RowsChanged: (Status.BAD_REQUEST, None),
    StalenessTimeout: (Status.STALENESS_TIMEOUT, None),
    RoundTimeout: (Status.ROUND_TIMEOUT, None),
    RoundFailed: (Status.SHARD_ERROR, None),
    ServerStopping: (Status.STOPPING, "the parameter server is stopping"),
}
# The refusals each request may meet; a push's other exceptions are the shard's own failure to apply it.
_PUSH_REFUSALS = (PushRefused, RoundFailed)
_JOIN_REFUSALS = (RoundTimeout, PushRefused, ServerStopping)
_PULL_REFUSALS = (StalenessTimeout, RoundTimeout, RoundFailed, ServerStopping)


class _ProtocolViolation(Exception):
    """The peer broke the protocol; the connection is closed (after an error response if possible)."""

    def __init__(self, reason: str, reply: tuple[int, int] | None = None):
        super().__init__(reason)
        self.reply = reply  # (message type, seq) to answer with BAD_REQUEST, if any


class _Closed(Exception):
    """The peer closed the connection between requests, or it timed out idle."""


class Shard(typing.Protocol):
    size: int  # number of float32 parameters in this shard

    def read(self) -> np.ndarray | Sequence[np.ndarray]:
        """Current weights: a 1-D float32 snapshot of length ``size``, or several whose concatenation is one
        (sent one after the other, never joined); unchanged until the caller drops them."""

    def apply(self, gradient: np.ndarray) -> None:
        """Apply one pushed gradient: 1-D of length ``size``, float32 or, under ``compression``, its half-width
        dtype, which the shard widens to float32. It is the connection's receive buffer: valid during the call."""


class StatefulShard(Shard, typing.Protocol):
    """A shard the controller may ask for its state (``Msg.STATE``): ``sparkdl.ps.server_model.OptimizerShard``."""

    state_nbytes: int  # the bytes of ``state()``'s arrays end to end

    def state(self) -> Sequence[np.ndarray]:
        """The shard's variables and its optimizer's, copied (the caller holds the shard's lock)."""


@dataclasses.dataclass(frozen=True)
class Serving:
    """What every shard server of one :class:`~sparkdl.ps.server.ParameterServer` serves with (its checked settings)."""

    host: str
    secret: bytes
    rule: UpdateRule
    num_workers: int
    controller: int | None  # the driver's client rank, if the server takes it
    first_shard: int  # the server's first shard: it owns the clocks, the roster and the counts
    push_dtype: np.dtype  # what every push must carry
    timeout: float
    handshake_timeout: float
    max_pending: int
    encrypt: bool


@dataclasses.dataclass(frozen=True)
class Bookkeeping:
    """What the shard servers of one server share: its counters, which workers finished, the worker clocks (and the
    ssp gate), the workers' rows, and under sync_ps the roster."""

    counters: ServerCounters
    attendance: Attendance
    tracker: ClockTracker
    workers: WorkerRows
    roster: Roster | None


class ShardServer:
    """Listener, accept thread and connection threads of one shard."""

    def __init__(self, index: int, shard: Shard, serving: Serving, books: Bookkeeping, next_steps: Sequence[int]):
        """``next_steps``: each worker's first step the shard has not applied (``sparkdl.ps.positions``)."""
        self.index = index
        self.shard = shard
        self.size = int(shard.size)
        self.serving = serving
        self.books = books
        self.push_dtype = serving.push_dtype
        self.lock = threading.Lock() if serving.rule.locked else None
        self.version = 0
        self._version_lock = threading.Lock()  # hogwild's pushes count their updates concurrently
        self._closing = threading.Event()
        self.listener: ServingListener | None = None
        self.address = ""
        self.updates = serving.rule.updates(self, books.roster, next_steps)  # what a push does, when a pull may read

    def start(self) -> str:
        serving = self.serving
        self.listener = ServingListener(
            serving.host,
            serving.secret,
            self.index,
            range(serving.num_workers + (serving.controller is not None)),
            self.serve,
            name=f"ps-shard{self.index}",
            encrypt=serving.encrypt,
            max_connections=4 * serving.num_workers + 4,
            handshake_timeout=min(serving.timeout, serving.handshake_timeout),
            max_pending=serving.max_pending,
            reuse_address=True,
        )
        self.address = self.listener.address
        return self.address

    def serve(self, channel: Channel, worker: int) -> None:
        try:
            channel.sock.settimeout(self.serving.timeout)
            self._request_loop(channel, worker)
        except _Closed:
            pass
        except (_ProtocolViolation, IntegrityError) as exc:  # a sealed record that fails authentication breaks it too
            self.books.counters.add("protocol_errors")
            _log.warning(
                "parameter server shard %d (%s): closing the connection of worker %d: %s",
                self.index,
                self.address,
                worker,
                exc,
            )
            if isinstance(exc, _ProtocolViolation) and exc.reply is not None:
                self._try_error(channel, exc.reply[0], exc.reply[1], Status.BAD_REQUEST, str(exc))
        except OSError as exc:
            if not self._closing.is_set():
                _log.info("parameter server shard %d: connection of worker %d ended: %s", self.index, worker, exc)

    # -- requests --------------------------------------------------------------------------

    def _request_loop(self, channel: Channel, worker: int) -> None:
        serving, books = self.serving, self.books
        header = bytearray(HEADER.size)
        header_view = memoryview(header)
        gradient: np.ndarray | None = None  # this connection's push buffer, allocated at its first push
        while True:
            if not _recv_exact(channel, header_view, at_boundary=True):
                raise _Closed()
            try:
                request = Header.unpack(header, source=f"worker {worker}")
            except FrameError as exc:  # not a frame of this version: nothing in it can be trusted, not even seq
                raise _ProtocolViolation(str(exc)) from None
            msg, seq, length = request.op, request.seq, request.nbytes
            reply = (msg, seq)
            books.attendance.heard()
            if request.kind != Kind.REQUEST:
                raise _ProtocolViolation(
                    f"a {Kind(request.kind).name} frame where a parameter-server request belongs", reply=reply
                )
            expected = protocol.expected_request_payload(msg, self.size, self.push_dtype)
            if expected is None:
                raise _ProtocolViolation(f"unknown message type {msg}", reply=reply)
            want = protocol.request_dtype(msg, self.push_dtype)
            if request.dtype != want:
                raise _ProtocolViolation(
                    f"{protocol.msg_name(msg)} announced payload dtype code {request.dtype} "
                    f"({dtype_name(request.dtype)}); a {protocol.msg_name(msg)} request to this server carries code "
                    f"{want} ({dtype_name(want) if want else 'no payload'}; the worker's compression must be the "
                    f"server's)",
                    reply=reply,
                )
            controlling = worker == serving.controller
            if controlling != (msg == Msg.STATE):
                raise _ProtocolViolation(
                    f"a {protocol.msg_name(msg)} request from the controller, which asks for the state only"
                    if controlling
                    else f"a state request from worker {worker}: only the controller (the driver) asks for a shard's state",
                    reply=reply,
                )
            rows_in_tag = msg == Msg.PUSH and self.updates.carries_rows  # a synchronous push: its rows
            if (
                request.status
                or request.group
                or (request.tag and not rows_in_tag)
                or (request.value and msg not in (Msg.PUSH, Msg.STATE, Msg.HOLD))
            ):
                raise _ProtocolViolation(
                    "non-zero reserved header fields (a request's status, group, tag and value are 0, but for a "
                    "push's step (and its rows under mode='sync_ps'), a hold's step and a state request's epochs)",
                    reply=reply,
                )
            if msg == Msg.JOIN and (books.roster is None or self.index != serving.first_shard):
                raise _ProtocolViolation(
                    f"a join, which only shard {serving.first_shard} of a mode='sync_ps' server takes (its first; "
                    f"this is shard {self.index} of a mode={serving.rule.name!r} server)",
                    reply=reply,
                )
            if msg == Msg.HOLD and books.roster is None:
                raise _ProtocolViolation(
                    f"a hold, which only a mode='sync_ps' server takes (this is a mode={serving.rule.name!r} server)",
                    reply=reply,
                )
            if length != expected:
                raise _ProtocolViolation(
                    f"{protocol.msg_name(msg)} announced {length} payload bytes; shard {self.index} "
                    f"has {self.size} parameters, so it must be exactly {expected} "
                    f"(check shard_sizes)",
                    reply=reply,
                )
            books.counters.add("bytes_in", HEADER.size + length)
            if msg == Msg.PUSH:
                if gradient is None or self.updates.holds(gradient):  # a synchronous round still reads the old one
                    gradient = adopted.aligned_empty(self.size, self.push_dtype)
                self._push(channel, worker, seq, gradient, request.value, request.tag)
            elif msg == Msg.PULL:
                self._pull(channel, worker, seq)
            elif msg == Msg.JOIN:
                self._join(channel, worker, seq)
            elif msg == Msg.STATE:
                self._state(channel, seq, request.value)
            elif msg == Msg.RESUME:
                self._resume(channel, worker, seq)
            elif msg == Msg.HOLD:
                assert books.roster is not None  # checked above
                books.roster.hold_after(request.value)
                self._send(channel, msg, Status.OK, seq, self.version)
            else:
                books.tracker.finish(worker)
                self._send(channel, msg, Status.OK, seq, self.version)
                books.attendance.finished(worker)  # answered first: a server task stops once every worker is

    def _push(self, channel: Channel, worker: int, seq: int, gradient: np.ndarray, step: int, rows: int) -> None:
        books = self.books
        # The size is this shard's own, never the peer's announcement.
        if not _recv_exact(channel, gradient.view(np.uint8).data, at_boundary=False):
            raise _Closed()
        started = time.perf_counter()
        finite = wire.all_finite(gradient)
        books.counters.add("check_seconds", time.perf_counter() - started)
        if not finite:
            bad = wire.count_non_finite(gradient)
            _log.warning(
                "parameter server shard %d: refused a push of worker %d holding %d non-finite values",
                self.index,
                worker,
                bad,
            )
            self._send_error(
                channel,
                Msg.PUSH,
                seq,
                Status.BAD_REQUEST,
                f"{protocol.NON_FINITE}: {bad} of {self.size} values of shard {self.index} are NaN or "
                f"infinite; nothing was applied",
            )
            return
        try:
            version = self.updates.push(worker, gradient, step, rows)
        except _PUSH_REFUSALS as exc:
            self._refuse(channel, Msg.PUSH, seq, exc)
            return
        except Exception as exc:
            _log.exception("parameter server shard %d: apply failed", self.index)
            self._send_error(
                channel, Msg.PUSH, seq, Status.SHARD_ERROR, f"shard {self.index} failed to apply the gradient: {exc!r}"
            )
            return
        if self.index == self.serving.first_shard:  # a worker's push counts once (it goes to every shard)
            books.counters.add("pushes")
            books.tracker.advance(worker)
        self._send(channel, Msg.PUSH, Status.OK, seq, version)

    def _join(self, channel: Channel, worker: int, seq: int) -> None:
        """sync_ps: this worker's training rows in; every worker's out, once all have joined."""
        roster = self.books.roster
        assert roster is not None
        rows = self._rows_told(channel, Msg.JOIN, seq, 1)
        try:
            counts = roster.join(worker, int(rows[0]), self.serving.timeout)
        except _JOIN_REFUSALS as exc:
            self._refuse(channel, Msg.JOIN, seq, exc)
            return
        self._send(channel, Msg.JOIN, Status.OK, seq, self.version, [np.asarray(counts, ROWS)])

    def _state(self, channel: Channel, seq: int, epochs: int) -> None:
        """The controller's request: the shard's variables and its optimizer's, copied under its lock (as they are
        under hogwild), sent end to end, then the workers' positions on it (``protocol.positions_nbytes``).
        ``epochs``: the complete epochs the state is after (0: a step checkpoint's); where the server holds its
        synchronous rounds for checkpoints, those of the next epoch, or after the held step, may run once the state
        is read."""
        shard = typing.cast("StatefulShard", self.shard)  # one without state fails here, answered SHARD_ERROR
        try:
            nbytes = int(shard.state_nbytes)
            with self.locked():
                parts = [np.ascontiguousarray(part).reshape(-1) for part in shard.state()]
                next_steps = self.updates.next_steps()
            if sum(part.nbytes for part in parts) != nbytes:
                raise ValueError(f"state() returned {sum(p.nbytes for p in parts)} bytes, state_nbytes is {nbytes}")
        except Exception as exc:
            _log.exception("parameter server shard %d: reading its state failed", self.index)
            self._send_error(
                channel, Msg.STATE, seq, Status.SHARD_ERROR, f"shard {self.index} failed to read its state: {exc!r}"
            )
            return
        rows, key_sums = self.books.workers.snapshot()
        sums = np.array(key_sums, np.uint64).view(np.int64)
        positions = np.concatenate([np.array(next_steps, ROWS), np.array(rows, ROWS), sums.astype(ROWS)])
        roster = self.books.roster
        if roster is not None:  # sync_ps: the rounds of the epoch after it, or after the held step, may run
            if epochs > 0:
                roster.epoch_saved(epochs - 1)
            roster.step_saved()
        self._send(channel, Msg.STATE, Status.OK, seq, self.version, [*parts, positions])

    def _resume(self, channel: Channel, worker: int, seq: int) -> None:
        """A worker that starts: its training rows and their keys' sum in (refused where they are not those its
        positions were taken on), the first of its steps this shard has not applied out."""
        told = self._rows_told(channel, Msg.RESUME, seq, 2)
        try:
            self.books.workers.register(worker, int(told[0]), int(told[1:].view(np.uint64)[0]))
        except RowsChanged as exc:
            self._refuse(channel, Msg.RESUME, seq, exc)
            return
        if self.books.roster is not None:  # sync_ps: a hold of its failed attempt's, whose request may never come
            self.books.roster.step_saved()
        step = np.array([self.updates.resume(worker)], ROWS)
        self._send(channel, Msg.RESUME, Status.OK, seq, self.version, [step])

    def _rows_told(self, channel: Channel, msg: Msg, seq: int, count: int) -> np.ndarray:
        """A join's or a resume's payload: ``count`` int64 values, the first a worker's training rows (not negative)."""
        told = np.empty(count, ROWS)
        if not _recv_exact(channel, told.view(np.uint8).data, at_boundary=False):
            raise _Closed()
        if told[0] < 0:
            raise _ProtocolViolation(f"a {protocol.msg_name(msg)} with {int(told[0])} training rows", reply=(msg, seq))
        return told

    def apply(self, gradient: np.ndarray) -> int:
        """Applies ``gradient`` to the shard (the caller holds :meth:`locked` where the rule says) and counts the update;
        returns the shard's version after it."""
        started = time.perf_counter()
        self.shard.apply(gradient)
        self.books.counters.add("apply_seconds", time.perf_counter() - started)
        with self._version_lock:
            self.version += 1
            return self.version

    def _pull(self, channel: Channel, worker: int, seq: int) -> None:
        books, timeout = self.books, self.serving.timeout
        try:
            self.updates.admit_pull(worker, timeout)
            books.tracker.admit_pull(worker, timeout)
        except _PULL_REFUSALS as exc:
            self._refuse(channel, Msg.PULL, seq, exc)
            return
        try:
            with self.locked():
                started = time.perf_counter()
                weights = self.shard.read()
                version = self.version
                read = time.perf_counter() - started
            books.counters.add("read_seconds", read)
            parts = [weights] if isinstance(weights, np.ndarray) else list(weights)
            parts = [np.ascontiguousarray(part, dtype=FLOAT).reshape(-1) for part in parts]
            if sum(part.size for part in parts) != self.size:
                raise ValueError(f"read() returned {sum(p.size for p in parts)} values, shard.size is {self.size}")
        except Exception as exc:
            _log.exception("parameter server shard %d: read failed", self.index)
            self._send_error(
                channel, Msg.PULL, seq, Status.SHARD_ERROR, f"shard {self.index} failed to read its weights: {exc!r}"
            )
            return
        if self.index == self.serving.first_shard:
            books.counters.add("pulls")
        self._send(channel, Msg.PULL, Status.OK, seq, version, parts)

    def locked(self) -> contextlib.AbstractContextManager:
        """The shard's lock (async, ssp); nothing under hogwild, whose pushes and pulls never wait for each other."""
        return self.lock if self.lock is not None else contextlib.nullcontext()

    def _send(
        self,
        channel: Channel,
        msg: int,
        status: Status,
        seq: int,
        version: int,
        payload: list[np.ndarray] | bytes = b"",
    ) -> None:
        """One response: ``payload`` is an error message's bytes, or arrays sent one after the other."""
        body = [payload] if isinstance(payload, bytes) else [part.view(np.uint8).data for part in payload]
        nbytes = sum(len(part) for part in body)
        header = Header(
            kind=Kind.RESPONSE,
            op=msg,
            dtype=protocol.response_dtype(msg, status),
            status=status,
            seq=seq,
            value=version,
            nbytes=nbytes,
        ).pack()
        channel.send([header, *body])
        self.books.counters.add("bytes_out", len(header) + nbytes)

    def _send_error(self, channel: Channel, msg: int, seq: int, status: Status, text: str) -> None:
        body = text.encode("utf-8", "replace")[: protocol.MAX_MESSAGE_BYTES]
        self._send(channel, msg, status, seq, self.version, body)

    def _refuse(self, channel: Channel, msg: int, seq: int, exc: Exception) -> None:
        """Answers a request its rule refused with ``exc``, as :data:`_REFUSALS` says."""
        status, text = next(answer for refusal, answer in _REFUSALS.items() if isinstance(exc, refusal))
        self._send_error(channel, msg, seq, status, str(exc) if text is None else text)

    def _try_error(self, channel: Channel, msg: int, seq: int, status: Status, text: str) -> None:
        """Best effort: answer a bad request, then let the client read the answer.

        Closing with unread request bytes would make the kernel reset the
        connection and drop the answer, so the rest of the client's data is
        read and discarded for at most a second (never stored).
        """
        try:
            channel.sock.settimeout(1.0)
            self._send_error(channel, msg, seq, status, text)
            channel.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            scratch = bytearray(65536)
            while time.monotonic() < deadline and channel.sock.recv_into(scratch):
                pass
        except OSError:
            pass

    def close_listener(self, join_timeout: float) -> None:
        self._closing.set()
        self.updates.stop()
        if self.listener is not None:
            self.listener.close(join_timeout)


def _recv_exact(channel: Channel, view: memoryview, *, at_boundary: bool) -> bool:
    """Fill ``view``; False if the peer closed before the first byte (a clean close
    between requests when ``at_boundary``).  A close or idle timeout inside a frame raises."""
    try:
        received = channel.recv_into(view)
    except ReadTimeout as exc:
        if at_boundary and exc.received == 0:
            raise _Closed() from None  # idle for `timeout`: the client reconnects
        raise _ProtocolViolation("timed out inside a frame (truncated frame)") from None
    if received == 0 and at_boundary:
        return False
    if received < len(view):
        raise _ProtocolViolation(f"closed inside a frame after {received} of {len(view)} bytes")
    return True
