"""Authenticated TCP links from one rank to any other: framed arrays, matched by operation or by tag.

Each pair of ranks shares one connection, used in both directions; the
lower rank connects, the higher one accepts (on a thread that keeps
accepting for the communicator's life, so links can open on first use: the
ring's at connect, a star's or a mesh's when an algorithm needs them). Sends
run on one thread per link, so a rank sends and receives at once and cannot
deadlock on full socket buffers. Receives run in the caller's thread, straight
into the caller's array when the frame is the one expected; a frame for
another operation of another group, or a message with another tag, is kept
until asked for. Within one group a frame for another collective means the
ranks are out of step, and is reported as such. Nothing received is ever
deserialised: a frame is :mod:`sparkdl.net.frames`' header and raw bytes.
"""

from __future__ import annotations

import collections
import select
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from sparkdl.collective.api import operation_name
from sparkdl.net.acceptor import HANDSHAKE_TIMEOUT, MAX_PENDING, HandshakeAcceptor
from sparkdl.net.auth import ConnectGaveUp
from sparkdl.net.errors import CollectiveError, CollectiveTimeout
from sparkdl.net.frames import HEADER, FrameError, Header, Kind, dtype_code, dtype_name
from sparkdl.net.io import bind_listener, shutdown_and_close
from sparkdl.net.secure import Channel, connect_channel, open_channel

#: Longest reason an ABORT frame may carry.
MAX_ABORT_BYTES = 2048
#: How often a rank waiting for a peer to connect checks whether its other links were closed (the job failed).
_GONE_CHECK_SECONDS = 0.2
#: Most bytes of frames received ahead of being asked for, per link, before the peer is refused.
MAX_KEPT_BYTES = 4 << 30


class Listener:
    """The listening socket of one rank, on an ephemeral port of exactly ``host``.

    Created before addresses are exchanged, so each rank's address is known (and
    connectable) before anyone connects. ``handshake_timeout`` and
    ``max_pending`` bound each unauthenticated connection (:mod:`sparkdl.net.acceptor`).
    """

    def __init__(
        self, host: str = "127.0.0.1", *, handshake_timeout: float = HANDSHAKE_TIMEOUT, max_pending: int = MAX_PENDING
    ):
        self.sock, self.address = bind_listener(host)
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _bytes_of(array: np.ndarray) -> memoryview:
    return array.reshape(-1).view(np.uint8).data


