"""The hardened accept loop every sparkdl listener shares: handshakes on a selector, bounded and evicting.

No thread waits on an unauthenticated connection: :class:`HandshakeAcceptor`
advances every pending handshake from one selector, drops each after a short
deadline, and when its pending slots are full a new connection evicts the
oldest pending one (so idle connections that re-take freed slots cannot lock a
real peer out).  ``accept()`` errors such as EMFILE are survived: the oldest
pending connection is dropped to free a descriptor and accepting pauses briefly.
:class:`ServingListener` runs an acceptor on a thread and hands each
authenticated connection, as a plain or sealed channel, to a handler on one of a bounded number of threads.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from sparkdl.net import auth
from sparkdl.net.io import bind_listener, shutdown_and_close, tune
from sparkdl.net.secure import Channel, open_channel

_log = logging.getLogger(__name__)

#: Seconds a new connection has to authenticate (a real peer needs milliseconds).
HANDSHAKE_TIMEOUT = 5.0
#: Connections still authenticating per listener; one more evicts the oldest.
MAX_PENDING = 64
#: Longest pause of accepting after an ``accept()`` error such as EMFILE.
MAX_ACCEPT_BACKOFF = 1.0


#: (blocking tuned socket, client rank, the server proof still to send) of a client that proved the secret.
Authenticated = tuple[socket.socket, int, bytes]


@dataclass
class _Pending:
    """Server-side state of one not yet authenticated connection."""

    nonce: bytes
    deadline: float
    received: bytearray = field(default_factory=bytearray)


class HandshakeAcceptor:
    """Accepts and authenticates connections on ``sock`` (a listening socket) in the calling thread.

    A client must authenticate as a rank in ``client_ranks`` towards
    ``server_rank``; :meth:`poll` returns the connections that did.  Everything else is dropped and counted in
    ``refused`` (``last_refusal`` says why).
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
        self.refused = 0
        self.last_refusal = ""
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order: oldest first
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
        for conn in [c for c, state in self._pending.items() if now >= state.deadline]:
            self._drop(conn, f"no authentication within {self.handshake_timeout}s")
        if not self._accepting and now >= self._resume_at:
            self._selector.register(self._sock, selectors.EVENT_READ)
            self._accepting = True
        wake = now + max(0.0, timeout)
        if self._pending:
            wake = min(wake, next(iter(self._pending.values())).deadline)
        if not self._accepting:
            wake = min(wake, self._resume_at)
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
        return authenticated

    def close(self) -> None:
        """Drop every pending connection and release the selector (the listening socket stays the caller's)."""
        for conn in list(self._pending):
            self._selector.unregister(conn)
            conn.close()
        self._pending.clear()
        self._selector.close()
        self._waker_r.close()
        self._waker_w.close()

    def _accept_all(self) -> None:
        """Accept what is queued, at most ``max_pending`` per round, so a flood cannot starve the handshakes."""
        for _ in range(self.max_pending):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: pause, never give up
                self._backoff = min(MAX_ACCEPT_BACKOFF, max(0.01, 2 * self._backoff))
                _log.warning(
                    "%s: accept() failed (%s); pausing %.2fs and dropping the oldest pending connection",
                    self.name,
                    exc,
                    self._backoff,
                )
                if self._pending:
                    self._drop(next(iter(self._pending)), "evicted to free a file descriptor")
                self._selector.unregister(self._sock)
                self._accepting = False
                self._resume_at = time.monotonic() + self._backoff
                return
            self._backoff = 0.0
            self._start(conn)

    def _start(self, conn: socket.socket) -> None:
        if len(self._pending) >= self.max_pending:
            self._drop(next(iter(self._pending)), f"evicted: more than {self.max_pending} pending connections")
        conn.setblocking(False)
        nonce, hello = auth.server_hello()
        try:
            if conn.send(hello) != len(hello):  # 36 bytes always fit a fresh connection's send buffer
                raise OSError("short write of the server hello")
        except OSError:
            conn.close()
            return
        self._pending[conn] = _Pending(nonce, time.monotonic() + self.handshake_timeout)
        self._selector.register(conn, selectors.EVENT_READ)

    def _advance(self, conn: socket.socket) -> Authenticated | None:
        state = self._pending[conn]
        try:
            data = conn.recv(auth.CLIENT_HELLO.size - len(state.received))
        except BlockingIOError:
            return None
        except OSError as exc:
            self._drop(conn, f"connection error during authentication: {exc}")
            return None
        if not data:
            self._drop(conn, "closed during authentication")
            return None
        state.received += data
        if len(state.received) < auth.CLIENT_HELLO.size:
            return None
        verified = auth.verify_client_hello(self._secret, state.nonce, bytes(state.received), self._server_rank)
        if verified is None:
            self._drop(conn, "bad authentication code (wrong secret or garbage)")
            return None
        client_rank, client_nonce = verified
        if client_rank not in self._client_ranks:
            self._drop(conn, f"authenticated as rank {client_rank}, which this listener does not serve")
            return None
        self._selector.unregister(conn)
        del self._pending[conn]
        try:
            conn.setblocking(True)
            tune(conn)
        except OSError as exc:
            conn.close()
            self.refuse(f"rank {client_rank} vanished while authenticating: {exc}")
            return None
        return conn, client_rank, auth.server_proof(self._secret, client_nonce, state.nonce, self._server_rank)

    def _drop(self, conn: socket.socket, reason: str) -> None:
        self._selector.unregister(conn)
        del self._pending[conn]
        conn.close()
        self.refuse(reason)

    def refuse(self, reason: str) -> None:
        self.refused += 1
        self.last_refusal = reason
        _log.warning("%s: refused a connection: %s", self.name, reason)


