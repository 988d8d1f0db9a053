"""One operation's traffic among a group's ranks: frames stamped with its group, code and sequence number.

An algorithm's frames go through a :class:`Transfer`: group ranks (0..size-1),
their ring order (host by host), and sends and receives of arrays. Sends go
out through the links (from this thread, or their sender threads when the socket
is busy); :meth:`Transfer.flush` waits for them,
and every algorithm flushes before it returns (leaving a ``with`` block of
the transfer does), so that results (and inputs) are never handed back
while still being sent.
"""

from __future__ import annotations

import collections
import math
from concurrent.futures import Future

import numpy as np

from sparkdl.collective.transport.mesh import Links
from sparkdl.net.errors import CollectiveError
from sparkdl.net.frames import FrameError, Header, Kind, dtype_code, dtype_of

#: Most dimensions an array sent with its shape may have.
MAX_DIMS = 32
#: Most bytes an array's shape frame may hold: its number of dimensions, then each dimension (int64s).
MAX_SHAPE_BYTES = (MAX_DIMS + 1) * 8
#: Most bytes one array may hold (numpy's limit).
MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)


class Transfer:
    """Sends and receives of one operation ``op`` (a wire code) of group ``group``, call number ``seq``."""

    def __init__(
        self,
        links: Links,
        members: tuple[int, ...],
        ring: tuple[int, ...],
        group: int,
        op: int,
        seq: int,
        *,
        kind: Kind = Kind.COLLECTIVE,
        tag: int = 0,
    ):
        self.links, self.members, self.ring = links, members, ring
        self.size = len(members)
        self.rank = members.index(links.rank)
        self.position = ring.index(self.rank)
        self.next = ring[(self.position + 1) % self.size]
        self.prev = ring[(self.position - 1) % self.size]
        self.group, self.op, self.seq, self.kind, self.tag = group, op, seq, kind, tag
        self._sends: collections.deque[Future] = collections.deque()

    def _header(self, nbytes: int, dtype: np.dtype) -> Header:
        return Header(self.kind, self.op, nbytes, dtype_code(dtype), group=self.group, tag=self.tag, seq=self.seq)

    @property
    def _key(self) -> tuple:
        return (self.kind, self.group, self.tag if self.kind == Kind.MESSAGE else self.seq)

    def send(self, peer: int, array: np.ndarray, *, dtype: np.dtype | None = None) -> None:
        """Queues ``array``'s bytes (1-D contiguous) to group rank ``peer``; it must not change until flushed."""
        self._sends.append(self.links.link(self.members[peer]).send(*self._frame(array, dtype)))

    def _frame(self, array: np.ndarray, dtype: np.dtype | None = None) -> tuple[Header, memoryview]:
        """``array``'s bytes (1-D contiguous) as a frame of this transfer, its header saying ``dtype`` (or its own)."""
        return self._header(array.nbytes, array.dtype if dtype is None else dtype), array.reshape(-1).view(
            np.uint8
        ).data

    def recv(self, peer: int, out: np.ndarray) -> np.ndarray:
        """Receives exactly ``out``'s dtype and size from group rank ``peer`` into ``out`` (1-D contiguous)."""
        self._surface_failed_sends()
        self.links.link(self.members[peer]).receive(self._key, self.op, out, None)
        return out

    def send_array(self, peer: int, array: np.ndarray) -> None:
        """Queues ``array`` with its dtype and shape: a frame of its shape, then its bytes, in one write."""
        array = np.ascontiguousarray(array)
        if array.ndim > MAX_DIMS:
            raise ValueError(f"Expected an array of at most {MAX_DIMS} dimensions. Received: shape {array.shape}")
        shape = np.array([array.ndim, *array.shape], np.int64)
        frames = [self._frame(shape, array.dtype), self._frame(array)]
        self._sends.append(self.links.link(self.members[peer]).send_frames(frames))

    def recv_array(self, peer: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """The array group rank ``peer`` sent with :meth:`send_array`; into ``out`` when given (it must match).

        A malformed shape frame (its length, dtype or shape) is a CollectiveError naming ``peer``, as any malformed
        frame is: the communicator fails, whatever numpy would have made of it."""
        self._surface_failed_sends()
        link = self.links.link(self.members[peer])
        header, meta = link.receive(self._key, self.op, None, None, most=MAX_SHAPE_BYTES)
        malformed = f"rank {self.links.rank}: malformed array header from rank {self.members[peer]}"
        dims = meta.view(np.int64) if meta.nbytes % 8 == 0 else np.empty(0, np.int64)
        if not 1 <= dims.size <= MAX_DIMS + 1 or dims[0] != dims.size - 1 or (dims[1:] < 0).any():
            raise CollectiveError(f"{malformed}: shape frame {dims.tolist()}")
        try:
            dtype = dtype_of(header.dtype)
        except FrameError as exc:
            raise CollectiveError(f"{malformed}: {exc}") from None
        shape = tuple(int(d) for d in dims[1:])
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > MAX_ARRAY_BYTES:
            raise CollectiveError(f"{malformed}: a {dtype} array of shape {shape} would hold {nbytes} bytes")
        if out is None:
            try:
                out = np.empty(shape, dtype)
            except MemoryError:
                raise CollectiveError(
                    f"rank {self.links.rank}: no memory for the {dtype} array of shape {shape} ({nbytes} bytes) "
                    f"announced from rank {self.members[peer]}"
                ) from None
        elif out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise CollectiveError(
                f"rank {self.links.rank}: rank {self.members[peer]} sent a {dtype} array of shape {shape}; "
                f"expected one like `out` ({out.dtype}, {out.shape}, C-contiguous)"
            )
        link.receive(self._key, self.op, out.reshape(-1), None)
        return out

    def _surface_failed_sends(self) -> None:
        while self._sends and self._sends[0].done():
            self._sends.popleft().result()

    def flush(self) -> None:
        """Waits until everything queued has been sent."""
        while self._sends:
            self._sends.popleft().result()

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:  # a failed call's sends are the failure's to clean up (the links close)
            self.flush()
