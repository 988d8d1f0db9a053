"""How the ranks of one host come to share memory safely, and wait on each other: memfds, a handshake, doorbells.

Local rank 0 creates two memfds (mode 0600, pages reserved up front, so a full
host fails at setup rather than with SIGBUS mid-step): the control segment, one
64-byte line of int64s per local rank (:data:`SEQ` its progress counter), and
the data segment, which rank 0 may later replace by a bigger one.  Nothing
exists on disk or in /dev/shm; the kernel frees a memfd with its last holder,
even one killed.  Rank 0 listens on an abstract Unix socket named after the
group, or, where another process holds that name, on the first free one of a few
alternatives that only the job secret tells (:func:`listener_names`; the others
try them all, so a squatted name costs no rank its timeout); a connection must come from our uid (``SO_PEERCRED``) and prove the job
secret (:mod:`sparkdl.net.auth`'s HMAC challenge/response, keyed for this
group).  Handshakes run on the acceptor every sparkdl listener runs
(:mod:`sparkdl.net.acceptor`), so idle or forged connections keep no peer out.  Rank 0 then passes every rank the memfds
and one end of a ``socketpair`` per other rank: its doorbells, whose EOF says
that peer is gone (:class:`Progress`).
"""

from __future__ import annotations

import array
import errno
import hashlib
import hmac
import logging
import math
import mmap
import os
import select
import socket
import struct
import time
from dataclasses import dataclass

from sparkdl.net import auth
from sparkdl.net.acceptor import HANDSHAKE_TIMEOUT, MAX_PENDING, HandshakeAcceptor
from sparkdl.net.errors import CollectiveError, CollectiveTimeout

WORDS = 8  # int64s per control line (64 bytes: one cache line, written by its rank only)
SEQ, STATE, BLAME, KIND = range(4)  # a line's words: counter, state, the local rank it blames, the failure's kind
RUNNING, CLOSED, FAILED = range(3)
DIED, TIMED_OUT, OTHER = range(1, 4)
#: Counter reads before a waiter blocks in poll (tens of microseconds: ranks may outnumber cores).
SPIN = 100
_SETUP, _GROW = struct.Struct("!4sIQQ"), struct.Struct("!4sQ")  # magic, local size, control, data bytes | data bytes
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_RING = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
#: Abstract names a group's listener may take: its own, then alternatives for when another process holds one.
NAMES = 4

_log = logging.getLogger(__name__)


def align(size: int, to: int = mmap.PAGESIZE) -> int:
    return -(-size // to) * to


def describe(ranks: list[int], local: int) -> str:
    return f"rank {ranks[local]} (same host, shared memory)"


class Segment:
    """One shared memfd, mapped read-write; ``fd`` stays open until :meth:`close`."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        try:
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        fd = os.memfd_create(f"sparkdl-{name}", os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            raise CollectiveError(f"could not reserve {size} bytes of shared memory (memfd): {exc}") from None
        return cls(fd, size)

    @classmethod
    def attach(cls, fd: int, size: int) -> Segment:
        stat = os.fstat(fd)
        if stat.st_uid != os.geteuid() or stat.st_mode & 0o077 or stat.st_size < size:
            os.close(fd)
            raise CollectiveError(f"local rank 0 passed a segment that is not ours alone or too small: {stat}")
        return cls(fd, size)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a numpy view survives (in a traceback): unmapped once it is collected
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class Membership:
    """A rank's membership of the group: segments, a doorbell per peer, and its connections for passing segments."""

    control: Segment
    data: Segment
    doorbells: dict[int, socket.socket]
    conns: dict[int, socket.socket]  # rank 0: every other rank's; the others: {0: rank 0's}

    def close(self) -> None:
        for sock in [*self.doorbells.values(), *self.conns.values()]:
            sock.close()
        self.data.close()
        self.control.close()


def group_key(secret: bytes, name: str) -> bytes:
    """The handshake key: the job secret bound to this group, so that no other sparkdl handshake passes here."""
    return hmac.new(secret, b"sparkdl shared memory " + name.encode(), hashlib.sha256).digest()


def listener_names(name: str, key: bytes) -> list[str]:
    """The abstract socket names of the group's listener, in the order rank 0 tries them: ``@sparkdl-<name>``, then
    alternatives drawn from ``key`` (:func:`group_key`), which no one can foresee from the names seen in
    /proc/net/unix."""
    alternatives = [
        hmac.new(key, f"alternative {i}".encode(), hashlib.sha256).hexdigest()[:32] for i in range(1, NAMES)
    ]
    return ["\0sparkdl-" + part for part in [name, *alternatives]]


def setup(local_rank: int, ranks: list[int], name: str, secret: bytes, timeout: float, data_bytes: int) -> Membership:
    """Join the group's segments and doorbells; CollectiveError (CollectiveTimeout past ``timeout``) naming who failed."""
    deadline = time.monotonic() + timeout
    if local_rank == 0:
        return _serve(ranks, name, group_key(secret, name), deadline, timeout, data_bytes)
    return _join(local_rank, ranks, name, group_key(secret, name), deadline, timeout)


def _another_user(sock: socket.socket) -> str | None:
    """Why a Unix socket's peer is refused before any greeting: it runs as another user (None: it does not)."""
    uid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]
    return None if uid == os.geteuid() else f"a process of another user (uid {uid})"