class ServingListener:
    """A listener on exactly ``host`` whose authenticated connections each run ``handler(channel, rank)`` on a thread.

    The handler gets the connection as a :class:`~sparkdl.net.secure.Channel`, sealed when
    ``encrypt`` (see :mod:`sparkdl.net.secure`), else plain.  At most ``max_connections``
    handlers run at once; an authenticated connection beyond that is closed (and logged).
    The handler owns its channel while it runs; :meth:`close` shuts every socket down so
    blocked handlers wake, and joins the threads.
    """

    def __init__(
        self,
        host: str,
        secret: bytes,
        server_rank: int,
        client_ranks: Container[int],
        handler: Callable[[Channel, int], None],
        *,
        name: str,
        encrypt: bool = False,
        max_connections: int,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending: int = MAX_PENDING,
        backlog: int = 128,
        reuse_address: bool = False,
    ):
        self._sock, self.address = bind_listener(host, backlog=backlog, reuse_address=reuse_address)
        self.name = f"{name} ({self.address})"
        try:
            self._acceptor = HandshakeAcceptor(
                self._sock,
                self.name,
                secret,
                server_rank,
                client_ranks,
                handshake_timeout=handshake_timeout,
                max_pending=max_pending,
            )
        except BaseException:
            self._sock.close()
            raise
        self._handler = handler
        self._secret = secret
        self._encrypt = encrypt
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-accept", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections dropped before or right after authenticating."""
        return self._acceptor.refused

    def threads(self) -> list[threading.Thread]:
        """The accept thread and the running handler threads."""
        with self._lock:
            return [self._thread, *self._connections.values()]

    def wait_idle(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until no authenticated connection is open; True if none is."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._connections, timeout=timeout)

    def close(self, join_timeout: float = 10.0) -> None:
        """Stop accepting, drop pending handshakes, shut down every connection and join the threads; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._acceptor.wake()
        self._thread.join(join_timeout)
        with self._lock:
            connections = dict(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the handler blocked on it
            except OSError:
                pass
        for thread in connections.values():
            thread.join(join_timeout)
            if thread.is_alive():
                _log.warning("%s: %s did not stop within %ss", self.name, thread.name, join_timeout)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    ready = self._acceptor.poll(1.0)
                except Exception:  # never end the accept loop
                    _log.exception("%s: unexpected error in the accept loop", self.name)
                    self._stopping.wait(0.1)
                    continue
                for conn, rank, proof in ready:
                    self._serve(conn, rank, proof)
        finally:
            self._acceptor.close()
            self._sock.close()

    def _serve(self, conn: socket.socket, rank: int, proof: bytes) -> None:
        """Take the connection in (counted by :meth:`wait_idle` from now on), then complete its handshake."""
        with self._lock:
            if self._stopping.is_set() or len(self._connections) >= self._max_connections:
                full = not self._stopping.is_set()
                thread = None
            else:
                thread = threading.Thread(
                    target=self._handle, args=(conn, rank, proof), name=f"{self.name}-rank{rank}", daemon=True
                )
                self._connections[conn] = thread
        if thread is None:
            if full:
                self._acceptor.refuse(f"rank {rank}: already {self._max_connections} open connections")
            shutdown_and_close(conn)
            return
        thread.start()

    def _handle(self, conn: socket.socket, rank: int, proof: bytes) -> None:
        try:
            try:
                conn.sendall(proof)
            except OSError as exc:
                _log.info("%s: rank %d vanished after authenticating: %s", self.name, rank, exc)
                return
            channel = open_channel(
                conn, self._secret, proof, encrypt=self._encrypt, is_client=False, peer=f"rank {rank}"
            )
            self._handler(channel, rank)
        except Exception:  # never let one connection take the listener down
            _log.exception("%s: unexpected error serving rank %d", self.name, rank)
        finally:
            shutdown_and_close(conn)
            with self._idle:
                self._connections.pop(conn, None)
                self._idle.notify_all()
