"""Ring links for the collective layer: framed numpy buffers between two authenticated ring neighbours.

The ring algorithms only see :class:`PeerLink` objects; sockets, the
handshake and exact reads/writes come from :mod:`sparkdl.net`.  Nothing
received from the network is ever deserialised into objects: a data frame is a
fixed binary header followed by raw array bytes whose dtype and size the
receiver already knows and checks.
"""

from __future__ import annotations

import enum
import logging
import struct
import time

import numpy as np

from sparkdl.net.acceptor import HANDSHAKE_TIMEOUT, MAX_PENDING, HandshakeAcceptor
from sparkdl.net.auth import ConnectGaveUp, connect_authenticated
from sparkdl.net.io import (
    SOCKET_BUFFER_BYTES,
    bind_listener,
    parse_address,
    shutdown_and_close,
)
from sparkdl.net.secure import Channel, connect_channel, open_channel

__all__ = [
    "SOCKET_BUFFER_BYTES",
    "CollectiveError",
    "CollectiveTimeout",
    "ConnectGaveUp",
    "Listener",
    "Op",
    "PeerLink",
    "connect_authenticated",
    "connect_peer",
    "dtype_code",
    "parse_address",
]

_log = logging.getLogger(__name__)


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
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "complex64",
        "complex128",
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
            f"unsupported dtype {dtype!s} for collectives; use a native-byte-order numeric dtype ({supported})"
        ) from None


# Data frame header: magic, dtype code, op tag, reserved, op sequence number, payload bytes.
_FRAME = struct.Struct("!4sBBHIQ")
_FRAME_MAGIC = b"SDLC"


def _byte_view(array: np.ndarray) -> memoryview:
    """Raw bytes of a 1-D C-contiguous array, without copying."""
    return array.view(np.uint8).data


class PeerLink:
    """One authenticated TCP connection to a ring neighbour, used in one direction.

    Every wait is bounded by ``timeout`` and every failure surfaces as a
    :class:`CollectiveError` naming this rank, the peer and the operation.
    """

    def __init__(self, channel: Channel, rank: int, peer: int, timeout: float):
        channel.sock.settimeout(timeout)
        self._sock = channel.sock
        self._channel = channel
        self.rank = rank
        self.peer = peer
        self.timeout = timeout
        self._header = bytearray(_FRAME.size)

    def send(self, op: Op, seq: int, array: np.ndarray) -> None:
        """Send one frame holding the bytes of a 1-D contiguous array."""
        payload = _byte_view(array)
        header = _FRAME.pack(_FRAME_MAGIC, dtype_code(array.dtype), op, 0, seq, payload.nbytes)
        try:
            self._channel.send([header, payload])
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
        try:
            received = self._channel.recv_into(view)
        except OSError as exc:
            raise self._error(op, "receive from", exc) from exc
        if received < len(view):
            raise CollectiveError(
                f"rank {self.rank}: rank {self.peer} closed the connection during "
                f"{_name(op)}; check whether that rank's process failed or closed its communicator"
            )

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
        shutdown_and_close(self._sock)


def _name(op: int) -> str:
    try:
        return Op(op).name.lower()
    except ValueError:
        return f"unknown op {op}"


def _dtype_name(code: int) -> str:
    return _DTYPES[code].name if code < len(_DTYPES) else f"unknown dtype code {code}"


class Listener:
    """Listening socket on an ephemeral port of exactly ``host``.

    Created before addresses are exchanged, so each rank's address is known
    (and connectable) before anyone tries to connect.  ``handshake_timeout``
    and ``max_pending`` bound each unauthenticated connection (see
    :mod:`sparkdl.net.acceptor`).
    """

    def __init__(
        self, host: str = "127.0.0.1", *, handshake_timeout: float = HANDSHAKE_TIMEOUT, max_pending: int = MAX_PENDING
    ):
        self._sock, self.address = bind_listener(host)
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending

    def accept_peer(self, rank: int, peer: int, secret: bytes, timeout: float, *, encrypt: bool = False) -> PeerLink:
        """Return the link from ``peer`` once it authenticates; drop every other connection.

        Handshakes run concurrently on a selector, so a silent, slow or hostile
        client cannot delay the real peer; each one is dropped when it fails
        authentication, after ``min(timeout, handshake_timeout)``, or when evicted
        to make room (``max_pending`` pending at most: the oldest of the address
        holding the most goes).  The whole wait is bounded by
        ``timeout`` (then :class:`CollectiveTimeout`).  ``encrypt`` seals the link (see :mod:`sparkdl.net.secure`).
        """
        deadline = time.monotonic() + timeout
        acceptor = HandshakeAcceptor(
            self._sock,
            f"rank {rank}'s listener {self.address}",
            secret,
            rank,
            (peer,),
            handshake_timeout=min(timeout, self.handshake_timeout),
            max_pending=self.max_pending,
        )
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                ready = acceptor.poll(remaining)
                for extra, _, _ in ready[1:]:  # a duplicate peer: only the first is used
                    shutdown_and_close(extra)
                if ready:
                    conn, _, proof = ready[0]
                    try:
                        conn.settimeout(timeout)
                        conn.sendall(proof)
                    except OSError as exc:
                        conn.close()
                        acceptor.refuse(f"rank {peer} vanished after authenticating: {exc}")
                        continue
                    channel = open_channel(conn, secret, proof, encrypt=encrypt, is_client=False, peer=f"rank {peer}")
                    return PeerLink(channel, rank, peer, timeout)
            raise CollectiveTimeout(
                f"rank {rank}: no authenticated connection from rank {peer} on "
                f"{self.address} within {timeout}s (refused {acceptor.refused} other "
                f"connection(s){'; last: ' + acceptor.last_refusal if acceptor.refused else ''}); check "
                f"that rank {peer} is running, can reach this address, and uses the "
                f"same job secret"
            )
        finally:
            acceptor.close()
            self._sock.setblocking(True)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def connect_peer(
    address: str, rank: int, peer: int, secret: bytes, timeout: float, *, encrypt: bool = False
) -> PeerLink:
    """Connect to ``peer``'s listener and authenticate mutually.

    Refused connections and failed handshakes are retried with backoff until
    ``timeout`` has passed, because the peer may still be busy dropping an
    impostor or may not be accepting yet.
    """
    try:
        channel = connect_channel(address, rank, peer, secret, timeout, encrypt=encrypt)
    except ConnectGaveUp as exc:
        raise CollectiveTimeout(
            f"rank {rank}: could not connect to rank {peer} at {address} within {timeout}s "
            f"(last error: {exc.last_error}); check that rank {peer} is running, that its "
            f"address is reachable from this host, and that all ranks use the same job secret"
        ) from None
    return PeerLink(channel, rank, peer, timeout)