def _serve(ranks: list[int], name: str, key: bytes, deadline: float, timeout: float, data_bytes: int) -> Membership:
    size, joined = len(ranks), dict[int, socket.socket]()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    segments, pairs = list[Segment](), dict[tuple[int, int], tuple[socket.socket, socket.socket]]()
    acceptor = None
    try:
        _bind_free_name(listener, listener_names(name, key))
        listener.listen(MAX_PENDING)
        acceptor = HandshakeAcceptor(
            listener,
            f"{describe(ranks, 0)}'s shared memory listener",
            key,
            0,
            range(1, size),
            handshake_timeout=min(timeout, HANDSHAKE_TIMEOUT),
            admit=_another_user,
        )
        segments += [Segment.create(name, align(size * WORDS * 8)), Segment.create(name, data_bytes)]
        while len(joined) < size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = ", ".join(describe(ranks, k) for k in range(1, size) if k not in joined)
                raise CollectiveTimeout(f"timed out after {timeout}s: {missing} did not join")
            for conn, rank, proof in acceptor.poll(remaining):
                try:
                    if rank in joined:
                        raise OSError("a rank that already joined")
                    conn.sendall(proof)
                except OSError as exc:
                    conn.close()
                    acceptor.refuse("refused after authenticating", f"{describe(ranks, rank)}: {exc}")
                    continue
                joined[rank] = conn
        acceptor.close()
        listener.close()
        pairs = {(i, j): socket.socketpair() for i in range(size) for j in range(i + 1, size)}
        control, data = segments
        for k, conn in joined.items():
            ends = [pairs[min(k, j), max(k, j)][k > j].fileno() for j in range(size) if j != k]
            try:
                conn.setblocking(True)
                conn.settimeout(max(0.001, deadline - time.monotonic()))
                socket.send_fds(
                    conn, [_SETUP.pack(b"SDLS", size, control.size, data.size)], [control.fd, data.fd, *ends]
                )
            except OSError as exc:
                raise CollectiveError(
                    f"{describe(ranks, k)} vanished during setup ({exc}; its process died?)"
                ) from None
        doorbells = {j: pairs.pop((0, j)) for j in range(1, size)}
        for _, theirs in doorbells.values():  # only rank j may hold the other end: its EOF must mean j is gone
            theirs.close()
        return Membership(control, data, {j: pair[0] for j, pair in doorbells.items()}, joined)
    except BaseException:
        for segment in segments:
            segment.close()
        for conn in joined.values():
            conn.close()
        raise
    finally:
        if acceptor is not None:
            acceptor.close()
        listener.close()
        for pair in pairs.values():
            pair[0].close()
            pair[1].close()


def _bind_free_name(listener: socket.socket, names: list[str]) -> None:
    """Binds ``listener`` to the first of ``names`` that no other process holds; CollectiveError if all are held."""
    for path in names:
        try:
            listener.bind(path)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            _log.warning("sparkdl shared memory: @%s is held by another process; trying the next name", path[1:])
            continue
        return
    raise CollectiveError(
        f"cannot listen on @{names[0][1:]} nor on its {len(names) - 1} alternatives: other processes hold every "
        "one (Address already in use)"
    )


class _HeldByAnother(Exception):
    """A name of the group has a listener that is not local rank 0's: another user's, or one that accepts nobody."""


