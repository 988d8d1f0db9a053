"""A task's side of the relay: its stdout, stderr, error and progress go to the driver as they happen.

Each task redirects its stdout and stderr file descriptors (so C++ logs from
TensorFlow or Horovod come too, not only ``print``) into pipes; a thread per
pipe copies what arrives to the executor's own log and to the driver's
:class:`~sparkdl.launch.relay.OutputRelay`. Forwarding never stalls the task:
when the driver stops reading, the task drops further output (its executor log
still has it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator

from sparkdl.launch.phases import Phases
from sparkdl.launch.relay_frames import (
    ERROR,
    HEADER,
    MAX_FRAME_BYTES,
    PROGRESS,
    RELAY_ID,
    STDERR,
    STDOUT,
    ErrorReport,
    recv_into,
    send_frame,
)
from sparkdl.net.io import shutdown_and_close
from sparkdl.net.secure import connect_channel

_READ_BYTES = 64 << 10


class _Forwarder:
    """Task side: one authenticated connection to the relay, shared by the pipe threads, error reports
    and payloads (which only the task's own thread reads answers for)."""

    def __init__(self, address: str, secret: bytes, rank: int, timeout: float, *, encrypt: bool):
        self._rank = rank
        self._timeout = timeout
        try:
            self._channel = connect_channel(
                address, rank, RELAY_ID, secret, min(timeout, 30.0), encrypt=encrypt, peer_name="the driver's relay"
            )
        except Exception as exc:
            raise ConnectionError(
                f"rank {rank} could not reach the driver's output relay at {address}: {exc}. "
                "Executors must be able to connect to spark.driver.host."
            ) from exc
        self._channel.sock.settimeout(timeout)
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
                    send_frame(self._channel, kind, chunk)
                except OSError as exc:
                    self._broken = True
                    if must_arrive:
                        raise ConnectionError(
                            f"rank {self._rank} lost its connection to the driver's relay: {exc}"
                        ) from exc
                    return

    def receive_header(self) -> tuple[int, int]:
        """The next frame's kind and length from the driver (only payload answers come this way)."""
        header = bytearray(HEADER.size)
        self.receive_into(memoryview(header))
        return HEADER.unpack(header)

    def receive_into(self, view: memoryview) -> None:
        try:
            complete = recv_into(self._channel, view, None)
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
            shutdown_and_close(self._channel.sock)


class TaskReporter:
    """What a task's code may tell the driver besides its output: its error, its progress, and its phases.

    ``connection`` is the task's connection to the driver, over which
    ``sparkdl.launch.payloads`` moves large bytes either way. ``phases`` times the task from its
    start (``sparkdl.launch.phases``): the task names each phase as it ends with :meth:`phase`.
    """

    def __init__(self, forwarder: _Forwarder, rank: int, phases: Phases | None = None):
        self.connection = forwarder
        self.phases = phases if phases is not None else Phases()
        self._rank = rank

    def phase(self, name: str) -> None:
        """Names the task's time since its previous phase (or its start) ``name``."""
        self.phases.end(name)

    def error(self, exc: BaseException) -> None:
        self.connection.send(ERROR, ErrorReport.from_exception(self._rank, exc).to_json())

    def progress(self, event: dict) -> None:
        """Sends a small JSON-able dict; never blocks the task for long and never raises."""
        self.connection.send(PROGRESS, json.dumps(event).encode())


@contextlib.contextmanager
def forward_output(
    address: str,
    secret: bytes,
    rank: int,
    timeout: float,
    *,
    keep_local_copy: bool = True,
    encrypt: bool = False,
    phases: Phases | None = None,
) -> Iterator[TaskReporter]:
    """Inside a task: relays fd 1 and 2 to the driver while the block runs; yields its ``TaskReporter``.

    ``keep_local_copy`` also writes the output where it went before (the
    executor's log; in local mode that is the driver's console, so not there).
    The descriptors are restored afterwards: PySpark reuses its Python workers.
    ``encrypt`` seals the connection, as the driver's relay does when its session encrypts RPC.
    ``phases``: the task's timer, started when the task did (else now).
    """
    forwarder = _Forwarder(address, secret, rank, timeout, encrypt=encrypt)
    pipes: list[tuple[int, int, threading.Thread]] = []
    try:
        for fd, kind, stream in ((1, STDOUT, sys.stdout), (2, STDERR, sys.stderr)):
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
            yield TaskReporter(forwarder, rank, phases)
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
