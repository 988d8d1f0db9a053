"""Ring collectives (allreduce, allgather, broadcast, barrier) over two neighbour links.

Rank r only sends to rank r+1 and only receives from rank r-1.  Sends run on
one persistent sender thread while the calling thread receives, so data moves
in both directions at once and the ring cannot deadlock on full socket
buffers.  Arrays travel in segments: the kernel receives segment i+1 while
numpy reduces segment i, and each segment is forwarded to the next rank as
soon as it is ready instead of at the end of a ring step.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from sparkdl.collective.transport import (
    CollectiveError,
    Listener,
    Op,
    PeerLink,
    connect_peer,
    dtype_code,
)

#: Pipelining granularity: small enough that a received segment is reduced
#: while still in cache and that a 16 MB allreduce still pipelines within each
#: chunk, large enough that per-frame Python and syscall overhead is negligible
#: (measured on loopback: 2 MB beat 256 KB and 1 MB, and matched 4 MB).
SEGMENT_BYTES = 2 << 20


def _chunk_bounds(count: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` chunks sized like np.array_split (first ones one larger)."""
    base, extra = divmod(count, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def _segments(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


class RingCommunicator:
    """Collectives among ``size`` ranks connected in a ring; see :meth:`connect`."""

    def __init__(self, rank: int, size: int, listener: Listener, to_next: PeerLink | None, from_prev: PeerLink | None):
        self.rank = rank
        self.size = size
        self._listener = listener
        self._to_next = to_next
        self._from_prev = from_prev
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sparkdl-ring{rank}-send")
        self._pending_sends: collections.deque[Future] = collections.deque()
        # One receive buffer for reductions, reused by every segment of every call.
        self._scratch = np.empty(SEGMENT_BYTES if size > 1 else 0, dtype=np.uint8)
        self._seq = 0
        self._failure: BaseException | None = None
        self._closed = False

    @classmethod
    def connect(
        cls,
        rank: int,
        addresses: list[str],
        listener: Listener,
        secret: bytes,
        timeout: float = 300.0,
        *,
        encrypt: bool = False,
    ) -> RingCommunicator:
        """Connect to rank+1 and accept rank-1 (concurrently, so no rank waits on a cycle).

        ``addresses[i]`` is rank i's listener address; ``timeout`` bounds every
        single network wait, including how long to wait for each neighbour;
        ``encrypt`` seals both links with authenticated encryption.
        """
        size = len(addresses)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("secret must be non-empty bytes")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if size == 1:
            return cls(rank, size, listener, None, None)
        next_rank, prev_rank = (rank + 1) % size, (rank - 1) % size
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sparkdl-ring{rank}-connect") as pool:
            outgoing = pool.submit(
                connect_peer, addresses[next_rank], rank, next_rank, secret, timeout, encrypt=encrypt
            )
            try:
                from_prev = listener.accept_peer(rank, prev_rank, secret, timeout, encrypt=encrypt)
            except BaseException:
                _close_result(outgoing)
                raise
            try:
                to_next = outgoing.result()
            except BaseException:
                from_prev.close()
                raise
        return cls(rank, size, listener, to_next, from_prev)

    def allreduce(self, array: np.ndarray, average: bool = False) -> np.ndarray:
        """Elementwise sum (or mean) over ranks; same shape and dtype as ``array``.

        The mean of an integer array is floor-divided, to keep the dtype.
        """
        source = np.asarray(array)
        dtype_code(source.dtype)
        flat = np.ascontiguousarray(source).reshape(-1)
        out = np.empty_like(flat)
        if self.size == 1:
            out[...] = flat
        else:
            self._run(Op.ALLREDUCE, self._ring_allreduce, flat, out)
        if average:
            divide = np.floor_divide if np.issubdtype(out.dtype, np.integer) else np.true_divide
            divide(out, self.size, out=out)
        return out.reshape(source.shape)

    def allgather(self, array: np.ndarray) -> np.ndarray:
        """Stack every rank's array: result[r] is rank r's ``array``."""
        return self._allgather(Op.ALLGATHER, np.asarray(array))

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Everyone gets ``root``'s array; other ranks only contribute shape and dtype."""
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is outside 0..{self.size - 1}")
        source = np.asarray(array)
        dtype_code(source.dtype)
        out = np.empty_like(source.reshape(-1))
        if self.rank == root:
            out[...] = source.reshape(-1)
        if self.size > 1:
            self._run(Op.BROADCAST, self._ring_broadcast, out, root)
        return out.reshape(source.shape)

    def barrier(self) -> None:
        """Return only after every rank has entered the barrier (a one-byte allgather)."""
        self._allgather(Op.BARRIER, np.zeros(1, dtype=np.uint8))

    def close(self) -> None:
        """Close the links, the sender thread and the listener; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._shutdown_links()
        self._sender.shutdown(wait=True)
        self._listener.close()

    def __enter__(self) -> RingCommunicator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _allgather(self, op: Op, source: np.ndarray) -> np.ndarray:
        dtype_code(source.dtype)
        out = np.empty((self.size,) + source.shape, dtype=source.dtype)
        rows = out.reshape(self.size, source.size)
        rows[self.rank] = source.reshape(-1)
        if self.size > 1:
            self._run(op, self._ring_allgather, rows)
        return out

    def _run(self, op: Op, algorithm, *args) -> None:
        """Run one collective; any failure poisons the communicator, since peers are now out of step."""
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: {op.name.lower()} on a closed communicator")
        if self._failure is not None:
            raise CollectiveError(
                f"rank {self.rank}: {op.name.lower()} on a communicator that already failed: {self._failure}"
            ) from self._failure
        seq = self._seq
        self._seq = (seq + 1) & 0xFFFFFFFF
        try:
            algorithm(op, seq, *args)
            self._wait_for_sends()
        except BaseException as exc:
            self._failure = exc
            self._shutdown_links()
            raise

    def _ring_allreduce(self, op: Op, seq: int, flat: np.ndarray, out: np.ndarray) -> None:
        """Scatter-reduce then allgather, N-1 steps each, one chunk per rank per step.

        At scatter-reduce step s a rank sends chunk r-s and reduces chunk r-s-1
        (``out = flat + received``); after N-1 steps it owns the full sum of
        chunk r+1, which starts the allgather.  ``out`` regions holding
        forwarded partial sums are later overwritten by final sums, which is
        safe: the final sum of a segment can only arrive after the next rank
        received this rank's partial of that segment, i.e. after it was sent.
        """
        size, rank = self.size, self.rank
        bounds = _chunk_bounds(flat.size, size)
        step_elems = max(1, SEGMENT_BYTES // flat.itemsize)

        def segments(chunk: int) -> list[tuple[int, int]]:
            chunk %= size
            return _segments(bounds[chunk], bounds[chunk + 1], step_elems)

        for a, b in segments(rank):
            self._send(op, seq, flat[a:b])
        for step in range(size - 1):
            for a, b in segments(rank - step - 1):
                received = self._scratch[: (b - a) * flat.itemsize].view(flat.dtype)
                self._recv(op, seq, received)
                np.add(flat[a:b], received, out=out[a:b])
                self._send(op, seq, out[a:b])
        for step in range(size - 1):
            for a, b in segments(rank - step):
                self._recv(op, seq, out[a:b])
                if step < size - 2:
                    self._send(op, seq, out[a:b])

    def _ring_allgather(self, op: Op, seq: int, rows: np.ndarray) -> None:
        """Pass rows along the ring: at step s forward row r-s, receive row r-s-1."""
        size, rank = self.size, self.rank
        step_elems = max(1, SEGMENT_BYTES // rows.itemsize)
        own = rows[rank]
        for a, b in _segments(0, own.size, step_elems):
            self._send(op, seq, own[a:b])
        for step in range(size - 1):
            row = rows[(rank - step - 1) % size]
            for a, b in _segments(0, row.size, step_elems):
                self._recv(op, seq, row[a:b])
                if step < size - 2:
                    self._send(op, seq, row[a:b])

    def _ring_broadcast(self, op: Op, seq: int, out: np.ndarray, root: int) -> None:
        """Pipeline segments from ``root`` around the ring; the rank before root stops."""
        step_elems = max(1, SEGMENT_BYTES // out.itemsize)
        is_root = self.rank == root
        forwards = (self.rank + 1) % self.size != root
        for a, b in _segments(0, out.size, step_elems):
            if not is_root:
                self._recv(op, seq, out[a:b])
            if is_root or forwards:
                self._send(op, seq, out[a:b])

    def _send(self, op: Op, seq: int, segment: np.ndarray) -> None:
        assert self._to_next is not None, "a ring of one rank sends nothing"
        self._pending_sends.append(self._sender.submit(self._to_next.send, op, seq, segment))

    def _recv(self, op: Op, seq: int, segment: np.ndarray) -> None:
        # Surface a failed send now rather than after waiting on a stalled ring.
        while self._pending_sends and self._pending_sends[0].done():
            self._pending_sends.popleft().result()
        assert self._from_prev is not None, "a ring of one rank receives nothing"
        self._from_prev.recv_into(op, seq, segment)

    def _wait_for_sends(self) -> None:
        """Results may not be returned (or inputs reused) while still being sent."""
        while self._pending_sends:
            self._pending_sends.popleft().result()

    def _shutdown_links(self) -> None:
        for future in self._pending_sends:
            future.cancel()
        self._pending_sends.clear()
        for link in (self._to_next, self._from_prev):
            if link is not None:
                link.close()


def _close_result(future: Future) -> None:
    """Close the link a connect future produced, if it produced one."""
    try:
        future.result().close()
    except BaseException:
        pass