class Link:
    """One authenticated connection to ``peer``, and the frames received from it ahead of their time."""

    def __init__(self, channel: Channel, rank: int, peer: int, timeout: float):
        channel.sock.settimeout(timeout)
        self.channel, self.rank, self.peer, self.timeout = channel, rank, peer, timeout
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sparkdl-rank{rank}-to{peer}")
        self._send_lock = threading.Lock()  # whole frames only: the sender thread and an abort alike
        self._header = bytearray(HEADER.size)
        self.kept: dict[tuple, collections.deque[tuple[Header, bytearray]]] = collections.defaultdict(collections.deque)
        self._kept_bytes = 0
        self._state = threading.Condition()  # guards ``kept`` and ``_reading``
        self._reading = False  # a thread is reading the socket
        self.bytes_sent = self.bytes_received = 0  # payload bytes, for benchmarks and tests of the algorithms

    def send(self, header: Header, payload: memoryview | bytes) -> Future:
        """Queues one frame; the future fails with a CollectiveError."""
        return self._sender.submit(self._send_now, header, payload)

    def _send_now(self, header: Header, payload: memoryview | bytes) -> None:
        try:
            with self._send_lock:
                self.channel.send([header.pack(), payload])
                self.bytes_sent += header.nbytes
        except OSError as exc:
            raise self._error(header.op, "send to", exc) from exc

    def abort(self, reason: str) -> None:
        """Tells the peer, if the link is free within a moment, why this rank gives up; then closes."""
        if self._send_lock.acquire(timeout=0.5):
            try:
                self.channel.sock.settimeout(1.0)
                message = reason.encode()[:MAX_ABORT_BYTES]
                self.channel.send([Header(Kind.ABORT, 0, len(message)).pack(), message])
            except OSError:
                pass
            finally:
                self._send_lock.release()
        self.close()

    def close(self) -> None:
        shutdown_and_close(self.channel.sock)
        self._sender.shutdown(wait=False, cancel_futures=True)

    def receive(self, key: tuple, op: int, out: np.ndarray | None, dtype: np.dtype | None) -> tuple[Header, np.ndarray]:
        """The next frame of ``key`` ((kind, group, seq or tag)), its payload in ``out`` if given, else a new array.

        Several threads may receive at once (the streams of a communicator and of its subgroups share the link):
        one of them reads the socket, a frame at a time, keeping the frames of the others and waking them; the
        others wait for theirs to be kept, or for their turn to read.
        """
        data = None
        with self._state:
            while True:
                kept = self.kept.get(key)
                if kept:
                    header, data = kept.popleft()
                    self._kept_bytes -= len(data)
                    self.bytes_received += len(data)
                    break
                if not self._reading:
                    self._reading = True
                    break
                self._state.wait()
        if data is None:
            try:
                return self._read_until(key, op, out, dtype)
            finally:
                with self._state:
                    self._reading = False
                    self._state.notify_all()
        self._check(header, op, out, dtype)
        received = np.frombuffer(data, dtype=_payload_dtype(header, out, dtype))
        if out is None:
            return header, received
        _bytes_of(out)[:] = data
        return header, out

    def _read_until(
        self, key: tuple, op: int, out: np.ndarray | None, dtype: np.dtype | None
    ) -> tuple[Header, np.ndarray]:
        """Reads frames (this thread alone) until the one of ``key``, keeping the others for their receivers."""
        while True:
            header = self._read_header(op)
            frame_key = (header.kind, header.group, header.tag if header.kind == Kind.MESSAGE else header.seq)
            if frame_key == key:
                self._check(header, op, out, dtype)
                if out is None:
                    out = np.empty(
                        header.nbytes // _payload_dtype(header, out, dtype).itemsize, _payload_dtype(header, out, dtype)
                    )
                self._read_exact(_bytes_of(out), op)
                self.bytes_received += header.nbytes
                return header, out
            if header.kind == Kind.COLLECTIVE and key[0] == Kind.COLLECTIVE and header.group == key[1]:
                raise CollectiveError(
                    f"rank {self.rank}: out of step with rank {self.peer}: expected {operation_name(op)} "
                    f"#{key[2]}, received {operation_name(header.op)} #{header.seq}; all ranks must call the "
                    "same collectives in the same order with the same shapes and dtypes"
                )
            self._keep(frame_key, header, op)

    def _keep(self, key: tuple, header: Header, op: int) -> None:
        if self._kept_bytes + header.nbytes > MAX_KEPT_BYTES:
            raise CollectiveError(
                f"rank {self.rank}: rank {self.peer} sent more than {MAX_KEPT_BYTES} bytes ahead of their "
                f"receives while this rank waits in {operation_name(op)}; check the order of sends and receives"
            )
        data = bytearray(header.nbytes)
        self._read_exact(memoryview(data), op)
        with self._state:
            self._kept_bytes += len(data)
            self.kept[key].append((header, data))
            self._state.notify_all()

    def _check(self, header: Header, op: int, out: np.ndarray | None, dtype: np.dtype | None) -> None:
        expected = out.dtype if out is not None else dtype
        wrong = header.op != op
        if expected is not None and header.dtype != dtype_code(expected):
            wrong = True
        if out is not None and header.nbytes != out.nbytes:
            wrong = True
        if out is None and expected is not None and header.nbytes % expected.itemsize:
            wrong = True
        if wrong:
            want = f"{operation_name(op)} of {expected}" + (f" ({out.nbytes} bytes)" if out is not None else "")
            raise CollectiveError(
                f"rank {self.rank}: out of step with rank {self.peer}: expected {want}, received "
                f"{operation_name(header.op)} of {dtype_name(header.dtype)} ({header.nbytes} bytes); all ranks "
                "must call the same operations in the same order with the same shapes and dtypes"
            )

    def _read_header(self, op: int) -> Header:
        self._read_exact(memoryview(self._header), op)
        try:
            header = Header.unpack(self._header, source=f"rank {self.peer}")
        except FrameError as exc:
            raise CollectiveError(f"rank {self.rank}: {operation_name(op)}: {exc}") from None
        if header.kind == Kind.ABORT:
            reason = bytearray(min(header.nbytes, MAX_ABORT_BYTES))
            self._read_exact(memoryview(reason), op)
            raise CollectiveError(
                f"rank {self.rank}: {operation_name(op)} failed: rank {self.peer} gave up: "
                f"{reason.decode(errors='replace')}"
            )
        return header

    def _read_exact(self, view: memoryview, op: int) -> None:
        try:
            received = self.channel.recv_into(view)
        except OSError as exc:
            raise self._error(op, "receive from", exc) from exc
        if received < len(view):
            raise CollectiveError(
                f"rank {self.rank}: rank {self.peer} closed the connection during {operation_name(op)}; "
                "check whether that rank's process failed or closed its communicator"
            )

    def _error(self, op: int, action: str, exc: OSError) -> CollectiveError:
        if isinstance(exc, TimeoutError):
            return CollectiveTimeout(
                f"rank {self.rank}: {operation_name(op)} timed out after {self.timeout}s waiting to {action} "
                f"rank {self.peer}; check that rank {self.peer} is alive and makes the same calls, or raise the timeout"
            )
        return CollectiveError(
            f"rank {self.rank}: {operation_name(op)} failed to {action} rank {self.peer}: {exc}; "
            "check whether that rank's process failed"
        )


