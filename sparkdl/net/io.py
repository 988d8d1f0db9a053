"""Exact reads and writes on a blocking socket: what every sparkdl connection does after its handshake."""

from __future__ import annotations

import functools
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence

#: Requested kernel socket buffer size.  Large buffers let a sender run a few
#: segments ahead of its receiver, which is what overlaps network copies with
#: the receiver's reductions.
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


class ReadTimeout(TimeoutError):
    """The socket's timeout ended a read; ``received`` bytes of the buffer had arrived."""

    def __init__(self, received: int, size: int):
        super().__init__(f"timed out after {received} of {size} bytes")
        self.received = received


def recv_exact(sock: socket.socket, view: memoryview, *, stopping: threading.Event | None = None) -> int:
    """Fill ``view`` from ``sock``; return how many bytes arrived: ``len(view)``, or fewer when the peer closed.

    A socket timeout raises :class:`ReadTimeout` (a ``TimeoutError``), unless
    ``stopping`` is given: then the wait goes on until ``stopping`` is set
    (for listeners whose sockets have short timeouts only to notice a stop),
    and the bytes so far are returned as if the peer had closed.
    """
    received = 0
    while received < len(view):
        try:
            count = sock.recv_into(view[received:])
        except TimeoutError:
            if stopping is None:
                raise ReadTimeout(received, len(view)) from None
            if stopping.is_set():
                return received
            continue
        if count == 0:
            return received
        received += count
    return received


def send_buffers(
    sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview], *, stopping: threading.Event | None = None
) -> None:
    """Send several buffers in order, with one ``sendmsg`` in the common case and no concatenation.

    ``sendmsg`` may send only part of them; the rest follows. A socket timeout raises
    ``TimeoutError``, unless ``stopping`` is given: then the send goes on until it is set
    (and raises ``ConnectionAbortedError``), as :func:`recv_exact` waits.
    """
    views = [memoryview(buffer).cast("B") for buffer in buffers if len(buffer)]
    if not views:
        return
    sent = _patiently(lambda: sock.sendmsg(views), stopping)
    for view in views:
        if sent >= len(view):
            sent -= len(view)
            continue
        if stopping is None:
            sock.sendall(view[sent:])
        else:
            rest = view[sent:]
            while len(rest):
                rest = rest[_patiently(functools.partial(sock.send, rest), stopping) :]
        sent = 0


def write_available(sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview]) -> list[memoryview]:
    """Writes what the socket takes now, in order, without waiting; returns what is left to send, in order.

    One ``writev`` on the descriptor, which Python keeps non-blocking for a socket with a timeout; a socket without
    one (which would block) is not written to: all of ``buffers`` is returned.
    """
    views = [memoryview(buffer).cast("B") for buffer in buffers if len(buffer)]
    if not views or sock.gettimeout() is None:
        return views
    try:
        written = os.writev(sock.fileno(), views)
    except BlockingIOError:
        return views
    while views and written >= len(views[0]):
        written -= len(views.pop(0))
    if views:
        views[0] = views[0][written:]
    return views


def _patiently(send: Callable[[], int], stopping: threading.Event | None) -> int:
    """``send()``, retried after socket timeouts while ``stopping`` (when given) is not set."""
    while True:
        try:
            return send()
        except TimeoutError:
            if stopping is None:
                raise
            if stopping.is_set():
                raise ConnectionAbortedError("stopped while sending") from None


def tune(sock: socket.socket) -> None:
    """Disable Nagle (small frames must not wait; TCP sockets only) and enlarge the kernel buffers."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def shutdown_and_close(sock: socket.socket) -> None:
    """Shut down first so a thread blocked on this socket wakes up, then close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def close_with_reset(sock: socket.socket) -> None:
    """Close abortively (SO_LINGER 0: a reset, no TIME_WAIT), so the peer can tell it was dropped unheard."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def parse_address(address: str) -> tuple[str, int]:
    """Split "host:port" or "[ipv6]:port"."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}; expected 'host:port'")
    return host.strip("[]"), int(port)


def bind_listener(host: str, *, backlog: int = 16, reuse_address: bool = False) -> tuple[socket.socket, str]:
    """A listening, tuned socket on an ephemeral port of exactly ``host``, and its "host:port".

    ``reuse_address`` sets SO_REUSEADDR, so that a port released by a stopped
    server can be bound again while its old connections sit in TIME_WAIT.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        tune(sock)  # accepted sockets inherit the buffer sizes
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return sock, (f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")
