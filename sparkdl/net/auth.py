"""Mutual HMAC-SHA256 challenge/response with the per-job secret: how every sparkdl connection starts.

server -> client: magic + server nonce; client -> server: client rank +
client nonce + client MAC; server -> client: server MAC.  Each side proves the
secret and the ranks it claims ("rank" of a server: the ring rank, the shard
index or the relay's id), so a client that mixes up addresses fails too.
Nothing in a handshake is deserialised beyond fixed-size binary fields.

A client whose connection is cut says why: a listener that drops a connection
before reading its hello (too many pending handshakes, or its deadline passed:
see :mod:`sparkdl.net.acceptor`) resets it, while one that read the hello and
refused it (a wrong secret or rank) closes it, so only then is the client told
to check the secret. The listener sends nothing else to an unauthenticated peer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

from sparkdl.net.io import parse_address, recv_exact, tune

AUTH_MAGIC = b"SDLA"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
SERVER_HELLO_BYTES = len(AUTH_MAGIC) + NONCE_BYTES
CLIENT_HELLO = struct.Struct(f"!I{NONCE_BYTES}s{MAC_BYTES}s")

_CLOSED_BEFORE_GREETING = "the listener closed the connection before greeting this client (is it stopping?)"
_DROPPED_UNREAD = (
    "the listener dropped the connection before reading this client's hello: it had more pending handshakes "
    "than it holds, or this client's handshake deadline passed (a flood of connections, or a slow client; "
    "not a secret mismatch)"
)
_REFUSED_AFTER_HELLO = (
    "the listener closed the connection after reading this client's proof (different job secret, or a rank "
    "it does not serve?)"
)


class HandshakeFailed(Exception):
    """The other end did not complete a valid handshake; worth retrying from the client's side."""


class ConnectGaveUp(Exception):
    """:func:`connect_authenticated` found no authenticated connection within its timeout (or, ``refused``, none can come)."""

    def __init__(self, last_error: str, *, refused: bool = False):
        super().__init__(last_error)
        self.last_error = last_error
        self.refused = refused


def _client_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes, client_rank: int, server_rank: int) -> bytes:
    message = b"client" + server_nonce + client_nonce + struct.pack("!II", client_rank, server_rank)
    return hmac.new(secret, message, hashlib.sha256).digest()


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes, server_rank: int) -> bytes:
    """The server's last message: proof that it knows the secret too."""
    message = b"server" + client_nonce + server_nonce + struct.pack("!I", server_rank)
    return hmac.new(secret, message, hashlib.sha256).digest()


def server_hello() -> tuple[bytes, bytes]:
    """(nonce, first message) of a server's side of a new handshake."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce, AUTH_MAGIC + nonce


def verify_client_hello(secret: bytes, server_nonce: bytes, hello: bytes, server_rank: int) -> tuple[int, bytes] | None:
    """(client rank, client nonce) of a complete client hello whose MAC is valid, else None."""
    client_rank, client_nonce, mac = CLIENT_HELLO.unpack(hello)
    expected = _client_mac(secret, server_nonce, client_nonce, client_rank, server_rank)
    if not hmac.compare_digest(mac, expected):
        return None
    return client_rank, client_nonce


def connect_authenticated(address: str, rank: int, peer: int, secret: bytes, timeout: float) -> socket.socket:
    """A tuned socket connected to ``address`` after mutual authentication; see :func:`connect_with_proof`."""
    return connect_with_proof(address, rank, peer, secret, timeout)[0]


def connect_with_proof(
    address: str, rank: int, peer: int, secret: bytes, timeout: float, *, refused_is_final: bool = False
) -> tuple[socket.socket, bytes]:
    """(socket, the server's proof, which salts session keys): a tuned socket connected to ``address`` after mutual authentication as ``rank`` -> ``peer``.

    Refused connections and failed handshakes are retried with backoff (the
    server may be busy dropping an impostor or not accepting yet); raises
    :class:`ConnectGaveUp` (with the last error) once ``timeout`` has passed.
    The returned socket still has the remaining connect time as its timeout.
    ``refused_is_final``: a refused connection ends the attempts at once, for
    listeners known to be listening already (a refusal then means the peer is gone).
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
            tune(sock)
            sock.settimeout(remaining)
            sock.connect(sockaddr)
            return sock, client_handshake(sock, rank, peer, secret)
        except (OSError, HandshakeFailed) as exc:
            if sock is not None:
                sock.close()
            last_error = str(exc) or type(exc).__name__
            if refused_is_final and isinstance(exc, ConnectionRefusedError):
                raise ConnectGaveUp(last_error, refused=True) from None
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(2 * delay, 0.5)


def client_handshake(sock: socket.socket, rank: int, peer: int, secret: bytes) -> bytes:
    """The client's side of the handshake on a connected ``sock``, as ``rank`` towards ``peer``: the server's proof."""
    hello = _recv_handshake(sock, SERVER_HELLO_BYTES, _CLOSED_BEFORE_GREETING)
    if not hello.startswith(AUTH_MAGIC):
        raise HandshakeFailed("the listener did not speak the sparkdl protocol")
    server_nonce = hello[len(AUTH_MAGIC) :]
    client_nonce = os.urandom(NONCE_BYTES)
    mac = _client_mac(secret, server_nonce, client_nonce, rank, peer)
    try:
        sock.sendall(CLIENT_HELLO.pack(rank, client_nonce, mac))
    except ConnectionError:  # reset or closed while sending
        raise HandshakeFailed(_DROPPED_UNREAD) from None
    proof = _recv_handshake(sock, MAC_BYTES, _REFUSED_AFTER_HELLO)
    if not hmac.compare_digest(proof, server_proof(secret, client_nonce, server_nonce, peer)):
        raise HandshakeFailed(f"rank {peer} failed to prove it knows the job secret")
    return proof


def _recv_handshake(sock: socket.socket, size: int, closed: str) -> bytes:
    """``size`` bytes of the handshake; HandshakeFailed with ``closed`` if the listener closed the connection, or
    saying it dropped the connection unread if it reset it."""
    buffer = bytearray(size)
    try:
        received = recv_exact(sock, memoryview(buffer))
    except ConnectionResetError:
        raise HandshakeFailed(_DROPPED_UNREAD) from None
    if received < size:
        raise HandshakeFailed(closed)
    return bytes(buffer)
