"""Which ranks are linked, and how links open: one authenticated TCP connection per pair of ranks, on first use.

Each pair of ranks shares one connection (a :class:`~sparkdl.collective.transport.link.Link`),
used in both directions; the lower rank connects, the higher one accepts (on a
thread that keeps accepting for the communicator's life, so links can open on
first use: the ring's at connect, a star's or a mesh's when an algorithm needs
them). A rank that closes its links says so first (a CLOSE frame), so that a rank still
waiting for a connection can tell a peer that finished from one that failed.
"""

from __future__ import annotations

import collections
import select
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from sparkdl.collective.transport.link import Link
from sparkdl.net.acceptor import HANDSHAKE_TIMEOUT, MAX_PENDING, HandshakeAcceptor
from sparkdl.net.auth import ConnectGaveUp
from sparkdl.net.errors import CollectiveError, CollectiveTimeout
from sparkdl.net.io import bind_listener, shutdown_and_close
from sparkdl.net.secure import connect_channel, open_channel

#: How often a rank waiting for a peer to connect checks whether its other links were closed (the job failed).
_GONE_CHECK_SECONDS = 0.2


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
        """A linked peer whose end of the link closed with nothing left unread (it died, or failed without a word:
        nobody else will connect now), if any. A peer that closed its communicator is not gone: ranks finish at
        different times while others still open links on first use, and its CLOSE frame stays unread here."""
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

    def sent_by_operation(self) -> collections.Counter[tuple[int, int]]:
        """Payload bytes sent so far over all open links, by (operation code, dtype code) of the frames."""
        total: collections.Counter[tuple[int, int]] = collections.Counter()
        for link in list(self._links.values()):
            total.update(dict(link.sent_by_operation))  # a copy: a sender thread may add a key
        return total

    def close(self, reason: str | None = None) -> None:
        """Closes every link, telling each peer why this rank gives up (``reason``), or else that it closed its
        communicator; stops accepting."""
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
