"""Why ranks on one host skip TCP: allreduce, reduce-scatter, allgather, broadcast and barrier through one segment.

:class:`SharedMemoryGroup` joins the local ranks of a host (setup, segments and
doorbells: :mod:`sparkdl.collective.shm.segment`).  Each phase of an operation
ends by publishing the rank's next counter value (plain stores: on x86-64 the
data written before it is visible first); all ranks run the same calls, so
waiting is "peer q reached value v".

allreduce splits each piece of the array (a few MB, to pipeline through the
caches) into one chunk per rank. A: each rank copies the chunks others reduce
into its slot. B: rank r reduces chunk r from its own input and the others'
slots straight into ``out`` and copies it to the result area. C: each rank
copies the other chunks of the result into ``out``. Pieces alternate between
two sets of slots and results, and piece k+1's A runs between k's B and C, so
every wait has a phase of work as slack.  An area is rewritten only once every
reader of its old contents has published past it, which the counters already
say: no extra round trip.  reduce_scatter is allreduce's A and B over a segment
of every rank's range per piece; allgather, each rank's piece into its slot, then
copied out by the others.  broadcast: the root copies into one of two halves
of the data segment, the others copy out.  barrier: counters only.

:attr:`SharedMemoryGroup.delivered` counts, per operation and dtype, the bytes each rank wrote into the
segment for its peers, once per peer that reads them: what this rank would have sent them over links
(a ring allreduce's 2(N-1)K/N, a reduce-scatter's or allgather's (N-1)K/N).
"""

from __future__ import annotations

import collections
import platform
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

import numpy as np

from sparkdl.collective.shm import segment as seg
from sparkdl.net.errors import CollectiveError, CollectiveTimeout

OPS = {"sum": np.add, "min": np.minimum, "max": np.maximum}
#: Data segment bytes at setup; a call needing more has rank 0 pass every rank a bigger one.
INITIAL_DATA_BYTES = 1 << 20
#: allreduce and broadcast move arrays in pieces of at most this many bytes.
PIECE_BYTES = 4 << 20
_NAME = re.compile(r"[0-9a-fA-F]{1,64}")
_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def available() -> bool:
    """Whether this machine can run the group (its counters rely on x86-64 memory ordering)."""
    return _TSO


