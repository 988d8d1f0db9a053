"""Parameter server: serves shards of a model's parameters to asynchronous workers.

Runs on the Spark driver for the length of a training job.  Each shard has its
own :class:`~sparkdl.net.listener.ServingListener` on exactly ``host``: clients
authenticate with the job secret (challenge/response, see
:mod:`sparkdl.ps.protocol`) on its selector, and every authenticated
connection gets its own thread (at most a few per worker), which answers its
requests in order.  The server stores nothing itself: it
calls the :class:`Shard` objects it was given.

Modes:

- ``async``: pushes are applied as they arrive; ``apply`` and ``read`` of a
  shard are serialised by a per-shard lock.
- ``hogwild``: no lock: concurrent pushes call ``shard.apply`` concurrently
  (one thread per connection) and reads don't wait for applies.
- ``ssp``: as ``async``, and a pull by worker w is held until
  ``clock[w] - min(active clocks) <= max_staleness`` (see
  :class:`sparkdl.ps.staleness.ClockTracker`; the shard-0 server advances a
  worker's clock once per push).

Every wait is bounded: a handshake by ``min(timeout, handshake_timeout)``, a
connection with no request for ``timeout`` seconds is closed (clients
reconnect by themselves before that), sends and the ssp gate by ``timeout``.
A connection that breaks the protocol is closed; nothing it sent is applied
unless a complete, well-formed push arrived, and a push holding NaN or
infinity is refused with ``BAD_REQUEST`` before anything is applied.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import typing
from collections.abc import Iterator, Sequence

import numpy as np

from sparkdl.net.io import ReadTimeout, recv_exact, send_buffers
from sparkdl.net.listener import HANDSHAKE_TIMEOUT, MAX_PENDING, ServingListener
from sparkdl.ps import protocol
from sparkdl.ps.protocol import FLOAT, REQUEST, Msg, Status
from sparkdl.ps.staleness import ClockTracker, ServerStopping, StalenessTimeout

_log = logging.getLogger(__name__)

MODES = ("async", "hogwild", "ssp")


class Shard(typing.Protocol):
    size: int  # number of float32 parameters in this shard

    def read(self) -> np.ndarray:
        """Current weights: a 1-D float32 snapshot of length ``size``."""

    def apply(self, gradient: np.ndarray) -> None:
        """Apply one pushed gradient (1-D float32 of length ``size``, owned by the callee)."""


class _ProtocolViolation(Exception):
    """The peer broke the protocol; the connection is closed (after an error response if possible)."""

    def __init__(self, reason: str, reply: tuple[int, int] | None = None):
        super().__init__(reason)
        self.reply = reply  # (message type, seq) to answer with BAD_REQUEST, if any


class _Closed(Exception):
    """The peer closed the connection between requests, or it timed out idle."""


class _ShardServer:
    """Listener, accept thread and connection threads of one shard."""

    def __init__(self, server: ParameterServer, index: int, shard: Shard):
        self.server = server
        self.index = index
        self.shard = shard
        self.size = int(shard.size)
        self.nbytes = FLOAT.itemsize * self.size
        self.lock = threading.Lock() if server.mode != "hogwild" else None
        self.version = 0
        self.listener: ServingListener | None = None
        self.address = ""

    def start(self) -> str:
        server = self.server
        self.listener = ServingListener(
            server.host,
            server.secret,
            self.index,
            range(server.num_workers),
            self._serve,
            name=f"ps-shard{self.index}",
            max_connections=4 * server.num_workers + 4,
            handshake_timeout=min(server.timeout, server.handshake_timeout),
            max_pending=server.max_pending,
            reuse_address=True,
        )
        self.address = self.listener.address
        return self.address

    def _serve(self, conn: socket.socket, worker: int) -> None:
        server = self.server
        try:
            conn.settimeout(server.timeout)
            self._request_loop(conn, worker)
        except _Closed:
            pass
        except _ProtocolViolation as exc:
            with server._lock:
                server._counters["protocol_errors"] += 1
            _log.warning(
                "parameter server shard %d (%s): closing the connection of worker %d: %s",
                self.index,
                self.address,
                worker,
                exc,
            )
            if exc.reply is not None:
                self._try_error(conn, exc.reply[0], exc.reply[1], Status.BAD_REQUEST, str(exc))
        except OSError as exc:
            if not server._stopping.is_set():
                _log.info("parameter server shard %d: connection of worker %d ended: %s", self.index, worker, exc)

    # -- requests --------------------------------------------------------------------------

    def _request_loop(self, conn: socket.socket, worker: int) -> None:
        server = self.server
        header = bytearray(REQUEST.size)
        header_view = memoryview(header)
        while True:
            if not _recv_exact(conn, header_view, at_boundary=True):
                raise _Closed()
            magic, msg, reserved1, reserved2, seq, length = REQUEST.unpack(header)
            if magic != protocol.REQUEST_MAGIC:
                raise _ProtocolViolation(f"bad magic {bytes(magic)!r} (garbage or another protocol)")
            expected = protocol.expected_request_payload(msg, self.size)
            if expected is None:
                raise _ProtocolViolation(f"unknown message type {msg}", reply=(msg, seq))
            if reserved1 or reserved2:
                raise _ProtocolViolation("non-zero reserved header fields", reply=(msg, seq))
            if length != expected:
                raise _ProtocolViolation(
                    f"{protocol.msg_name(msg)} announced {length} payload bytes; shard {self.index} "
                    f"has {self.size} float32 parameters, so it must be exactly {expected} "
                    f"(check shard_sizes)",
                    reply=(msg, seq),
                )
            server._count(bytes_in=REQUEST.size + length)
            if msg == Msg.PUSH:
                self._push(conn, worker, seq)
            elif msg == Msg.PULL:
                self._pull(conn, worker, seq)
            else:
                server.tracker.finish(worker)
                self._send(conn, msg, Status.OK, seq, self.version)

    def _push(self, conn: socket.socket, worker: int, seq: int) -> None:
        server = self.server
        # The size is this shard's own, never the peer's announcement.
        gradient = np.empty(self.size, dtype=FLOAT)
        if not _recv_exact(conn, gradient.view(np.uint8).data, at_boundary=False):
            raise _Closed()
        if not np.isfinite(gradient).all():
            bad = int(np.size(gradient) - np.count_nonzero(np.isfinite(gradient)))
            _log.warning(
                "parameter server shard %d: refused a push of worker %d holding %d non-finite values",
                self.index,
                worker,
                bad,
            )
            self._send_error(
                conn,
                Msg.PUSH,
                seq,
                Status.BAD_REQUEST,
                f"{protocol.NON_FINITE}: {bad} of {self.size} values of shard {self.index} are NaN or "
                f"infinite; nothing was applied",
            )
            return
        try:
            if self.lock is not None:
                with self.lock:
                    self.shard.apply(gradient)
            else:
                self.shard.apply(gradient)
        except Exception as exc:
            _log.exception("parameter server shard %d: apply failed", self.index)
            self._send_error(
                conn, Msg.PUSH, seq, Status.SHARD_ERROR, f"shard {self.index} failed to apply the gradient: {exc!r}"
            )
            return
        with server._lock:
            self.version += 1
            version = self.version
            if self.index == 0:  # a worker's push counts once (it goes to every shard)
                server._counters["pushes"] += 1
        if self.index == 0:
            server.tracker.advance(worker)
        self._send(conn, Msg.PUSH, Status.OK, seq, version)

    def _pull(self, conn: socket.socket, worker: int, seq: int) -> None:
        server = self.server
        try:
            server.tracker.admit_pull(worker, server.timeout)
        except StalenessTimeout as exc:
            self._send_error(conn, Msg.PULL, seq, Status.STALENESS_TIMEOUT, str(exc))
            return
        except ServerStopping:
            self._send_error(conn, Msg.PULL, seq, Status.STOPPING, "the parameter server is stopping")
            return
        try:
            if self.lock is not None:
                with self.lock:
                    weights = self.shard.read()
                    version = self.version
            else:
                weights = self.shard.read()
                version = self.version
            weights = np.ascontiguousarray(weights, dtype=FLOAT).reshape(-1)
            if weights.size != self.size:
                raise ValueError(f"read() returned {weights.size} values, shard.size is {self.size}")
        except Exception as exc:
            _log.exception("parameter server shard %d: read failed", self.index)
            self._send_error(
                conn, Msg.PULL, seq, Status.SHARD_ERROR, f"shard {self.index} failed to read its weights: {exc!r}"
            )
            return
        if self.index == 0:
            with server._lock:
                server._counters["pulls"] += 1
        self._send(conn, Msg.PULL, Status.OK, seq, version, weights)

    def _send(
        self,
        conn: socket.socket,
        msg: int,
        status: Status,
        seq: int,
        version: int,
        payload: np.ndarray | bytes | None = None,
    ) -> None:
        body: bytes | memoryview
        if payload is None:
            body = b""
        elif isinstance(payload, np.ndarray):
            body = payload.view(np.uint8).data
        else:
            body = payload
        header = protocol.pack_response(msg, status, seq, version, len(body))
        send_buffers(conn, [header, body])
        self.server._count(bytes_out=len(header) + len(body))

    def _send_error(self, conn: socket.socket, msg: int, seq: int, status: Status, text: str) -> None:
        body = text.encode("utf-8", "replace")[: protocol.MAX_MESSAGE_BYTES]
        self._send(conn, msg, status, seq, self.version, body)

    def _try_error(self, conn: socket.socket, msg: int, seq: int, status: Status, text: str) -> None:
        """Best effort: answer a bad request, then let the client read the answer.

        Closing with unread request bytes would make the kernel reset the
        connection and drop the answer, so the rest of the client's data is
        read and discarded for at most a second (never stored).
        """
        try:
            conn.settimeout(1.0)
            self._send_error(conn, msg, seq, status, text)
            conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            scratch = bytearray(65536)
            while time.monotonic() < deadline and conn.recv_into(scratch):
                pass
        except OSError:
            pass

    def close_listener(self, join_timeout: float) -> None:
        if self.listener is not None:
            self.listener.close(join_timeout)


def _recv_exact(conn: socket.socket, view: memoryview, *, at_boundary: bool) -> bool:
    """Fill ``view``; False if the peer closed before the first byte (a clean close
    between requests when ``at_boundary``).  A close or idle timeout inside a frame raises."""
    try:
        received = recv_exact(conn, view)
    except ReadTimeout as exc:
        if at_boundary and exc.received == 0:
            raise _Closed() from None  # idle for `timeout`: the client reconnects
        raise _ProtocolViolation("timed out inside a frame (truncated frame)") from None
    if received == 0 and at_boundary:
        return False
    if received < len(view):
        raise _ProtocolViolation(f"closed inside a frame after {received} of {len(view)} bytes")
    return True


class ParameterServer:
    """Serves ``shards`` to :class:`sparkdl.ps.client.ParameterClient` workers; see the module doc."""

    def __init__(
        self,
        shards: Sequence[Shard],
        *,
        host: str,
        secret: bytes,
        mode: str,
        num_workers: int,
        max_staleness: int = 0,
        timeout: float = 600.0,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending: int = MAX_PENDING,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not shards:
            raise ValueError("a parameter server needs at least one shard")
        if not host or host in ("0.0.0.0", "::"):
            raise ValueError(
                f"host must be one specific interface address (e.g. the driver's "
                f"spark.driver.host), not {host!r}: the parameter server never listens on "
                f"every interface"
            )
        if not secret:
            raise ValueError("secret must be a non-empty per-job secret")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        for i, shard in enumerate(shards):
            if int(shard.size) < 0:
                raise ValueError(f"shard {i} has negative size {shard.size}")
        self.host = host
        self.secret = bytes(secret)
        self.mode = mode
        self.num_workers = num_workers
        self.max_staleness = max_staleness
        self.timeout = float(timeout)
        self.handshake_timeout = float(handshake_timeout)
        self.max_pending = int(max_pending)
        self.tracker = ClockTracker(num_workers, max_staleness if mode == "ssp" else None)
        self._shards = [_ShardServer(self, i, shard) for i, shard in enumerate(shards)]
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._counters = dict(pushes=0, pulls=0, bytes_in=0, bytes_out=0, protocol_errors=0)
        self._started = False
        self._stopped = False
        self.addresses: list[str] = []

    def start(self) -> list[str]:
        if self._stopped:
            raise RuntimeError("a stopped ParameterServer cannot be restarted; create a new one")
        if self._started:
            return list(self.addresses)
        self._started = True
        try:
            self.addresses = [shard.start() for shard in self._shards]
        except BaseException:
            self.stop()
            raise
        return list(self.addresses)

    def stop(self, join_timeout: float = 10.0) -> None:
        """Close listeners and connections and join the threads; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        self.tracker.stop()
        for shard in self._shards:
            shard.close_listener(join_timeout)  # a thread inside shard.apply finishes that call first

    def __enter__(self) -> ParameterServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @contextlib.contextmanager
    def holding_updates(self) -> Iterator[None]:
        """While the block runs no shard applies a push or serves a pull: the state of one moment.

        Hogwild shards have no lock: there the state is read as it is, as their workers read it.
        """
        with contextlib.ExitStack() as stack:
            for shard in self._shards:
                if shard.lock is not None:
                    stack.enter_context(shard.lock)
            yield

    def stats(self) -> dict:
        """Counters since start.

        ``pushes``/``pulls``: worker operations (each counted once, on shard 0,
        although it reaches every shard); ``bytes_in``/``bytes_out``: request and
        response frames (headers + payloads) over all shards, handshakes excluded;
        ``max_staleness``: the largest ``clock[w] - min(active clocks)`` seen by a
        granted pull; ``versions``: updates applied per shard;
        ``refused_connections``: failed or refused handshakes; extra keys:
        ``protocol_errors`` (authenticated connections closed for breaking the
        protocol) and ``clocks`` (pushes completed per worker id).
        """
        clocks, max_seen = self.tracker.snapshot()
        with self._lock:
            result: dict = dict(self._counters)
            result["refused_connections"] = sum(
                shard.listener.refused for shard in self._shards if shard.listener is not None
            )
            result["versions"] = [shard.version for shard in self._shards]
        result["max_staleness"] = max_seen
        result["clocks"] = clocks
        return result

    # -- internals used by the shard servers -----------------------------------------------

    def _count(self, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._lock:
            self._counters["bytes_in"] += bytes_in
            self._counters["bytes_out"] += bytes_out
