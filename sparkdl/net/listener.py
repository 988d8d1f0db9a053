"""The listener the parameter server's shards and the driver's relay share: authenticated connections on threads.

:class:`ServingListener` runs a :class:`~sparkdl.net.acceptor.HandshakeAcceptor`
(handshakes on a selector, bounded and evicting) on a thread of its own, and
hands each authenticated connection, as a plain or sealed channel, to a handler
on one of a bounded number of threads.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Container

from sparkdl.net.acceptor import HANDSHAKE_TIMEOUT, MAX_PENDING, HandshakeAcceptor
from sparkdl.net.io import bind_listener, shutdown_and_close
from sparkdl.net.secure import Channel, open_channel

_log = logging.getLogger(__name__)


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
                self._acceptor.refuse(f"already {self._max_connections} open connections", f"rank {rank}")
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
