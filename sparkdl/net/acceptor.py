"""Why no unauthenticated connection can lock a real peer out: handshakes on one selector, bounded and evicting.

No thread waits on an unauthenticated connection: :class:`HandshakeAcceptor`
advances every pending handshake from one selector and drops each after a
short deadline.  When its pending slots are full, a new connection from an
address holding fewer slots than another evicts the oldest pending one of the
address that holds the most: a flood from one host never evicts a slow peer's
connection from another host.  A new connection from the address holding the
most waits in line, not greeted yet, until one of that address's connections
has been idle for :data:`CROWDED_HANDSHAKE_TIMEOUT` and is evicted for it: so
a real peer sharing a flood's address (on one host, all do) is greeted in its
turn and has that long to say hello, where evicting the oldest on every
arrival let the flood's reconnections evict it within milliseconds.  A connection
dropped before its hello was read is closed with a reset, so that the client
can tell it from a refused secret (:mod:`sparkdl.net.auth`).  ``accept()``
errors such as EMFILE are survived: a pending connection is evicted to free a
descriptor and accepting pauses briefly.  Refusals are counted and logged at a
bounded rate (:mod:`sparkdl.net.refusals`).  Every listener runs one: the
ring's (:mod:`sparkdl.collective.transport`) and :mod:`sparkdl.net.listener`'s.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from collections import Counter
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from sparkdl.net import auth
from sparkdl.net.io import close_with_reset, tune
from sparkdl.net.refusals import RefusalLog

_log = logging.getLogger(__name__)

#: Seconds a new connection has to authenticate (a real peer needs milliseconds).
HANDSHAKE_TIMEOUT = 5.0
#: Connections still authenticating per listener; one more evicts the oldest of the address holding the most.
MAX_PENDING = 64
#: Longest pause of accepting after an ``accept()`` error such as EMFILE.
MAX_ACCEPT_BACKOFF = 1.0
#: Seconds a pending connection keeps its slot while connections from its address wait in line for one (a real
#: peer's hello takes milliseconds: the issue's probe sent it 20 ms late).
CROWDED_HANDSHAKE_TIMEOUT = 0.1


#: (blocking tuned socket, client rank, the server proof still to send) of a client that proved the secret.
Authenticated = tuple[socket.socket, int, bytes]


@dataclass
class _Pending:
    """Server-side state of one not yet authenticated connection."""

    nonce: bytes
    greeted: float
    deadline: float
    peer: str  # the client's address (its host, without the port)
    received: bytearray = field(default_factory=bytearray)


@dataclass
class _Waiting:
    """A connection accepted while every slot was taken, not greeted yet: it waits for a slot of its address."""

    peer: str
    accepted: float


class HandshakeAcceptor:
    """Accepts and authenticates connections on ``sock`` (a listening socket) in the calling thread.

    A client must authenticate as a rank in ``client_ranks`` towards
    ``server_rank``; :meth:`poll` returns the connections that did.  Everything else is dropped and counted in
    ``refused`` (``last_refusal`` says why), and logged at a bounded rate.  ``admit(conn)``, if given, sees each
    new connection before it is greeted and returns why it refuses it (say, a Unix socket's peer running as
    another user), or None; a refused connection is closed unheard.  ``sock`` may be a TCP or a Unix listening socket.
    """

    def __init__(
        self,
        sock: socket.socket,
        name: str,
        secret: bytes,
        server_rank: int,
        client_ranks: Container[int],
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending: int = MAX_PENDING,
        admit: Callable[[socket.socket], str | None] = lambda conn: None,
    ):
        if max_pending < 1:
            raise ValueError(f"Expected max_pending >= 1. Received: max_pending={max_pending}")
        if not handshake_timeout > 0:
            raise ValueError(f"Expected handshake_timeout > 0 seconds. Received: handshake_timeout={handshake_timeout}")
        self._sock, self.name = sock, name
        # Who may connect: clients proving the secret as one of client_ranks towards server_rank.
        self._secret, self._server_rank, self._client_ranks = secret, server_rank, client_ranks
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending
        self._evicted = f"evicted: more than {max_pending} pending connections"  # why a slot was taken from one
        self._admit = admit
        self._refusals = RefusalLog(name)
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order: oldest first
        self._pending_per_peer: Counter[str] = Counter()
        self._waiting: dict[socket.socket, _Waiting] = {}  # in line for a slot, first come first
        self._selector = selectors.DefaultSelector()
        self._waker_r, self._waker_w = socket.socketpair()
        self._waker_r.setblocking(False)
        self._waker_w.setblocking(False)
        self._selector.register(self._waker_r, selectors.EVENT_READ)
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        self._accepting = True
        self._resume_at = 0.0
        self._backoff = 0.0

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def refused(self) -> int:
        """Connections dropped before or right after authenticating."""
        return self._refusals.total

    @property
    def last_refusal(self) -> str:
        return self._refusals.last

    def wake(self) -> None:
        """Make a :meth:`poll` blocked in another thread return now."""
        try:
            self._waker_w.send(b"\0")
        except OSError:
            pass

    def poll(self, timeout: float) -> list[Authenticated]:
        """Wait at most ``timeout`` seconds for events; return the clients that proved the secret since.

        Each comes with the server's proof, which the caller sends (``sendall``)
        once it has taken the connection in: the client's handshake completes
        only then.
        """
        now = time.monotonic()
        for conn, state in [(c, state) for c, state in self._pending.items() if now >= state.deadline]:
            self._drop(conn, f"no authentication within {self.handshake_timeout}s", f"from {state.peer}", unread=True)
        for conn, waiting in [(c, w) for c, w in self._waiting.items() if now >= w.accepted + self.handshake_timeout]:
            del self._waiting[conn]
            close_with_reset(conn)
            self.refuse(f"no authentication within {self.handshake_timeout}s", f"from {waiting.peer}, in line")
        self._greet_waiting(now)
        self._refusals.flush(now)
        if not self._accepting and now >= self._resume_at:
            self._selector.register(self._sock, selectors.EVENT_READ)
            self._accepting = True
        wake = min(now + max(0.0, timeout), self._refusals.due())
        if self._pending:
            wake = min(wake, next(iter(self._pending.values())).deadline)
        if not self._accepting:
            wake = min(wake, self._resume_at)
        if self._waiting:
            wake = min(wake, self._slot_frees_at(next(iter(self._waiting.values())).peer))
        authenticated = []
        accept = False
        for key, _ in self._selector.select(max(0.0, wake - now)):
            if key.fileobj is self._waker_r:
                try:
                    self._waker_r.recv(4096)
                except OSError:
                    pass
            elif key.fileobj is self._sock:
                accept = True
            elif key.fileobj in self._pending:
                result = self._advance(key.fileobj)
                if result is not None:
                    authenticated.append(result)
        if accept:  # after the hellos that arrived: a burst of new connections must not evict those first
            self._accept_all()
        self._greet_waiting(time.monotonic())
        return authenticated

    def close(self) -> None:
        """Drop every pending connection and release the selector (the listening socket stays the caller's)."""
        for conn in list(self._pending):
            self._selector.unregister(conn)
            close_with_reset(conn)
        for conn in self._waiting:
            close_with_reset(conn)
        self._waiting.clear()
        self._pending.clear()
        self._pending_per_peer.clear()
        self._refusals.flush(time.monotonic(), final=True)
        self._selector.close()
        self._waker_r.close()
        self._waker_w.close()

    def _accept_all(self) -> None:
        """Accept what is queued, at most ``max_pending`` per round, so a flood cannot starve the handshakes."""
        for _ in range(self.max_pending):
            try:
                conn, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: pause, never give up
                self._backoff = min(MAX_ACCEPT_BACKOFF, max(0.01, 2 * self._backoff))
                if self._pending:
                    self._evict(f"evicted to free a file descriptor (accept() failed: {exc})")
                else:
                    _log.warning("%s: accept() failed (%s); pausing %.2fs", self.name, exc, self._backoff)
                self._selector.unregister(self._sock)
                self._accepting = False
                self._resume_at = time.monotonic() + self._backoff
                return
            self._backoff = 0.0
            peer = address[0] if isinstance(address, tuple) else "this host"  # a Unix socket's peer has no address
            refusal = self._admit(conn)
            if refusal is not None:
                conn.close()
                self.refuse(refusal, f"from {peer}")
                continue
            self._start(conn, peer)

    def _start(self, conn: socket.socket, peer: str) -> None:
        if len(self._pending) >= self.max_pending:
            if self._holds_the_most(peer):  # in line for a slot of its address (module doc)
                if len(self._waiting) >= self.max_pending:
                    close_with_reset(conn)
                    self.refuse(f"dropped: {self.max_pending} connections pending and as many in line", f"from {peer}")
                else:
                    self._waiting[conn] = _Waiting(peer, time.monotonic())
                return
            self._evict(self._evicted)
        self._greet(conn, peer)

    def _holds_the_most(self, peer: str) -> bool:
        return self._pending_per_peer[peer] >= max(self._pending_per_peer.values(), default=0)

    def _greet(self, conn: socket.socket, peer: str) -> None:
        conn.setblocking(False)
        nonce, hello = auth.server_hello()
        try:
            if conn.send(hello) != len(hello):  # 36 bytes always fit a fresh connection's send buffer
                raise OSError("short write of the server hello")
        except OSError:
            conn.close()
            return
        now = time.monotonic()  # deadlines in greeting order: the oldest is due first
        self._pending[conn] = _Pending(nonce, now, now + self.handshake_timeout, peer)
        self._pending_per_peer[peer] += 1
        self._selector.register(conn, selectors.EVENT_READ)

    def _slot_frees_at(self, peer: str) -> float:
        """When a connection in line from ``peer`` gets a slot: now where one is free or ``peer`` holds fewer than
        another address, else once ``peer``'s oldest pending connection has been idle its crowded time."""
        if len(self._pending) < self.max_pending or not self._holds_the_most(peer):
            return 0.0
        oldest = next(state for state in self._pending.values() if state.peer == peer)
        return oldest.greeted + CROWDED_HANDSHAKE_TIMEOUT

    def _greet_waiting(self, now: float) -> None:
        """Greets the connections in line, first come first, as slots free (evicting for them as the module says)."""
        while self._waiting:
            conn, waiting = next(iter(self._waiting.items()))
            if self._slot_frees_at(waiting.peer) > now:
                return
            if len(self._pending) >= self.max_pending:
                if self._holds_the_most(waiting.peer):
                    oldest = next(c for c, state in self._pending.items() if state.peer == waiting.peer)
                    detail = f"idle {CROWDED_HANDSHAKE_TIMEOUT}s while connections from {waiting.peer} wait"
                    self._drop(oldest, self._evicted, detail, unread=True)
                else:
                    self._evict(self._evicted)
            del self._waiting[conn]
            self._greet(conn, waiting.peer)

    def _evict(self, reason: str) -> None:
        """Drops the oldest pending connection of the peer address holding the most pending slots (ties: the oldest
        overall): one flooding host then only evicts its own connections, never a slow peer's from elsewhere."""
        most = max(self._pending_per_peer.values())
        conn, state = next(
            (c, state) for c, state in self._pending.items() if self._pending_per_peer[state.peer] == most
        )
        self._drop(conn, reason, f"the oldest of {most} pending from {state.peer}", unread=True)

    def _advance(self, conn: socket.socket) -> Authenticated | None:
        state = self._pending[conn]
        try:
            data = conn.recv(auth.CLIENT_HELLO.size - len(state.received))
        except BlockingIOError:
            return None
        except OSError as exc:
            self._drop(conn, "connection error during authentication", f"from {state.peer}: {exc}")
            return None
        if not data:
            self._drop(conn, "closed during authentication", f"from {state.peer}")
            return None
        state.received += data
        if len(state.received) < auth.CLIENT_HELLO.size:
            return None
        verified = auth.verify_client_hello(self._secret, state.nonce, bytes(state.received), self._server_rank)
        if verified is None:
            self._drop(conn, "bad authentication code (wrong secret or garbage)", f"from {state.peer}")
            return None
        client_rank, client_nonce = verified
        if client_rank not in self._client_ranks:
            self._drop(
                conn, "authenticated as a rank this listener does not serve", f"rank {client_rank} from {state.peer}"
            )
            return None
        self._forget(conn)
        try:
            conn.setblocking(True)
            tune(conn)
        except OSError as exc:
            conn.close()
            self.refuse("vanished while authenticating", f"rank {client_rank} from {state.peer}: {exc}")
            return None
        return conn, client_rank, auth.server_proof(self._secret, client_nonce, state.nonce, self._server_rank)

    def _forget(self, conn: socket.socket) -> None:
        """Takes ``conn`` out of the pending handshakes."""
        self._selector.unregister(conn)
        peer = self._pending.pop(conn).peer
        self._pending_per_peer[peer] -= 1
        if not self._pending_per_peer[peer]:
            del self._pending_per_peer[peer]

    def _drop(self, conn: socket.socket, reason: str, detail: str, *, unread: bool = False) -> None:
        """Closes a pending connection; ``unread``: with a reset, as its hello was not read (see the module doc)."""
        self._forget(conn)
        if unread:
            close_with_reset(conn)
        else:
            conn.close()
        self.refuse(reason, detail)

    def refuse(self, reason: str, detail: str = "") -> None:
        """Counts (and logs, at a bounded rate) a refused connection; summaries count by ``reason``."""
        self._refusals.refuse(reason, detail)