def _join(local_rank: int, ranks: list[int], name: str, key: bytes, deadline: float, timeout: float) -> Membership:
    delay, names = 0.002, listener_names(name, key)
    while True:
        sock, last_error = _connect_any(names, local_rank, ranks, key, deadline)
        if sock is not None:
            break
        if time.monotonic() >= deadline:
            raise CollectiveTimeout(f"timed out after {timeout}s joining {describe(ranks, 0)}: {last_error}")
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(2 * delay, 0.1)
    size, fds, owned = len(ranks), list[int](), list[Segment]()
    try:
        header, fds = _recv_with_fds(sock, _SETUP.size, size + 1, deadline)
        magic, got_size, control_bytes, data_bytes = _SETUP.unpack(header)
        if magic != b"SDLS" or got_size != size or len(fds) != size + 1:
            raise CollectiveError(f"{describe(ranks, 0)} sent a malformed setup message")
        control = Segment.attach(fds.pop(0), control_bytes)
        owned.append(control)
        data = Segment.attach(fds.pop(0), data_bytes)
        owned.append(data)
        doorbells = {j: socket.socket(fileno=fds.pop(0)) for j in range(size) if j != local_rank}
        owned.clear()
        return Membership(control, data, doorbells, {0: sock})
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        for segment in owned:
            segment.close()
        sock.close()
        if isinstance(exc, TimeoutError):
            raise CollectiveTimeout(f"timed out after {timeout}s waiting for {describe(ranks, 0)}'s segments") from None
        if isinstance(exc, OSError):
            raise CollectiveError(f"{describe(ranks, 0)} closed the connection in setup ({exc}; it died?)") from None
        raise


def _connect_any(
    names: list[str], local_rank: int, ranks: list[int], key: bytes, deadline: float
) -> tuple[socket.socket | None, str]:
    """(An authenticated connection to rank 0's listener, tried at each of ``names``; or None and why not yet).
    CollectiveError at once when other processes listen on every name: rank 0 can listen on none."""
    held, last_error = 0, "no attempt made"
    for path in names:
        try:
            return _connect(path, local_rank, key, deadline), ""
        except _HeldByAnother as exc:
            held, last_error = held + 1, str(exc)
        except (OSError, auth.HandshakeFailed) as exc:  # not listening yet, or busy: tried again
            last_error = str(exc) or type(exc).__name__
    if held == len(names):
        raise CollectiveError(
            f"cannot join {describe(ranks, 0)}: other processes listen on every name of the group (last: {last_error})"
        )
    return None, last_error


