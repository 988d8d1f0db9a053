"""Worker output and errors, relayed live from the tasks to the driver.

Each task redirects its stdout and stderr file descriptors (so C++ logs from
TensorFlow or Horovod come too, not only ``print``) into pipes; a thread per
pipe copies what arrives to the executor's own log and to the driver, where
:class:`OutputRelay` prints it line by line prefixed with ``[rank N]``. An
exception raised by the task's function is sent as a JSON report (type,
message, formatted traceback), so the driver can re-raise it as a
:class:`~sparkdl.launch.errors.WorkerError`; training progress (epoch and
step metrics, see ``sparkdl.progress``) travels the same way as small JSON
frames, and so do large payloads in both directions (``sparkdl.launch.payloads``:
a task's result, a model the task fetches), which the relay hands to its
``exchange``.

The connection authenticates with a per-job secret like every sparkdl socket;
frames are a fixed header plus at most ``MAX_FRAME_BYTES`` of text or bytes, and
nothing is unpickled. Forwarding never stalls the task: when the driver stops
reading, the task drops further output (its executor log still has it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import TextIO

from sparkdl.net.auth import connect_authenticated
from sparkdl.net.io import recv_exact, shutdown_and_close
from sparkdl.net.listener import HANDSHAKE_TIMEOUT, ServingListener

_log = logging.getLogger(__name__)

_HEADER = struct.Struct("!BI")  # kind, payload length
_STDOUT, _STDERR, _ERROR, _PROGRESS = 1, 2, 3, 4
MAX_FRAME_BYTES = 1 << 20
_RELAY_ID = 0xFFFF_FFFE  # the "rank" the relay proves itself as; tasks authenticate as their partition index
_READ_BYTES = 64 << 10

# Failures that follow another rank's failure (its ring or Horovod peers vanished): Spark's own
# retry of the stage is the remedy, so they neither cancel the job nor hide the rank that failed first.
_SECONDARY_FAILURES = ("CollectiveError", "CollectiveTimeout", "ConnectGaveUp", "HorovodInternalError")
# TensorFlow reports an exception raised inside a tf.numpy_function (the ring's allreduce in the
# compiled train step) as its own error whose message holds a line "<TypeName>: <message>".
_WRAPPED_SECONDARY = re.compile(rf"^(?:[\w.]+\.)?(?:{'|'.join(_SECONDARY_FAILURES)}): ", re.M)


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """An exception raised in one rank's task, as text."""

    rank: int
    type_name: str
    message: str
    traceback: str

    @property
    def secondary(self) -> bool:
        return (
            self.type_name.rsplit(".", 1)[-1] in _SECONDARY_FAILURES
            or _WRAPPED_SECONDARY.search(self.message) is not None
        )

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> ErrorReport:
        kind = type(exc)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        return cls(rank, name, str(exc), "".join(traceback.format_exception(exc)))

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()[:MAX_FRAME_BYTES]

    @classmethod
    def from_json(cls, payload: bytes) -> ErrorReport:
        """The report in ``payload``; ValueError when it is not a JSON object with every field."""
        try:
            fields = json.loads(payload.decode("utf-8", "replace"))
            return cls(int(fields["rank"]), str(fields["type_name"]), str(fields["message"]), str(fields["traceback"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"Expected an error report: a JSON object with rank, type_name, message and "
                f"traceback. Received: {payload[:200]!r} ({type(exc).__name__}: {exc})"
            ) from None


class OutputRelay:
    """Driver side: accepts the tasks' connections, prints their output, collects their error reports.

    ``on_error`` is called (from a relay thread) with the first report of an
    error that is not a consequence of another rank's failure, so the launcher
    can cancel the Spark job at once instead of waiting for timeouts.
    ``on_progress(rank, event)`` gets each progress event a task reports.
    ``exchange`` (a ``sparkdl.launch.payloads.PayloadExchange``) gets the
    frames of the kinds it names: the large payloads going up or down.
    """

    def __init__(
        self,
        host: str,
        secret: bytes,
        num_workers: int,
        *,
        on_error: Callable[[ErrorReport], None] = lambda report: None,
        on_progress: Callable[[int, dict], None] = lambda rank, event: None,
        exchange=None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ):
        self._secret = secret
        self._exchange = exchange
        self._num_workers = num_workers
        self._on_error = on_error
        self._on_progress = on_progress
        self._streams = {_STDOUT: stdout or sys.stdout, _STDERR: stderr or sys.stderr}
        self._lock = threading.Lock()
        self._reports: list[ErrorReport] = []
        self._stopping = threading.Event()
        # Each task holds one connection; a retried task may briefly hold a second one.
        self._listener = ServingListener(
            host,
            secret,
            _RELAY_ID,
            range(num_workers),
            self._serve,
            name="sparkdl-relay",
            max_connections=2 * num_workers + 2,
            handshake_timeout=handshake_timeout,
            backlog=4 * num_workers,
        )
        self.address = self._listener.address

    @property
    def reports(self) -> list[ErrorReport]:
        with self._lock:
            return list(self._reports)

    def first_error(self) -> ErrorReport | None:
        """The error to raise: the first one that is not a consequence of another rank's failure, if any."""
        return next((r for r in self.reports if not r.secondary), None)

    def wait_until_quiet(self, timeout: float) -> None:
        """Waits (bounded) until every task connection has closed, so late error reports are in."""
        self._listener.wait_idle(timeout)

    def close(self) -> None:
        """Stops accepting and ends every task connection (their threads are joined)."""
        self._stopping.set()
        self._listener.close(join_timeout=1.0)

    def __enter__(self) -> OutputRelay:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _serve(self, conn: socket.socket, rank: int) -> None:
        """One authenticated task connection; ``rank`` is the one it proved at the handshake."""
        try:
            conn.settimeout(0.5)
            self._read_frames(conn, rank)
        except (OSError, ValueError, MemoryError) as exc:
            _log.warning("sparkdl output relay: dropped the connection of rank %d: %s", rank, exc or type(exc).__name__)

    def _read_frames(self, conn: socket.socket, rank: int) -> None:
        partial = {_STDOUT: b"", _STDERR: b""}
        session = self._exchange.open(rank) if self._exchange is not None else None
        try:
            while (header := _recv_exact(conn, _HEADER.size, self._stopping)) is not None:
                kind, length = _HEADER.unpack(header)
                if session is not None and kind in session.KINDS:
                    session.handle(conn, kind, length, self._stopping)
                    continue
                if kind not in (_STDOUT, _STDERR, _ERROR, _PROGRESS) or length > MAX_FRAME_BYTES:
                    raise ValueError(f"rank {rank} sent a malformed frame (kind {kind}, {length} bytes)")
                payload = _recv_exact(conn, length, self._stopping)
                if payload is None:
                    return
                if kind == _ERROR:
                    self._record(rank, payload)
                    continue
                if kind == _PROGRESS:
                    self._progress(rank, payload)
                    continue
                *lines, partial[kind] = (partial[kind] + payload).split(b"\n")
                if len(partial[kind]) > MAX_FRAME_BYTES:  # a very long line without a newline: print it as it is
                    lines, partial[kind] = lines + [partial[kind]], b""
                self._print(kind, rank, lines)
        finally:
            for kind, rest in partial.items():
                self._print(kind, rank, [rest] if rest else [])

    def _print(self, kind: int, rank: int, lines: list[bytes]) -> None:
        if not lines:
            return
        text = "".join(f"[rank {rank}] {line.decode('utf-8', 'replace').rstrip(chr(13))}\n" for line in lines)
        stream = self._streams[kind]
        with self._lock:
            stream.write(text)
            stream.flush()

    def _progress(self, rank: int, payload: bytes) -> None:
        try:
            event = json.loads(payload.decode("utf-8"))
            if not isinstance(event, dict):
                raise ValueError(f"expected a JSON object, got {type(event).__name__}")
            self._on_progress(rank, event)
        except Exception as exc:  # progress is informative only: a bad event must not cost the task its output
            _log.warning("sparkdl output relay: ignored a progress event from rank %d: %s", rank, exc)

    def _record(self, rank: int, payload: bytes) -> None:
        try:
            report = ErrorReport.from_json(payload)
        except ValueError as exc:
            _log.warning("sparkdl output relay: ignored a malformed error report from rank %d: %s", rank, exc)
            return
        if report.rank != rank:
            _log.warning(
                "sparkdl output relay: ignored an error report from rank %d that claims to come from rank %d",
                rank,
                report.rank,
            )
            return
        with self._lock:
            first_primary = not report.secondary and not any(not r.secondary for r in self._reports)
            self._reports.append(report)
        if first_primary:
            self._on_error(report)


def _recv_exact(conn: socket.socket, size: int, stopping: threading.Event | None) -> bytes | None:
    """``size`` bytes, or None when the peer closed cleanly before the first byte (or the relay stops)."""
    buffer = bytearray(size)
    return bytes(buffer) if _recv_into(conn, memoryview(buffer), stopping) else None


def _recv_into(conn: socket.socket, view: memoryview, stopping: threading.Event | None) -> bool:
    """Fills ``view``; False when the peer closed cleanly before the first byte (or ``stopping`` is set).

    Without ``stopping`` (a task's side) the socket's timeout ends the wait with ``TimeoutError``;
    with it (the driver's side, short socket timeouts) the wait lasts until the relay stops.
    """
    received = recv_exact(conn, view, stopping=stopping)
    if received == len(view):
        return True
    if received and not (stopping is not None and stopping.is_set()):
        raise ValueError(f"connection closed in the middle of a frame ({received} of {len(view)} bytes)")
    return False


class _Forwarder:
    """Task side: one authenticated connection to the relay, shared by the pipe threads, error reports
    and payloads (which only the task's own thread reads answers for)."""

    def __init__(self, address: str, secret: bytes, rank: int, timeout: float):
        self._rank = rank
        self._timeout = timeout
        try:
            self._sock = connect_authenticated(address, rank, _RELAY_ID, secret, timeout=min(timeout, 30.0))
        except Exception as exc:
            raise ConnectionError(
                f"rank {rank} could not reach the driver's output relay at {address}: {exc}. "
                "Executors must be able to connect to spark.driver.host."
            ) from exc
        self._sock.settimeout(timeout)
        self._lock = threading.Lock()
        self._broken = False

    def send(self, kind: int, payload: bytes, *, must_arrive: bool = False) -> None:
        """Sends ``payload`` as frames of ``kind``. Output is dropped when the driver stopped reading
        (rather than stall the task); with ``must_arrive`` that raises ``ConnectionError`` instead."""
        view = memoryview(payload)
        for start in range(0, len(view), MAX_FRAME_BYTES):
            chunk = view[start : start + MAX_FRAME_BYTES]
            with self._lock:
                try:
                    if self._broken:
                        raise ConnectionError("an earlier send failed")
                    self._sock.sendall(_HEADER.pack(kind, len(chunk)) + chunk)
                except OSError as exc:
                    self._broken = True
                    if must_arrive:
                        raise ConnectionError(
                            f"rank {self._rank} lost its connection to the driver's relay: {exc}"
                        ) from exc
                    return

    def receive_header(self) -> tuple[int, int]:
        """The next frame's kind and length from the driver (only payload answers come this way)."""
        header = bytearray(_HEADER.size)
        self.receive_into(memoryview(header))
        return _HEADER.unpack(header)

    def receive_into(self, view: memoryview) -> None:
        try:
            complete = _recv_into(self._sock, view, None)
        except TimeoutError:
            raise TimeoutError(
                f"rank {self._rank}: the driver's relay did not answer within {self._timeout} seconds"
            ) from None
        except ValueError as exc:
            raise ConnectionError(f"rank {self._rank}: the driver's relay {exc}") from None
        if not complete:
            raise ConnectionError(f"rank {self._rank}: the driver's relay closed the connection")

    def close(self) -> None:
        with self._lock:
            self._broken = True
            shutdown_and_close(self._sock)


class TaskReporter:
    """What a task's code may tell the driver besides its output: its error, and its progress.

    ``connection`` is the task's connection to the driver, over which
    ``sparkdl.launch.payloads`` moves large bytes either way.
    """

    def __init__(self, forwarder: _Forwarder, rank: int):
        self.connection = forwarder
        self._rank = rank

    def error(self, exc: BaseException) -> None:
        self.connection.send(_ERROR, ErrorReport.from_exception(self._rank, exc).to_json())

    def progress(self, event: dict) -> None:
        """Sends a small JSON-able dict; never blocks the task for long and never raises."""
        self.connection.send(_PROGRESS, json.dumps(event).encode())


@contextlib.contextmanager
def forward_output(
    address: str, secret: bytes, rank: int, timeout: float, *, keep_local_copy: bool = True
) -> Iterator[TaskReporter]:
    """Inside a task: relays fd 1 and 2 to the driver while the block runs; yields its ``TaskReporter``.

    ``keep_local_copy`` also writes the output where it went before (the
    executor's log; in local mode that is the driver's console, so not there).
    The descriptors are restored afterwards: PySpark reuses its Python workers.
    """
    forwarder = _Forwarder(address, secret, rank, timeout)
    pipes: list[tuple[int, int, threading.Thread]] = []
    try:
        for fd, kind, stream in ((1, _STDOUT, sys.stdout), (2, _STDERR, sys.stderr)):
            with contextlib.suppress(Exception):
                stream.flush()
            saved = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            thread = threading.Thread(
                target=_pump,
                args=(read_end, saved if keep_local_copy else None, kind, forwarder),
                name=f"sparkdl-forward-fd{fd}",
                daemon=True,
            )
            thread.start()
            pipes.append((fd, saved, thread))
        with _line_buffered(sys.stdout), _line_buffered(sys.stderr):
            yield TaskReporter(forwarder, rank)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, saved, _ in pipes:
            os.dup2(saved, fd)  # drops the pipe's last write end: its thread sees end of file
        for _, saved, thread in pipes:
            thread.join(timeout=5.0)
            os.close(saved)
        forwarder.close()


def _pump(read_end: int, original: int | None, kind: int, forwarder: _Forwarder) -> None:
    """Copies a pipe to the driver (and to the original descriptor, if given) until end of file."""
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while chunk := pipe.read(_READ_BYTES):
            if original is not None:
                with contextlib.suppress(OSError):
                    os.write(original, chunk)
            forwarder.send(kind, chunk)


@contextlib.contextmanager
def _line_buffered(stream) -> Iterator[None]:
    """Python's own buffering would hold a task's prints back until it ends."""
    reconfigure = getattr(stream, "reconfigure", None)
    previous = getattr(stream, "line_buffering", None)
    if reconfigure is None or previous is None:
        yield
        return
    reconfigure(line_buffering=True)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            reconfigure(line_buffering=previous)
