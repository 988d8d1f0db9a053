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
``exchange``, and a barrier stage's rendezvous (``sparkdl.launch.rendezvous``).

The connection authenticates with a per-job secret like every sparkdl socket,
and is sealed when the session encrypts its RPC; its frames
(:mod:`sparkdl.launch.relay_frames`) are a fixed header plus at most
``MAX_FRAME_BYTES`` of text or bytes, and nothing is unpickled. This module is
the driver's side; the tasks' side is :mod:`sparkdl.launch.forward`.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable
from typing import TextIO

from sparkdl.launch import relay_frames
from sparkdl.net.acceptor import HANDSHAKE_TIMEOUT
from sparkdl.net.listener import ServingListener
from sparkdl.net.secure import Channel

_log = logging.getLogger(__name__)


class OutputRelay:
    """Driver side: accepts the tasks' connections, prints their output, collects their error reports.

    ``on_error`` is called (from a relay thread) with the first report of an
    error that is not a consequence of another rank's failure, so the launcher
    can cancel the Spark job at once instead of waiting for timeouts.
    ``on_progress(rank, event)`` gets each progress event a task reports.
    ``exchange`` (a ``sparkdl.launch.payloads.PayloadExchange``) gets the
    frames of the kinds it names: the large payloads going up or down;
    ``rendezvous`` (a ``sparkdl.launch.rendezvous.Rendezvous``) those of a barrier stage's rendezvous.
    """

    def __init__(
        self,
        host: str,
        secret: bytes,
        num_workers: int,
        *,
        on_error: Callable[[relay_frames.ErrorReport], None] = lambda report: None,
        on_progress: Callable[[int, dict], None] = lambda rank, event: None,
        exchange=None,
        rendezvous=None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        encrypt: bool = False,
    ):
        self._secret = secret
        self._handlers = [handler for handler in (exchange, rendezvous) if handler is not None]
        self._num_workers = num_workers
        self._on_error = on_error
        self._on_progress = on_progress
        self._streams = {relay_frames.STDOUT: stdout or sys.stdout, relay_frames.STDERR: stderr or sys.stderr}
        self._lock = threading.Lock()
        self._served: set[int] = set()  # the ranks that connected
        self._reports: list[relay_frames.ErrorReport] = []
        self._stopping = threading.Event()
        # Each task holds one connection; a retried task may briefly hold a second one.
        self._listener = ServingListener(
            host,
            secret,
            relay_frames.RELAY_ID,
            range(num_workers),
            self._serve,
            name="sparkdl-relay",
            max_connections=2 * num_workers + 2,
            handshake_timeout=handshake_timeout,
            encrypt=encrypt,
        )
        self.address = self._listener.address

    @property
    def reports(self) -> list[relay_frames.ErrorReport]:
        with self._lock:
            return list(self._reports)

    @property
    def served(self) -> frozenset[int]:
        """The ranks whose tasks connected (an authenticated connection) so far."""
        with self._lock:
            return frozenset(self._served)

    def first_error(self) -> relay_frames.ErrorReport | None:
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

    def _serve(self, channel: Channel, rank: int) -> None:
        """One authenticated task connection; ``rank`` is the one it proved at the handshake."""
        with self._lock:
            self._served.add(rank)
        try:
            channel.sock.settimeout(0.5)
            self._read_frames(channel, rank)
        except (OSError, ValueError, MemoryError) as exc:
            _log.warning("sparkdl output relay: dropped the connection of rank %d: %s", rank, exc or type(exc).__name__)

    def _read_frames(self, channel: Channel, rank: int) -> None:
        partial = {relay_frames.STDOUT: b"", relay_frames.STDERR: b""}
        sessions = {}  # frame kind -> the handler session of this connection that reads it
        for handler in self._handlers:
            session = handler.open(rank)
            sessions.update(dict.fromkeys(session.KINDS, session))
        try:
            while (header := relay_frames.recv_bytes(channel, relay_frames.HEADER.size, self._stopping)) is not None:
                kind, length = relay_frames.HEADER.unpack(header)
                if kind in sessions:
                    sessions[kind].handle(channel, kind, length, self._stopping)
                    continue
                if (
                    kind not in (relay_frames.STDOUT, relay_frames.STDERR, relay_frames.ERROR, relay_frames.PROGRESS)
                    or length > relay_frames.MAX_FRAME_BYTES
                ):
                    raise ValueError(f"rank {rank} sent a malformed frame (kind {kind}, {length} bytes)")
                payload = relay_frames.recv_bytes(channel, length, self._stopping)
                if payload is None:
                    return
                if kind == relay_frames.ERROR:
                    self._record(rank, payload)
                    continue
                if kind == relay_frames.PROGRESS:
                    self._progress(rank, payload)
                    continue
                *lines, partial[kind] = (partial[kind] + payload).split(b"\n")
                if (
                    len(partial[kind]) > relay_frames.MAX_FRAME_BYTES
                ):  # a very long line without a newline: print it as it is
                    lines, partial[kind] = lines + [partial[kind]], b""
                self._print(kind, rank, lines)
        finally:
            for session in set(sessions.values()):
                session.close()
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
            report = relay_frames.ErrorReport.from_json(payload)
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