def _payload_dtype(header: Header, out: np.ndarray | None, dtype: np.dtype | None) -> np.dtype:
    if out is not None:
        return out.dtype
    return dtype if dtype is not None else np.dtype(np.uint8)


class Links:
    """This rank's links to the other ``len(addresses) - 1`` ranks of the job, opened on demand."""

    def __init__(
        self, rank: int, addresses: Sequence[str], listener: Listener, secret: bytes, timeout: float, *, encrypt: bool
    ):
        if not 0 <= rank < len(addresses):
            raise ValueError(f"rank {rank} is outside 0..{len(addresses) - 1}")
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("secret must be non-empty bytes")
        if not timeout > 0:
            raise ValueError("timeout must be positive")
        self.rank, self.addresses, self.timeout = rank, list(addresses), timeout
        self._listener, self._secret, self._encrypt = listener, secret, encrypt
        self._links: dict[int, Link] = {}
        self._opening: dict[int, threading.Lock] = {}
        self._accepted: dict[int, Link] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._acceptor = HandshakeAcceptor(
            listener.sock,
            f"rank {rank}'s listener {listener.address}",
            secret,
            rank,
            frozenset(range(rank)),  # lower ranks connect to this one
            handshake_timeout=min(timeout, listener.handshake_timeout),
            max_pending=listener.max_pending,
        )
        self._accepting = threading.Thread(target=self._accept, name=f"sparkdl-rank{rank}-accept", daemon=True)
        self._accepting.start()

    def link(self, peer: int) -> Link:
        """The link to ``peer``, opening it if this is its first use (the peer opens its end then too)."""
        existing = self._links.get(peer)
        if existing is not None:
            return existing
        if peer == self.rank or not 0 <= peer < len(self.addresses):
            raise ValueError(f"rank {self.rank} has no link to rank {peer}")
        with self._changed:  # one opening per peer, though a subgroup's operation may ask for it at the same time
            opening = self._opening.setdefault(peer, threading.Lock())
        with opening:
            existing = self._links.get(peer)
            if existing is not None:
                return existing
            link = self._connect(peer) if self.rank < peer else self._await(peer)
            self._links[peer] = link
            return link

    def open(self, peers: Sequence[int]) -> None:
        """Opens several links at once (the ring's at connect): accepting and connecting concurrently."""
        waiting = [peer for peer in peers if peer > self.rank]
        with ThreadPoolExecutor(max_workers=max(1, len(waiting)), thread_name_prefix="sparkdl-connect") as pool:
            futures = {peer: pool.submit(self.link, peer) for peer in waiting}
            for peer in peers:
                if peer < self.rank:
                    self.link(peer)
            for future in futures.values():
                future.result()

    def _connect(self, peer: int) -> Link:
        try:
            channel = connect_channel(
                self.addresses[peer],
                self.rank,
                peer,
                self._secret,
                self.timeout,
                encrypt=self._encrypt,
                refused_is_final=True,  # every listener listens before its address is published
            )
        except ConnectGaveUp as exc:
            if exc.refused:
                raise CollectiveError(
                    f"rank {self.rank}: rank {peer}'s listener at {self.addresses[peer]} refused the connection: "
                    f"rank {peer} has failed or closed its communicator"
                ) from None
            raise CollectiveTimeout(
                f"rank {self.rank}: could not connect to rank {peer} at {self.addresses[peer]} within "
                f"{self.timeout}s (last error: {exc.last_error}); check that rank {peer} is running, that its "
                "address is reachable from this host, and that all ranks use the same job secret"
            ) from None
        return Link(channel, self.rank, peer, self.timeout)

    def _await(self, peer: int) -> Link:
        deadline = time.monotonic() + self.timeout
        with self._changed:
            while peer not in self._accepted:
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    refused = self._acceptor.refused
                    raise CollectiveTimeout(
                        f"rank {self.rank}: no authenticated connection from rank {peer} on "
                        f"{self._listener.address} within {self.timeout}s (refused {refused} other "
                        f"connection(s){'; last: ' + self._acceptor.last_refusal if refused else ''}); check that "
                        f"rank {peer} is running, can reach this address, and uses the same job secret"
                    )
                self._changed.wait(min(remaining, _GONE_CHECK_SECONDS))
                gone = self._a_peer_has_gone()
                if gone is not None:
                    raise CollectiveError(
                        f"rank {self.rank}: while waiting for rank {peer} to connect, rank {gone} closed its "
                        "link: the job has failed (see that rank's error)"
                    )
            return self._accepted.pop(peer)

    def _a_peer_has_gone(self) -> int | None:
        """A linked peer whose end of the link is closed (it failed: nobody else will connect now), if any."""
        for peer, link in list(self._links.items()):
            sock = link.channel.sock
            try:
                readable, _, _ = select.select([sock], [], [], 0)
                # Only peek once readable: the socket has a timeout, so a peek with nothing to read would wait for it.
                if readable and sock.recv(1, socket.MSG_PEEK) == b"":
                    return peer
            except (OSError, ValueError):
                return peer
        return None

    def _accept(self) -> None:
        while not self._closed:
            try:
                ready = self._acceptor.poll(1.0)
            except OSError:
                return  # the listener was closed
            for conn, peer, proof in ready:
                if peer in self._accepted or peer in self._links:
                    shutdown_and_close(conn)  # a duplicate of a link already made
                    continue
                try:
                    conn.settimeout(self.timeout)
                    conn.sendall(proof)
                except OSError as exc:
                    conn.close()
                    self._acceptor.refuse(f"rank {peer} vanished after authenticating: {exc}")
                    continue
                channel = open_channel(
                    conn, self._secret, proof, encrypt=self._encrypt, is_client=False, peer=f"rank {peer}"
                )
                with self._changed:
                    self._accepted[peer] = Link(channel, self.rank, peer, self.timeout)
                    self._changed.notify_all()

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Payload bytes (sent, received) so far on each open link, by peer rank."""
        return {peer: (link.bytes_sent, link.bytes_received) for peer, link in self._links.items()}

    def close(self, reason: str | None = None) -> None:
        """Closes every link (telling each peer ``reason`` first, if given) and stops accepting."""
        if self._closed:
            return
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._acceptor.wake()
        self._accepting.join(timeout=5)
        self._acceptor.close()
        links = [*self._links.values(), *self._accepted.values()]
        for link in links:
            if reason is not None:
                link.abort(reason)
            else:
                link.close()
        self._listener.close()
