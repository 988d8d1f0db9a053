"""Sockets, authentication and framing for the collective layer.

Everything that touches the network lives here, so the ring algorithms only
see :class:`PeerLink` objects that move numpy buffers between two
authenticated ring neighbours.  Nothing received from the network is ever
deserialised into objects: a data frame is a fixed binary header followed by
raw array bytes whose dtype and size the receiver already knows and checks.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np

_log = logging.getLogger(__name__)

#: Requested kernel socket buffer size.  Large buffers let a sender run a few
#: segments ahead of its receiver, which is what overlaps network copies with
#: the receiver's reductions.
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


class CollectiveError(RuntimeError):
    """A collective or its connection setup failed; the communicator is unusable."""


class CollectiveTimeout(CollectiveError):
    """A single network wait exceeded the configured timeout."""


class Op(enum.IntEnum):
    """Tag carried by every data frame, so ranks calling different collectives are caught."""

    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    BARRIER = 4


_DTYPES = tuple(
    np.dtype(name)
    for name in (
        "float16", "float32", "float64",
        "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64",
        "complex64", "complex128",
    )
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


def dtype_code(dtype: np.dtype) -> int:
    """Wire code of a supported dtype; raises TypeError before anything is sent."""
    try:
        return _DTYPE_CODES[np.dtype(dtype)]
    except KeyError:
        supported = ", ".join(d.name for d in _DTYPES)
        raise TypeError(
            f"unsupported dtype {dtype!s} for collectives; use a native-byte-order "
            f"numeric dtype ({supported})"
        ) from None


# Data frame header: magic, dtype code, op tag, reserved, op sequence number, payload bytes.
_FRAME = struct.Struct("!4sBBHIQ")
_FRAME_MAGIC = b"SDLC"

# Handshake messages.  server -> client: magic + server nonce;
# client -> server: rank + client nonce + client MAC; server -> client: server MAC.
_AUTH_MAGIC = b"SDLA"
_NONCE_BYTES = 32
_MAC_BYTES = hashlib.sha256().digest_size
_SERVER_HELLO_BYTES = len(_AUTH_MAGIC) + _NONCE_BYTES
_CLIENT_HELLO = struct.Struct(f"!I{_NONCE_BYTES}s{_MAC_BYTES}s")


def _client_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes,
                client_rank: int, server_rank: int) -> bytes:
    message = b"client" + server_nonce + client_nonce + struct.pack("!II", client_rank, server_rank)
    return hmac.new(secret, message, hashlib.sha256).digest()


def _server_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes, server_rank: int) -> bytes:
    message = b"server" + client_nonce + server_nonce + struct.pack("!I", server_rank)
    return hmac.new(secret, message, hashlib.sha256).digest()


def _verify_client_hello(secret: bytes, server_nonce: bytes, hello: bytes,
                         server_rank: int) -> tuple[int, bytes] | None:
    """(client rank, client nonce) of a complete client hello whose MAC is valid, else None."""
    client_rank, client_nonce, mac = _CLIENT_HELLO.unpack(hello)
    expected = _client_mac(secret, server_nonce, client_nonce, client_rank, server_rank)
    if not hmac.compare_digest(mac, expected):
        return None
    return client_rank, client_nonce


def _tune(sock: socket.socket) -> None:
    """Disable Nagle (small frames must not wait) and enlarge the kernel buffers."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def parse_address(address: str) -> tuple[str, int]:
    """Split "host:port" or "[ipv6]:port"."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}; expected 'host:port'")
    return host.strip("[]"), int(port)


def _byte_view(array: np.ndarray) -> memoryview:
    """Raw bytes of a 1-D C-contiguous array, without copying."""
    return memoryview(array.view(np.uint8))


class PeerLink:
    """One authenticated TCP connection to a ring neighbour, used in one direction.

    Every wait is bounded by ``timeout`` and every failure surfaces as a
    :class:`CollectiveError` naming this rank, the peer and the operation.
    """

    def __init__(self, sock: socket.socket, rank: int, peer: int, timeout: float):
        sock.settimeout(timeout)
        self._sock = sock
        self.rank = rank
        self.peer = peer
        self.timeout = timeout
        self._header = bytearray(_FRAME.size)

    def send(self, op: Op, seq: int, array: np.ndarray) -> None:
        """Send one frame holding the bytes of a 1-D contiguous array."""
        payload = _byte_view(array)
        header = _FRAME.pack(_FRAME_MAGIC, dtype_code(array.dtype), op, 0, seq, payload.nbytes)
        try:
            # One syscall for header + payload in the common case, without concatenating.
            sent = self._sock.sendmsg([header, payload])
            if sent < len(header):
                self._sock.sendall(header[sent:])
                sent = len(header)
            self._sock.sendall(payload[sent - len(header):])
        except OSError as exc:
            raise self._error(op, "send to", exc) from exc

    def recv_into(self, op: Op, seq: int, out: np.ndarray) -> None:
        """Receive one frame directly into a 1-D contiguous array.

        The header must announce exactly this op, sequence number, dtype and
        size; anything else means the ranks are out of step (or the stream is
        corrupt) and is reported as a desync instead of being trusted.
        """
        payload = _byte_view(out)
        self._recv_exact(memoryview(self._header), op)
        magic, code, got_op, _, got_seq, nbytes = _FRAME.unpack(self._header)
        if magic != _FRAME_MAGIC:
            raise CollectiveError(
                f"rank {self.rank}: corrupt frame from rank {self.peer} during {_name(op)} "
                f"(bad magic {magic!r}); the byte stream between the ranks is out of sync"
            )
        expected = (op, seq, dtype_code(out.dtype), payload.nbytes)
        if (got_op, got_seq, code, nbytes) != expected:
            raise CollectiveError(
                f"rank {self.rank}: desync with rank {self.peer}: expected {_name(op)} #{seq} "
                f"of {out.dtype} ({payload.nbytes} bytes), received {_name(got_op)} #{got_seq} "
                f"of {_dtype_name(code)} ({nbytes} bytes); all ranks must call the same "
                f"collectives in the same order with the same shapes and dtypes"
            )
        self._recv_exact(payload, op)

    def _recv_exact(self, view: memoryview, op: Op) -> None:
        received = 0
        while received < len(view):
            try:
                count = self._sock.recv_into(view[received:])
            except OSError as exc:
                raise self._error(op, "receive from", exc) from exc
            if count == 0:
                raise CollectiveError(
                    f"rank {self.rank}: rank {self.peer} closed the connection during "
                    f"{_name(op)}; check whether that rank's process failed or closed its communicator"
                )
            received += count

    def _error(self, op: Op, action: str, exc: OSError) -> CollectiveError:
        if isinstance(exc, TimeoutError):
            return CollectiveTimeout(
                f"rank {self.rank}: {_name(op)} timed out after {self.timeout}s waiting to "
                f"{action} rank {self.peer}; check that rank {self.peer} is alive and calls the "
                f"same collectives, or raise the timeout"
            )
        return CollectiveError(
            f"rank {self.rank}: {_name(op)} failed to {action} rank {self.peer}: {exc}; "
            f"check whether that rank's process failed"
        )

    def close(self) -> None:
        """Shut down first so a thread blocked on this socket wakes up, then close."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _name(op: int) -> str:
    try:
        return Op(op).name.lower()
    except ValueError:
        return f"unknown op {op}"