def _connect(path: str, local_rank: int, key: bytes, deadline: float) -> socket.socket:
    """An authenticated connection to the listener at ``path``; OSError or HandshakeFailed while it is not rank 0's
    yet, :class:`_HeldByAnother` when another process listens there: another user's, or one whose queue is full
    (rank 0's accepts every connection at once, and closes those of other users)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)  # a full queue refuses at once: no wait on a listener that never accepts
        try:
            sock.connect(path)
        except BlockingIOError:
            raise _HeldByAnother(f"@{path[1:]} has a listener that accepts nobody") from None
        stranger = _another_user(sock)
        if stranger is not None:
            raise _HeldByAnother(f"@{path[1:]} is held by {stranger}")
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        auth.client_handshake(sock, local_rank, 0, key)
        return sock
    except BaseException:
        sock.close()
        raise


def _recv_with_fds(sock: socket.socket, size: int, max_fds: int, deadline: float) -> tuple[bytes, list[int]]:
    """``size`` bytes and the descriptors sent with them (close-on-exec); TimeoutError, or ConnectionError on EOF."""
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    message, ancillary, flags, _ = sock.recvmsg(size, socket.CMSG_SPACE(max_fds * 4), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    while 0 < len(message) < size and not flags & socket.MSG_CTRUNC:
        more = sock.recv(size - len(message))
        message += more or b"\0" * size  # EOF: fails the length check below
    if len(message) != size or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("connection closed")
    return message, list(fds)


def send_segment(conn: socket.socket, segment: Segment, timeout: float) -> None:
    """Pass a new data segment to the rank at the other end of ``conn`` (rank 0's side of a regrow)."""
    conn.settimeout(timeout)
    socket.send_fds(conn, [_GROW.pack(b"SDLG", segment.size)], [segment.fd])


def recv_segment(conn: socket.socket, size: int, deadline: float) -> Segment:
    """The data segment of ``size`` bytes rank 0 passes in a regrow; TimeoutError, ConnectionError, CollectiveError."""
    message, fds = _recv_with_fds(conn, _GROW.size, 1, deadline)
    if _GROW.unpack(message) != (b"SDLG", size) or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise CollectiveError(f"local rank 0 passed a malformed segment (expected {size} bytes)")
    return Segment.attach(fds[0], size)


class Progress:
    """The counters and doorbells of one rank: publish a value, wait until peers have published one."""

    def __init__(self, membership: Membership, local_rank: int, ranks: list[int], timeout: float):
        self.words = memoryview(membership.control.map).cast("q")
        self.doorbells, self.me, self.ranks, self.timeout = membership.doorbells, local_rank, ranks, timeout
        self.bells = list(self.doorbells.values())
        for bell in self.bells:
            bell.setblocking(False)
        # Spinning only pays while every local rank has a core of its own; with more ranks than cores it takes the
        # core from the rank being waited for (measured: N=4 on 2 cores, 16-64 MB, 1.6-2.2 GB/s spinning, 2.4-2.5 not).
        self.spin = SPIN if len(ranks) <= len(os.sched_getaffinity(0)) else 0
        self.value = 0  # this rank's counter: all ranks run the same calls, so a value names one phase everywhere
        self.gone: set[int] = set()  # peers whose doorbell reached EOF

    def publish(self, value: int) -> None:
        self.value = self.words[self.me * WORDS + SEQ] = value
        self.ring()

    def ring(self) -> None:
        for bell in self.bells:
            try:
                bell.send(b"\1", _RING)
            except OSError:  # full (that peer spins and does not drain) or gone: waiters on it find out
                pass

    def mark(self, state: int, blame: int = -1, kind: int = OTHER) -> None:
        """Leave ``state`` (and why it failed) in this rank's line for the peers that find this rank gone."""
        line = self.me * WORDS
        if self.words[line + STATE] == RUNNING:
            self.words[line + BLAME], self.words[line + KIND], self.words[line + STATE] = blame, kind, state
            self.ring()

    def wait(self, value: int, peers: list[int], op: str) -> None:
        """Until every rank of ``peers`` has published ``value``; CollectiveError if one is gone, or past the timeout."""
        words = self.words
        pending = [q for q in peers if words[q * WORDS] < value]
        spins = self.spin
        while pending:
            if not spins:
                return self._block(value, pending, op)
            spins -= 1
            pending = [q for q in pending if words[q * WORDS] < value]

    def _block(self, value: int, pending: list[int], op: str) -> None:
        deadline, poller, by_fd = time.monotonic() + self.timeout, select.poll(), {}
        for q in pending:
            by_fd[self.doorbells[q].fileno()] = q
            poller.register(self.doorbells[q], select.POLLIN)
        while True:
            pending = [q for q in pending if self.words[q * WORDS] < value]
            if not pending:
                return
            gone = [q for q in pending if q in self.gone]
            if gone:
                raise self.lost(op, gone)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.mark(FAILED, pending[0], TIMED_OUT)
                waiting = ", ".join(describe(self.ranks, q) for q in pending)
                raise CollectiveTimeout(f"{self._me(op)} timed out after {self.timeout}s waiting for {waiting}")
            for fd, _ in poller.poll(math.ceil(remaining * 1000)):
                if not _drain(self.doorbells[by_fd[fd]]):
                    self.gone.add(by_fd[fd])
                    poller.unregister(fd)

    def _me(self, op: str) -> str:
        return f"rank {self.ranks[self.me]}: {op}"

    def lost(self, op: str, gone: list[int]) -> CollectiveError:
        """The error for peers whose doorbell closed: one that died first (the others failed because of it)."""
        q = min(gone, key=lambda peer: self.words[peer * WORDS + STATE])  # RUNNING (it died) < CLOSED < FAILED
        state, blamed, why = (self.words[q * WORDS + word] for word in (STATE, BLAME, KIND))
        peer, died = describe(self.ranks, q), "closed its connection (its process died?)"
        blame, kind, what = q, OTHER, f"{peer} closed the group without this {op}"
        if state == RUNNING:
            kind, what = DIED, f"{peer} {died}"
        elif state == FAILED and why == DIED and 0 <= blamed < len(self.ranks) and blamed != self.me:
            blame, kind, what = blamed, DIED, f"{describe(self.ranks, blamed)} {died}, as {peer} found"
        elif state == FAILED:
            what = f"{peer} gave up: it {'timed out' if why == TIMED_OUT else 'failed'}"
        self.mark(FAILED, blame, kind)
        return CollectiveError(f"{self._me(op)} failed: {what}")


def _drain(bell: socket.socket) -> bool:
    """Read what the doorbell holds; False once the peer's end is closed."""
    while True:
        try:
            data = bell.recv(4096)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if len(data) < 4096:
            return bool(data)
