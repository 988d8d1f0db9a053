"""Channels over an authenticated socket: plain (today's bytes) or sealed with AEAD when Spark encrypts its RPC.

A sealed channel derives one AES-256-GCM key per direction with
HKDF-SHA256 from the per-job secret, salted with the handshake's server proof
(an HMAC over both sides' fresh nonces, so every connection gets new keys).
Each record is a 4-byte length prefix, authenticated as associated data, and
the ciphertext with its tag; the 96-bit nonce is a per-direction 64-bit
counter that both ends advance, so a flipped bit, a replayed, dropped or
reordered record all fail decryption with :class:`IntegrityError`.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sparkdl.net.auth import connect_with_proof
from sparkdl.net.io import ReadTimeout, recv_exact, send_buffers

#: Plaintext bytes per record; a length prefix above this (plus the tag) is refused before allocating.
RECORD_BYTES = 1 << 20
TAG_BYTES = 16
_LENGTH = struct.Struct("!I")


class IntegrityError(ConnectionError):
    """A sealed record failed authentication: the stream was tampered with, replayed or reordered."""


class Channel(Protocol):
    """What a connection is after its handshake: exact sends and reads, plain or sealed alike."""

    sock: socket.socket  # for timeouts and shutdown; its bytes are the channel's alone

    def send(
        self, buffers: Sequence[bytes | bytearray | memoryview], *, stopping: threading.Event | None = None
    ) -> None: ...

    def recv_into(self, view: memoryview, *, stopping: threading.Event | None = None) -> int: ...

    def wire(self, buffers: Sequence[bytes | bytearray | memoryview]) -> list[bytes | bytearray | memoryview]:
        """The bytes :meth:`send` would write for ``buffers``, to be written whole and in the order made (a sealed
        channel's records take the next nonces)."""
        ...


class PlainChannel:
    """Today's wire format: buffers go out as they are and are read straight into the caller's memory."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(
        self, buffers: Sequence[bytes | bytearray | memoryview], *, stopping: threading.Event | None = None
    ) -> None:
        send_buffers(self.sock, buffers, stopping=stopping)

    def wire(self, buffers: Sequence[bytes | bytearray | memoryview]) -> list[bytes | bytearray | memoryview]:
        return list(buffers)

    def recv_into(self, view: memoryview, *, stopping: threading.Event | None = None) -> int:
        return recv_exact(self.sock, view, stopping=stopping)


def _key(secret: bytes, salt: bytes, direction: bytes) -> AESGCM:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=b"sparkdl record key " + direction)
    return AESGCM(hkdf.derive(secret))


class SealedChannel:
    """Authenticated encryption of everything sent and received on ``sock`` after the handshake.

    ``proof`` is the server's handshake proof (both ends know it); ``is_client``
    picks which derived key seals and which opens.  ``peer`` names the other
    end in errors.
    """

    def __init__(self, sock: socket.socket, secret: bytes, proof: bytes, *, is_client: bool, peer: str):
        self.sock = sock
        self.peer = peer
        to_server, to_client = _key(secret, proof, b"client->server"), _key(secret, proof, b"server->client")
        self._sealer, self._opener = (to_server, to_client) if is_client else (to_client, to_server)
        self._send_counter = 0
        self._recv_counter = 0
        self._plain = memoryview(b"")
        self._length = bytearray(_LENGTH.size)

    @staticmethod
    def _nonce(counter: int) -> bytes:
        return b"\0\0\0\0" + counter.to_bytes(8, "big")

    def send(
        self, buffers: Sequence[bytes | bytearray | memoryview], *, stopping: threading.Event | None = None
    ) -> None:
        for record in self._records(buffers):  # each sent once sealed: one record's copy held at a time
            send_buffers(self.sock, record, stopping=stopping)

    def wire(self, buffers: Sequence[bytes | bytearray | memoryview]) -> list[bytes | bytearray | memoryview]:
        return [part for record in self._records(buffers) for part in record]

    def _records(self, buffers: Sequence[bytes | bytearray | memoryview]) -> Iterator[list[bytes]]:
        """``buffers`` as sealed records (a length prefix and the ciphertext), each sealed as it is asked for."""
        data = b"".join(memoryview(buffer).cast("B") for buffer in buffers)
        for start in range(0, len(data), RECORD_BYTES):
            plain = data[start : start + RECORD_BYTES]
            prefix = _LENGTH.pack(len(plain) + TAG_BYTES)
            sealed = self._sealer.encrypt(self._nonce(self._send_counter), plain, prefix)
            self._send_counter += 1
            yield [prefix, sealed]

    def recv_into(self, view: memoryview, *, stopping: threading.Event | None = None) -> int:
        """Fill ``view`` with opened plaintext; fewer bytes only when the peer closed (or ``stopping`` was set)."""
        filled = 0
        while filled < len(view):
            if not self._plain:
                try:
                    more = self._next_record(stopping)
                except ReadTimeout as exc:  # ``received`` counts this view's bytes, as a plain read's does
                    raise ReadTimeout(filled + exc.received, len(view)) from None
                if not more:
                    return filled
            count = min(len(self._plain), len(view) - filled)
            view[filled : filled + count] = self._plain[:count]
            self._plain = self._plain[count:]
            filled += count
        return filled

    def _next_record(self, stopping: threading.Event | None) -> bool:
        if recv_exact(self.sock, memoryview(self._length), stopping=stopping) < _LENGTH.size:
            return False
        (length,) = _LENGTH.unpack(self._length)
        if not TAG_BYTES < length <= RECORD_BYTES + TAG_BYTES:
            raise IntegrityError(
                f"sealed record from {self.peer} announces {length} bytes; expected 17..{RECORD_BYTES + TAG_BYTES} "
                "(the stream was tampered with, or the peer does not encrypt)"
            )
        sealed = bytearray(length)
        if recv_exact(self.sock, memoryview(sealed), stopping=stopping) < length:
            return False
        try:
            plain = self._opener.decrypt(self._nonce(self._recv_counter), memoryview(sealed), bytes(self._length))
        except InvalidTag:
            raise IntegrityError(
                f"sealed record #{self._recv_counter} from {self.peer} failed authentication: the data was "
                "modified, replayed or reordered in transit (or the peer uses another job secret)"
            ) from None
        self._recv_counter += 1
        self._plain = memoryview(plain)
        return True


def open_channel(
    sock: socket.socket, secret: bytes, proof: bytes, *, encrypt: bool, is_client: bool, peer: str
) -> Channel:
    """The channel a connection uses after its handshake: sealed when ``encrypt``, else today's plain bytes."""
    if encrypt:
        return SealedChannel(sock, secret, proof, is_client=is_client, peer=peer)
    return PlainChannel(sock)


def connect_channel(
    address: str,
    rank: int,
    peer: int,
    secret: bytes,
    timeout: float,
    *,
    encrypt: bool,
    peer_name: str = "",
    refused_is_final: bool = False,
) -> Channel:
    """The client's side of :func:`open_channel`: connect and authenticate as ``rank`` -> ``peer``, then open.

    Raises :class:`~sparkdl.net.auth.ConnectGaveUp` once ``timeout`` has passed (see
    :func:`~sparkdl.net.auth.connect_with_proof`); the socket keeps the remaining
    connect time as its timeout. ``peer_name`` names the listener in errors (default "rank <peer>");
    ``refused_is_final``: see :func:`~sparkdl.net.auth.connect_with_proof`.
    """
    sock, proof = connect_with_proof(address, rank, peer, secret, timeout, refused_is_final=refused_is_final)
    return open_channel(sock, secret, proof, encrypt=encrypt, is_client=True, peer=peer_name or f"rank {peer}")