def _dtype_name(code: int) -> str:
    return _DTYPES[code].name if code < len(_DTYPES) else f"unknown dtype code {code}"


def bind_listener(host: str, *, backlog: int = 16,
                  reuse_address: bool = False) -> tuple[socket.socket, str]:
    """A listening, tuned socket on an ephemeral port of exactly ``host``, and its "host:port".

    ``reuse_address`` sets SO_REUSEADDR, so that a port released by a stopped
    server can be bound again while its old connections sit in TIME_WAIT.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        _tune(sock)  # accepted sockets inherit the buffer sizes
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return sock, (f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")


@dataclass
class _PendingHandshake:
    """Server-side state of one not yet authenticated connection."""

    nonce: bytes
    deadline: float
    received: bytearray = field(default_factory=bytearray)


class Listener:
    """Listening socket on an ephemeral port of exactly ``host``.

    Created before addresses are exchanged, so each rank's address is known
    (and connectable) before anyone tries to connect.
    """

    def __init__(self, host: str = "127.0.0.1"):
        self._sock, self.address = bind_listener(host)

    def accept_peer(self, rank: int, peer: int, secret: bytes, timeout: float) -> PeerLink:
        """Return the link from ``peer`` once it authenticates; drop every other connection.

        Handshakes run concurrently on a selector, so a silent, slow or hostile
        client cannot delay the real peer; each one is dropped when it fails
        authentication or after ``timeout``.  The whole wait is also bounded by
        ``timeout`` (then :class:`CollectiveTimeout`).
        """
        deadline = time.monotonic() + timeout
        pending: dict[socket.socket, _PendingHandshake] = {}
        refused = 0
        last_refusal = ""
        selector = selectors.DefaultSelector()
        self._sock.setblocking(False)
        selector.register(self._sock, selectors.EVENT_READ)

        def drop(conn: socket.socket, reason: str) -> None:
            nonlocal refused, last_refusal
            selector.unregister(conn)
            del pending[conn]
            conn.close()
            refused += 1
            last_refusal = reason
            _log.warning("rank %d: refused a connection on %s: %s", rank, self.address, reason)

        try:
            while True:
                now = time.monotonic()
                for conn in [c for c, state in pending.items() if now >= state.deadline]:
                    drop(conn, f"no authentication within {timeout}s")
                if now >= deadline:
                    raise CollectiveTimeout(
                        f"rank {rank}: no authenticated connection from rank {peer} on "
                        f"{self.address} within {timeout}s (refused {refused} other "
                        f"connection(s){'; last: ' + last_refusal if refused else ''}); check "
                        f"that rank {peer} is running, can reach this address, and uses the "
                        f"same job secret"
                    )
                wake = min([deadline, *(state.deadline for state in pending.values())])
                for key, _ in selector.select(wake - now):
                    if key.fileobj is self._sock:
                        self._start_handshake(selector, pending, min(deadline, now + timeout))
                        continue
                    conn = key.fileobj
                    state = pending[conn]
                    try:
                        data = conn.recv(_CLIENT_HELLO.size - len(state.received))
                    except BlockingIOError:
                        continue
                    except OSError as exc:
                        drop(conn, f"connection error during authentication: {exc}")
                        continue
                    if not data:
                        drop(conn, "closed during authentication")
                        continue
                    state.received += data
                    if len(state.received) < _CLIENT_HELLO.size:
                        continue
                    verified = _verify_client_hello(secret, state.nonce, bytes(state.received), rank)
                    if verified is None:
                        drop(conn, "bad authentication code (wrong secret or garbage)")
                        continue
                    client_rank, client_nonce = verified
                    if client_rank != peer:
                        drop(conn, f"authenticated as rank {client_rank}, expected rank {peer}")
                        continue
                    selector.unregister(conn)
                    del pending[conn]
                    conn.setblocking(True)
                    conn.settimeout(timeout)
                    try:
                        conn.sendall(_server_mac(secret, client_nonce, state.nonce, rank))
                    except OSError as exc:
                        conn.close()
                        refused += 1
                        last_refusal = f"rank {peer} vanished after authenticating: {exc}"
                        continue
                    _tune(conn)
                    return PeerLink(conn, rank, peer, timeout)
        finally:
            for conn in pending:
                conn.close()
            selector.close()
            self._sock.setblocking(True)

    def _start_handshake(self, selector: selectors.BaseSelector,
                         pending: dict[socket.socket, _PendingHandshake], deadline: float) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return
        conn.setblocking(False)
        nonce = os.urandom(_NONCE_BYTES)
        try:
            # 36 bytes always fit the empty send buffer of a fresh connection.
            if conn.send(_AUTH_MAGIC + nonce) != _SERVER_HELLO_BYTES:
                raise OSError("short write of the server hello")
        except OSError:
            conn.close()
            return
        pending[conn] = _PendingHandshake(nonce, deadline)
        selector.register(conn, selectors.EVENT_READ)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _HandshakeFailed(Exception):
    """The server end did not complete a valid handshake; worth retrying."""


def connect_peer(address: str, rank: int, peer: int, secret: bytes, timeout: float) -> PeerLink:
    """Connect to ``peer``'s listener and authenticate mutually.

    Refused connections and failed handshakes are retried with backoff until
    ``timeout`` has passed, because the peer may still be busy dropping an
    impostor or may not be accepting yet.
    """
    try:
        sock = connect_authenticated(address, rank, peer, secret, timeout)
    except ConnectGaveUp as exc:
        raise CollectiveTimeout(
            f"rank {rank}: could not connect to rank {peer} at {address} within {timeout}s "
            f"(last error: {exc.last_error}); check that rank {peer} is running, that its "
            f"address is reachable from this host, and that all ranks use the same job secret"
        ) from None
    return PeerLink(sock, rank, peer, timeout)


class ConnectGaveUp(Exception):
    """:func:`connect_authenticated` found no authenticated connection within its timeout."""

    def __init__(self, last_error: str):
        super().__init__(last_error)
        self.last_error = last_error


def connect_authenticated(address: str, rank: int, peer: int, secret: bytes,
                          timeout: float) -> socket.socket:
    """A tuned socket connected to ``address`` after mutual authentication as ``rank`` -> ``peer``.

    Refused connections and failed handshakes are retried with backoff; raises
    :class:`ConnectGaveUp` (with the last error) once ``timeout`` has passed.
    The returned socket still has the remaining connect time as its timeout.
    """
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    delay = 0.01
    last_error = "no attempt made"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ConnectGaveUp(last_error)
        sock = None
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
            _tune(sock)
            sock.settimeout(remaining)
            sock.connect(sockaddr)
            _client_handshake(sock, rank, peer, secret)
            return sock
        except (OSError, _HandshakeFailed) as exc:
            if sock is not None:
                sock.close()
            last_error = str(exc) or type(exc).__name__
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(2 * delay, 0.5)


def _client_handshake(sock: socket.socket, rank: int, peer: int, secret: bytes) -> None:
    hello = _recv_handshake(sock, _SERVER_HELLO_BYTES)
    if not hello.startswith(_AUTH_MAGIC):
        raise _HandshakeFailed("the listener did not speak the sparkdl collective protocol")
    server_nonce = hello[len(_AUTH_MAGIC):]
    client_nonce = os.urandom(_NONCE_BYTES)
    mac = _client_mac(secret, server_nonce, client_nonce, rank, peer)
    sock.sendall(_CLIENT_HELLO.pack(rank, client_nonce, mac))
    proof = _recv_handshake(sock, _MAC_BYTES)
    if not hmac.compare_digest(proof, _server_mac(secret, client_nonce, server_nonce, peer)):
        raise _HandshakeFailed(f"rank {peer} failed to prove it knows the job secret")


def _recv_handshake(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise _HandshakeFailed(
                "the peer closed the connection during authentication (different job secret?)"
            )
        received += count
    return bytes(buffer)


def server_handshake(sock: socket.socket, server_rank: int, secret: bytes, timeout: float,
                     client_ranks: range | None = None) -> int:
    """Authenticate one accepted connection (blocking); return the client's rank.

    For servers that run one thread per connection.  A client that
    authenticates with a rank outside ``client_ranks`` is refused before the
    server proves itself, so the client sees a failed handshake.  The whole exchange is
    bounded by ``timeout`` (a client trickling bytes cannot stretch it); raises
    :class:`_HandshakeFailed` on a bad MAC, an early close or the deadline,
    and OSError on socket errors.
    """
    deadline = time.monotonic() + timeout
    nonce = os.urandom(_NONCE_BYTES)
    sock.settimeout(timeout)
    sock.sendall(_AUTH_MAGIC + nonce)
    hello = bytearray(_CLIENT_HELLO.size)
    view = memoryview(hello)
    received = 0
    while received < len(hello):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _HandshakeFailed(f"no authentication within {timeout}s")
        sock.settimeout(remaining)
        try:
            count = sock.recv_into(view[received:])
        except TimeoutError:
            raise _HandshakeFailed(f"no authentication within {timeout}s") from None
        if count == 0:
            raise _HandshakeFailed("closed during authentication")
        received += count
    verified = _verify_client_hello(secret, nonce, bytes(hello), server_rank)
    if verified is None:
        raise _HandshakeFailed("bad authentication code (wrong secret or garbage)")
    client_rank, client_nonce = verified
    if client_ranks is not None and client_rank not in client_ranks:
        raise _HandshakeFailed(
            f"authenticated as rank {client_rank}, expected one of {client_ranks.start}.."
            f"{client_ranks.stop - 1}")
    sock.sendall(_server_mac(secret, client_nonce, nonce, server_rank))
    return client_rank