class SharedMemoryGroup:
    """The local ranks of one host; every call is collective (all local ranks, same order, same sizes).

    Not thread-safe: one thread calls at a time. A process forked while the group is open holds its doorbells
    too, so this rank's death goes unnoticed (until the timeout) while that child lives.
    """

    def __init__(
        self, local_rank: int, ranks: Sequence[int], name: str, timeout: float, membership: seg.Membership | None
    ):
        self.local_rank, self.local_size, self.ranks = local_rank, len(ranks), list(ranks)
        self.name, self.timeout, self._membership = name, timeout, membership
        self._failure: CollectiveError | None = None
        self._closed = False
        self._peers = [q for q in range(self.local_size) if q != local_rank]
        # The counter value every peer must reach before a set of slots, of results, or a broadcast half is rewritten.
        self._free_slots, self._free_results, self._free_halves = [0, 0], [0, 0], [0, 0]
        self._set = self._half = 0  # the set of slots and results, and the broadcast half, used next
        # bytes written for peers by (operation, dtype name), once per peer that reads them (module docstring)
        self.delivered: collections.Counter[tuple[str, str]] = collections.Counter()
        if membership is not None:
            self._progress = seg.Progress(membership, local_rank, self.ranks, timeout)
            self._bytes: np.ndarray | None = np.frombuffer(membership.data.map, np.uint8)

    @classmethod
    def open(
        cls, local_rank: int, ranks: Sequence[int], *, name: str, secret: bytes, timeout: float
    ) -> SharedMemoryGroup:
        """Join the group of ``ranks`` (global ranks in local-rank order); local rank 0 creates it."""
        if not 0 <= local_rank < len(ranks):
            raise ValueError(f"Expected 0 <= local_rank < {len(ranks)}. Received: local_rank={local_rank}")
        if not _NAME.fullmatch(name):
            raise ValueError(f"Expected a name of 1 to 64 hex digits. Received: name={name!r}")
        if not secret or not timeout > 0:
            raise ValueError(f"Expected a secret and a timeout > 0. Received: timeout={timeout}")
        me = f"rank {ranks[local_rank]}: shared memory setup failed"
        if len(ranks) == 1:
            return cls(local_rank, ranks, name, timeout, None)
        if not _TSO:
            raise CollectiveError(f"{me}: its counters rely on x86-64 memory ordering, not {platform.machine()}'s")
        try:
            membership = seg.setup(local_rank, list(ranks), name, secret, timeout, INITIAL_DATA_BYTES)
        except CollectiveError as exc:
            raise type(exc)(f"{me}: {exc}") from None
        except OSError as exc:
            raise CollectiveError(f"{me}: {exc}") from None
        return cls(local_rank, ranks, name, timeout, membership)

    def __enter__(self) -> SharedMemoryGroup:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def allreduce(self, flat: np.ndarray, op: str, out: np.ndarray) -> None:
        """``out`` = ``op`` ("sum", "min", "max") over every local rank's ``flat``; ``out`` may be ``flat``."""
        ufunc, same = self._ufunc(op), _check(flat, out)
        ufunc(flat[:0], out[:0], out=out[:0])  # TypeError now, not mid-call, for a dtype the op does not take
        with self._operation("allreduce") as progress:
            if progress is None or flat.size == 0:
                if not same:
                    np.copyto(out, flat)
                return
            size, rank, item, n = self.local_size, self.local_rank, flat.dtype.itemsize, flat.size
            piece = min(n, max(1, PIECE_BYTES // item))
            data = self._reserve(2 * (size + 1) * seg.align(piece * item, 64), "allreduce")
            stride = len(data) // (2 * (size + 1)) // 64 * 64  # fixed per segment: no slot overlaps a result area
            src, dst, wait, peers = flat.view(np.uint8), out.view(np.uint8), progress.wait, self._peers

            def phase_a(k: int) -> None:  # the chunks the others reduce, into this rank's slot
                start, a, b, end, set_ = pieces[k][:5]
                slot = data[(set_ * (size + 1) + rank) * stride :]
                wait(max(self._free_slots[set_], *self._free_halves), peers, "allreduce")
                slot[:a] = src[start : start + a]
                slot[b:end] = src[start + b : start + end]
                self.delivered["allreduce", flat.dtype.name] += a + end - b  # each chunk for its one reducer
                progress.publish(progress.value + 1)
                written[k] = progress.value

            pieces: list[tuple[int, ...]] = []
            firsts = range(0, n, piece)
            written = [0] * len(firsts)
            for first, set_ in zip(firsts, self._sets(len(firsts))):
                m = min(piece, n - first)
                lo = first + rank * (m // size) + min(rank, m % size)
                hi = lo + m // size + (rank < m % size)
                pieces.append((first * item, (lo - first) * item, (hi - first) * item, m * item, set_, lo, hi))
            phase_a(0)
            for k, (start, a, b, end, set_, lo, hi) in enumerate(pieces):
                # B: this rank's chunk, reduced from its input and the slots into out, then shared.
                slots = data[set_ * (size + 1) * stride :]
                wait(max(written[k], self._free_results[set_], *self._free_halves), peers, "allreduce")
                if b > a:
                    mine = out[lo:hi]
                    for i, q in enumerate(peers):
                        ufunc(
                            flat[lo:hi] if i == 0 else mine,
                            slots[q * stride + a : q * stride + b].view(out.dtype),
                            out=mine,
                        )
                    slots[size * stride + a : size * stride + b] = dst[start + a : start + b]
                    self.delivered["allreduce", flat.dtype.name] += (b - a) * len(peers)  # every peer copies it out
                progress.publish(progress.value + 1)
                reduced = self._free_slots[set_] = progress.value
                if k + 1 < len(pieces):
                    phase_a(k + 1)
                # C: the other chunks of the result.
                result = slots[size * stride : (size + 1) * stride]
                wait(reduced, peers, "allreduce")
                dst[start : start + a] = result[:a]
                dst[start + b : start + end] = result[b:end]
                progress.publish(progress.value + 1)
                self._free_results[set_] = progress.value

    def reduce_scatter(self, flat: np.ndarray, op: str, out: np.ndarray, bounds: Sequence[int]) -> None:
        """``out`` = ``op`` over every local rank's ``flat[bounds[r]:bounds[r + 1]]`` (r: this local rank).

        Each piece holds a segment of every rank's range: A, each rank copies the segments the others
        reduce into its slot; B, each reduces its own segment from its input and the others' slots into
        ``out``. Piece k+1's A runs before k's B.
        """
        ufunc = self._ufunc(op)
        if len(bounds) != self.local_size + 1 or list(bounds) != sorted(bounds) or bounds[-1] > np.size(flat):
            raise ValueError(f"Expected {self.local_size + 1} ascending bounds within the array. Received: {bounds}")
        lo, hi = bounds[self.local_rank], bounds[self.local_rank + 1]
        _check_source(flat)  # only read: a read-only view of a tensor's memory will do
        if not isinstance(out, np.ndarray) or out.shape != (hi - lo,) or out.dtype != flat.dtype:
            raise ValueError(f"Expected out of {hi - lo} {flat.dtype}. Received: {getattr(out, 'shape', out)}")
        if not out.flags.c_contiguous or not out.flags.writeable or np.may_share_memory(flat, out):
            raise ValueError("Expected a writeable C-contiguous out apart from flat")
        ufunc(flat[:0], out[:0], out=out[:0])  # TypeError now, not mid-call, for a dtype the op does not take
        with self._operation("reduce_scatter") as progress:
            size, rank, item = self.local_size, self.local_rank, flat.dtype.itemsize
            if progress is None:
                out[...] = flat[lo:hi]
                return
            step = max(1, PIECE_BYTES // item // size)  # elements of one rank's range per piece
            count = -(-max(bounds[q + 1] - bounds[q] for q in range(size)) // step)
            data = self._reserve(2 * (size + 1) * seg.align(step * size * item, 64), "reduce_scatter")
            stride = len(data) // (2 * (size + 1)) // 64 * 64
            src, wait, peers = flat.view(np.uint8), progress.wait, self._peers
            sets, written = self._sets(count), [0] * count

            def segment(q: int, k: int) -> tuple[int, int]:
                a = bounds[q] + k * step
                return a, min(bounds[q + 1], a + step)

            def phase_a(k: int) -> None:
                slot = data[(sets[k] * (size + 1) + rank) * stride :]
                wait(max(self._free_slots[sets[k]], *self._free_halves), peers, "reduce_scatter")
                for q in peers:
                    a, b = segment(q, k)
                    slot[q * step * item : (q * step + b - a) * item] = src[a * item : b * item]
                    self.delivered["reduce_scatter", flat.dtype.name] += (b - a) * item
                progress.publish(progress.value + 1)
                written[k] = progress.value

            if count:
                phase_a(0)
            for k in range(count):
                if k + 1 < count:
                    phase_a(k + 1)
                base = sets[k] * (size + 1) * stride
                wait(max(written[k], *self._free_halves), peers, "reduce_scatter")
                a, b = segment(rank, k)
                if b > a:
                    mine = out[a - lo : b - lo]
                    for i, q in enumerate(peers):
                        start = base + q * stride + rank * step * item
                        ufunc(
                            flat[a:b] if i == 0 else mine,
                            data[start : start + (b - a) * item].view(out.dtype),
                            out=mine,
                        )
                progress.publish(progress.value + 1)
                self._free_slots[sets[k]] = progress.value

    def allgather(self, rows: np.ndarray) -> None:
        """Row r of ``rows`` (``(local_size, n)``, C-contiguous, any dtype) from local rank r into every rank's.

        Each rank copies a piece of its row into its slot; the others copy it out. Piece k+1 is written
        before piece k is read.
        """
        if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[0] != self.local_size:
            raise ValueError(f"Expected rows of shape ({self.local_size}, n). Received: {getattr(rows, 'shape', rows)}")
        if not rows.flags.c_contiguous or not rows.flags.writeable or rows.dtype.hasobject:
            raise ValueError("Expected C-contiguous, writeable numeric rows")
        with self._operation("allgather") as progress:
            if progress is None or rows.size == 0:
                return
            size, rank, wait, peers = self.local_size, self.local_rank, progress.wait, self._peers
            table = rows.view(np.uint8).reshape(size, -1)
            n = table.shape[1]
            piece = min(n, PIECE_BYTES)
            count = -(-n // piece)
            data = self._reserve(2 * (size + 1) * seg.align(piece, 64), "allgather")
            stride = len(data) // (2 * (size + 1)) // 64 * 64
            sets, written = self._sets(count), [0] * count

            def write(k: int) -> None:
                a, b = k * piece, min(n, (k + 1) * piece)
                start = (sets[k] * (size + 1) + rank) * stride
                wait(max(self._free_slots[sets[k]], *self._free_halves), peers, "allgather")
                data[start : start + b - a] = table[rank, a:b]
                self.delivered["allgather", rows.dtype.name] += (b - a) * len(peers)
                progress.publish(progress.value + 1)
                written[k] = progress.value

            write(0)
            for k in range(count):
                if k + 1 < count:
                    write(k + 1)
                a, b = k * piece, min(n, (k + 1) * piece)
                wait(written[k], peers, "allgather")
                for q in peers:
                    start = (sets[k] * (size + 1) + q) * stride
                    table[q, a:b] = data[start : start + b - a]
                progress.publish(progress.value + 1)
                self._free_slots[sets[k]] = progress.value

    def broadcast(self, flat: np.ndarray, root: int, out: np.ndarray) -> None:
        """Local rank ``root``'s ``flat`` into every rank's ``out`` (the root's too); ``out`` may be ``flat``."""
        if not 0 <= root < self.local_size:
            raise ValueError(f"Expected 0 <= root < {self.local_size}. Received: root={root}")
        same = _check(flat, out)
        with self._operation("broadcast") as progress:
            if progress is None or flat.size == 0:
                if not same:
                    np.copyto(out, flat)
                return
            item, n = flat.dtype.itemsize, flat.size
            piece = min(n, max(1, PIECE_BYTES // item))
            data = self._reserve(2 * seg.align(piece * item, 64), "broadcast")
            stride = len(data) // 2 // 64 * 64
            src, dst = flat.view(np.uint8), out.view(np.uint8)
            for first in range(0, n * item, piece * item):
                end, half = min(n * item, first + piece * item), self._half
                area, value = data[half * stride : half * stride + end - first], progress.value
                self._half ^= 1
                if self.local_rank == root:
                    ready = max(self._free_halves[half], *self._free_slots, *self._free_results)
                    progress.wait(ready, self._peers, "broadcast")
                    area[:] = src[first:end]
                    self.delivered["broadcast", flat.dtype.name] += (end - first) * len(self._peers)
                    progress.publish(value + 2)
                    if not same:
                        dst[first:end] = src[first:end]
                else:
                    progress.wait(value + 1, [root], "broadcast")
                    dst[first:end] = area
                    progress.publish(value + 2)
                self._free_halves[half] = value + 2

    def barrier(self) -> None:
        """Return once every local rank has called barrier."""
        with self._operation("barrier") as progress:
            if progress is not None:
                progress.publish(progress.value + 1)
                progress.wait(progress.value, self._peers, "barrier")

    def close(self) -> None:
        """Release the segments and sockets (idempotent); peers still waiting on this rank are told it left."""
        if not self._closed:
            self._closed = True
            if self._membership is not None:
                self._progress.mark(seg.CLOSED)
            self._release()

    @contextmanager
    def _operation(self, op: str) -> Iterator[seg.Progress | None]:
        """The progress of a group that can run ``op``; any failure in it poisons the group."""
        me = f"rank {self.ranks[self.local_rank]}: {op} failed"
        if self._failure is not None:
            raise type(self._failure)(f"{me}: the shared memory group failed before: {self._failure}")
        if self._closed:
            raise CollectiveError(f"{me}: the shared memory group is closed")
        try:
            yield self._progress if self._membership is not None else None
        except BaseException as exc:  # the counters no longer match the peers': none of this group's calls can run
            # What it was, without its traceback, whose frames hold views of the segment: the segment goes with the
            # caller's exception, not with this group (a cycle through it, kept until garbage collection).
            self._failure = (
                type(exc)(str(exc))
                if isinstance(exc, CollectiveError)
                else CollectiveError(f"{me}: interrupted by {exc!r}")
            )
            if self._membership is not None:
                self._progress.mark(seg.FAILED)  # unless the wait that failed left why
            self._release()
            raise

    def _release(self) -> None:
        if self._membership is not None:
            self._bytes = None
            self._progress.words.release()
            self._membership.close()
            self._membership = None

    def _ufunc(self, op: str):
        if op not in OPS:
            raise ValueError(f"Expected op in {sorted(OPS)}. Received: op={op!r}")
        return OPS[op]

    def _sets(self, count: int) -> list[int]:
        """The set of slots (0 or 1) each of ``count`` pieces uses, alternating on from the last call's."""
        sets = []
        for _ in range(count):
            sets.append(self._set)
            self._set ^= 1
        return sets

    def _reserve(self, need: int, op: str) -> np.ndarray:
        """The data segment's bytes, after replacing it with a bigger one if it holds fewer than ``need``."""
        membership = self._membership
        assert membership is not None and self._bytes is not None
        if need <= membership.data.size:
            return self._bytes
        size, me = max(seg.align(need), 2 * membership.data.size), f"rank {self.ranks[self.local_rank]}: {op}"
        if self.local_rank == 0:
            try:
                segment = seg.Segment.create(self.name, size)
            except CollectiveError as exc:
                raise CollectiveError(f"{me} failed: {exc}") from None
            for q, conn in membership.conns.items():
                try:
                    seg.send_segment(conn, segment, self.timeout)
                except OSError:
                    segment.close()
                    self._progress.gone.add(q)
                    raise self._progress.lost(op, [q]) from None
        else:
            try:
                segment = seg.recv_segment(membership.conns[0], size, time.monotonic() + self.timeout)
            except TimeoutError:
                self._progress.mark(seg.FAILED, 0, seg.TIMED_OUT)
                raise CollectiveTimeout(
                    f"{me} timed out after {self.timeout}s waiting for {seg.describe(self.ranks, 0)}'s bigger segment"
                ) from None
            except OSError:
                raise self._progress.lost(op, [0]) from None
        self._bytes = None
        membership.data.close()
        membership.data = segment
        self._bytes = np.frombuffer(segment.map, np.uint8)
        return self._bytes


def _check_source(flat: np.ndarray, label: str = "flat") -> None:
    """ValueError unless ``flat`` is fit to be read by a collective (it may be read-only)."""
    if not isinstance(flat, np.ndarray) or flat.ndim != 1 or not flat.flags.c_contiguous:
        raise ValueError(f"Expected {label} to be a 1-D C-contiguous numpy array. Received: {type(flat)}")
    if flat.dtype.hasobject:
        raise ValueError(f"Expected a numeric {label}. Received: {flat.dtype}")


def _check(flat: np.ndarray, out: np.ndarray) -> bool:
    """Whether ``out`` is ``flat`` (the same memory); ValueError unless both are fit for a collective."""
    _check_source(flat)
    _check_source(out, "out")
    if flat.dtype != out.dtype or flat.size != out.size:
        raise ValueError(f"Expected flat and out of one dtype and size. Received: {flat.dtype}, {out.dtype}")
    if not out.flags.writeable:
        raise ValueError(f"Expected numeric arrays and a writeable out. Received: {flat.dtype}")
    same = flat.size == 0 or flat.ctypes.data == out.ctypes.data
    if not same and np.may_share_memory(flat, out):
        raise ValueError("Expected out to be flat itself or not to overlap it")
    return same
