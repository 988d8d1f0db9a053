"""One authenticated connection between two ranks: whole frames out, and frames in matched by operation or by tag.

A send goes out from the caller's thread when nothing is queued ahead of it and
the socket takes it whole without waiting (a small message then costs one system
call, not two thread hand-overs); the rest of it, and any send behind it, runs on
one thread per link, so a rank sends and receives at once and cannot deadlock on
full socket buffers. Receives run in the caller's thread,
straight into the caller's array when the frame is the one expected; a frame
for another operation of another group, or a message with another tag, is
kept until asked for. Within one group a frame for another collective means
the ranks are out of step, and is reported as such. Nothing received is ever
deserialised: a frame is :mod:`sparkdl.net.frames`' header and raw bytes.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from sparkdl.collective.api import OP_CODES, operation_name
from sparkdl.net.errors import CollectiveError, CollectiveTimeout
from sparkdl.net.frames import HEADER, FrameError, Header, Kind, dtype_code, dtype_name
from sparkdl.net.io import send_buffers, shutdown_and_close, write_available
from sparkdl.net.secure import Channel

#: Longest reason an ABORT frame may carry.
MAX_ABORT_BYTES = 2048
#: Most bytes of frames received ahead of being asked for, per link, before the peer is refused.
MAX_KEPT_BYTES = 4 << 30
#: A kept frame's buffer grows by at most this many bytes a read: it holds what arrived, never what was announced.
KEEP_CHUNK_BYTES = 1 << 20
#: Frames of at most this many bytes are written from the caller's thread when the link's sender is idle.
INLINE_BYTES = 1 << 20


def _bytes_of(array: np.ndarray) -> memoryview:
    return array.reshape(-1).view(np.uint8).data


class Link:
    """One authenticated connection to ``peer``, and the frames received from it ahead of their time."""

    def __init__(self, channel: Channel, rank: int, peer: int, timeout: float):
        channel.sock.settimeout(timeout)
        self.channel, self.rank, self.peer, self.timeout = channel, rank, peer, timeout
        self._on_host = _on_host(channel)  # for errors: on a cluster the first question is which machine
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sparkdl-rank{rank}-to{peer}")
        self._send_lock = threading.Lock()  # whole frames only: the sender thread and an abort alike
        self._queue_lock = threading.Lock()  # guards ``_queued``: sends go on the wire in the order they are queued
        self._queued = 0  # sends handed to the sender thread and not yet written
        self._header = bytearray(HEADER.size)
        self.kept: dict[tuple, collections.deque[tuple[Header, bytearray]]] = collections.defaultdict(collections.deque)
        self._kept_bytes = 0
        self._state = threading.Condition()  # guards ``kept`` and ``_reading``
        self._reading = False  # a thread is reading the socket
        self.bytes_sent = self.bytes_received = 0  # payload bytes, for benchmarks and tests of the algorithms
        # payload bytes sent by (operation code, dtype code) of the frames: a fit's ``stats["wire_bytes"]``
        self.sent_by_operation: collections.Counter[tuple[int, int]] = collections.Counter()

    def send(self, header: Header, payload: memoryview | bytes) -> Future:
        """Sends one frame (:meth:`send_frames`); the future fails with a CollectiveError."""
        return self.send_frames([(header, payload)])

    def send_frames(self, frames: Sequence[tuple[Header, memoryview | bytes]]) -> Future:
        """Sends frames that go out together, in order, in one write (an array's shape and its bytes).

        Small frames with nothing queued ahead of them are written from this thread, as far as the socket takes them
        without waiting; what it does not take, and every other send, is queued to the link's sender thread. The
        future is done once the frames are written, and fails with a CollectiveError."""
        buffers = [part for header, payload in frames for part in (header.pack(), payload)]
        with self._queue_lock:
            if (
                self._queued == 0
                and sum(header.nbytes for header, _ in frames) <= INLINE_BYTES
                and self._send_lock.acquire(blocking=False)  # not while an abort or a close holds the socket
            ):
                try:
                    rest = write_available(self.channel.sock, self.channel.wire(buffers))
                except OSError as exc:
                    failed: Future = Future()
                    failed.set_exception(self._error(operation_name(frames[0][0].op), "send to", exc))
                    return failed
                finally:
                    self._send_lock.release()
                if not rest:
                    self._count(frames)  # under the queue lock, as the sender thread counts
                    written: Future = Future()
                    written.set_result(None)
                    return written
                self._queued += 1
                return self._sender.submit(self._send_queued, frames, lambda: send_buffers(self.channel.sock, rest))
            self._queued += 1
            return self._sender.submit(self._send_queued, frames, lambda: self.channel.send(buffers))

    def _send_queued(self, frames: Sequence[tuple[Header, memoryview | bytes]], write: Callable[[], None]) -> None:
        """On the sender thread: ``write()`` (the frames, or what of their bytes is left), then count them."""
        try:
            with self._send_lock:
                write()
        except OSError as exc:
            with self._queue_lock:
                self._queued -= 1
            raise self._error(operation_name(frames[0][0].op), "send to", exc) from exc
        with self._queue_lock:
            self._queued -= 1
            self._count(frames)

    def _count(self, frames: Sequence[tuple[Header, memoryview | bytes]]) -> None:
        for header, _ in frames:
            self.bytes_sent += header.nbytes
            self.sent_by_operation[header.op, header.dtype] += header.nbytes

    def abort(self, reason: str) -> None:
        """Tells the peer, if the link is free within a moment, why this rank gives up; then closes."""
        message = reason.encode()[:MAX_ABORT_BYTES]
        self._end(Header(Kind.ABORT, 0, len(message)), message)

    def close(self) -> None:
        """Tells the peer, if the link is free within a moment, that this rank closed its communicator (it has not
        failed: see ``Links``, whose ranks waiting for a connection take a link closed without a word for a failure);
        then closes."""
        self._end(Header(Kind.CLOSE, 0, 0), b"")

    def _end(self, header: Header, payload: bytes) -> None:
        """Sends the link's last frame, if no other frame is being sent for a moment; then closes the socket."""
        if self._send_lock.acquire(timeout=0.5):
            try:
                self.channel.sock.settimeout(1.0)
                self.channel.send([header.pack(), payload])
            except OSError:
                pass
            finally:
                self._send_lock.release()
        shutdown_and_close(self.channel.sock)
        self._sender.shutdown(wait=False, cancel_futures=True)
        with self._state:  # nobody will ask for them now
            self.kept.clear()
            self._kept_bytes = 0

    def receive(
        self, key: tuple, op: int, out: np.ndarray | None, dtype: np.dtype | None, *, most: int | None = None
    ) -> tuple[Header, np.ndarray]:
        """The next frame of ``key`` ((kind, group, seq or tag)), its payload in ``out`` if given, else a new array
        (of at most ``most`` bytes: a longer frame is malformed).

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
                return self._read_until(key, op, out, dtype, most)
            finally:
                with self._state:
                    self._reading = False
                    self._state.notify_all()
        self._check(header, op, out, dtype, most)
        received = np.frombuffer(data, dtype=_payload_dtype(header, out, dtype))
        if out is None:
            return header, received
        _bytes_of(out)[:] = data
        return header, out

    def _read_until(
        self, key: tuple, op: int, out: np.ndarray | None, dtype: np.dtype | None, most: int | None
    ) -> tuple[Header, np.ndarray]:
        """Reads frames (this thread alone) until the one of ``key``, keeping the others for their receivers."""
        while True:
            header = self._read_header(op)
            frame_key = (header.kind, header.group, header.tag if header.kind == Kind.MESSAGE else header.seq)
            if frame_key == key:
                self._check(header, op, out, dtype, most)
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
                f"receives while this rank waits in {_receiving_in(op)}; check the order of sends and receives"
            )
        data = bytearray()
        chunk = bytearray(min(header.nbytes, KEEP_CHUNK_BYTES))
        try:
            while len(data) < header.nbytes:
                with memoryview(chunk)[: header.nbytes - len(data)] as arrived:
                    self._read_exact(arrived, op)
                    data += arrived  # grown as the bytes arrive: a silent peer's announced length costs nothing
        except BaseException:
            data.clear()  # not left to the traceback's frames until garbage collection
            raise
        with self._state:
            self._kept_bytes += len(data)
            self.kept[key].append((header, data))
            self._state.notify_all()

    def _check(self, header: Header, op: int, out: np.ndarray | None, dtype: np.dtype | None, most: int | None) -> None:
        if most is not None and header.nbytes > most:
            raise CollectiveError(
                f"rank {self.rank}: malformed frame from rank {self.peer}: {operation_name(header.op)} of "
                f"{header.nbytes} bytes where at most {most} may come"
            )
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
            raise CollectiveError(f"rank {self.rank}: {_receiving_in(op)}: {exc}") from None
        if header.kind == Kind.ABORT:
            reason = bytearray(min(header.nbytes, MAX_ABORT_BYTES))
            self._read_exact(memoryview(reason), op)
            raise CollectiveError(
                f"rank {self.rank}: {_receiving_in(op)} failed: rank {self.peer} gave up: "
                f"{reason.decode(errors='replace')}"
            )
        if header.kind == Kind.CLOSE:
            raise CollectiveError(
                f"rank {self.rank}: rank {self.peer} closed the connection during {operation_name(op)}: it closed "
                "its communicator; all ranks must make the same calls"
            )
        return header

    def _read_exact(self, view: memoryview, op: int) -> None:
        try:
            received = self.channel.recv_into(view)
        except OSError as exc:
            raise self._error(_receiving_in(op), "receive from", exc) from exc
        if received < len(view):
            raise CollectiveError(
                f"rank {self.rank}: rank {self.peer} closed the connection during {_receiving_in(op)}; "
                f"check whether that rank's process{self._on_host} failed or closed its communicator"
            )

    def _error(self, operation: str, action: str, exc: OSError) -> CollectiveError:
        if isinstance(exc, TimeoutError):
            return CollectiveTimeout(
                f"rank {self.rank}: {operation} timed out after {self.timeout}s waiting to {action} "
                f"rank {self.peer}; check that rank {self.peer}{self._on_host} is alive and makes the same calls, or "
                "raise the timeout"
            )
        return CollectiveError(
            f"rank {self.rank}: {operation} failed to {action} rank {self.peer}: {exc}; "
            f"check whether that rank's process{self._on_host} failed"
        )


def _on_host(channel: Channel) -> str:
    """Where the peer of a TCP connection is, for errors (" (on HOST)"); nothing for a Unix socket's (this host)."""
    try:
        peer = channel.sock.getpeername()
    except OSError:
        return ""
    return f" (on {peer[0]})" if isinstance(peer, tuple) else ""


def _receiving_in(op: int) -> str:
    """The operation a rank reading frames of ``op`` is in, for its errors: a message's frames are a send's, read
    by a recv."""
    return "recv" if op == OP_CODES["send"] else operation_name(op)


def _payload_dtype(header: Header, out: np.ndarray | None, dtype: np.dtype | None) -> np.dtype:
    if out is not None:
        return out.dtype
    return dtype if dtype is not None else np.dtype(np.uint8)
