"""sparkdl's own backend: every operation of the protocol over authenticated TCP links and, within a host, shared memory.

Topology and algorithm are apart: the links (:mod:`.transport.mesh`) connect any two
ranks, the ring's at connect and the others on first use; the host map
(:mod:`.topology`) orders rings host by host and groups the ranks of a host
around one shared-memory segment (:mod:`.shm`); each operation checks its
arguments, then runs the registered algorithm asked for (per call, or per
communicator) or chosen by size and topology (:mod:`.algorithms`). Subgroups (:meth:`split`, :meth:`local`,
:meth:`cross`) reuse the job's links; their frames carry their own group id.
Each communicator whose ranks share hosts in equal numbers opens a segment of its
own among its ranks of this host (as it is made: collective), since communicators
run their operations side by side and a segment's counters order one stream.

Any failure poisons the whole communicator, subgroups included: the other
ranks are now out of step. Each peer is told why (an ABORT frame), so every
rank's error names the operation and the rank where it started.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import traceback
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from sparkdl.collective import algorithms, shm
from sparkdl.collective.algorithms import Algorithm
from sparkdl.collective.algorithms.ring import chunk_bounds
from sparkdl.collective.api import OP_CODES, OPERATION_NAMES, Capabilities, ReduceOp, operation_name
from sparkdl.collective.base import BaseCommunicator, check_reduce_op, output_array
from sparkdl.collective.topology import Topology
from sparkdl.collective.transport.mesh import Links, Listener
from sparkdl.collective.transport.transfer import Transfer
from sparkdl.net.errors import CollectiveError
from sparkdl.net.frames import Kind, dtype_code, dtype_name


class _Capabilities:
    """The backend's :class:`Capabilities`, its algorithms the ones registered when it is read."""

    def __init__(self) -> None:
        self._last = Capabilities(backend="sparkdl", operations=frozenset(OPERATION_NAMES), algorithms=frozenset())

    def __get__(self, instance: object, owner: type) -> Capabilities:
        if self._last.algorithms is not algorithms.names():
            self._last = dataclasses.replace(self._last, algorithms=algorithms.names())
        return self._last


class _Job:
    """What all communicators of one rank share: the links, the host map, the segments, the first failure."""

    def __init__(self, links: Links, topology: Topology, secret: bytes, timeout: float, shared_memory: bool):
        self.links, self.topology, self.secret, self.timeout = links, topology, secret, timeout
        self.shared_memory = shared_memory and shm.available()  # whether ranks of one host may share segments
        # every communicator's segment, closed ones too: their counters make up bytes_sent's "shm"
        self.segments: list[shm.SharedMemoryGroup] = []
        self.failure: BaseException | None = None

    def fail(self, exc: BaseException, why: str) -> None:
        """Poisons every communicator of this rank: its peers are told ``why``, every segment is closed.

        Called as ``exc`` leaves the operation: the frames it left are done, and their locals (views of a segment
        among them) are dropped, so that the segment is unmapped now rather than with the exception."""
        traceback.clear_frames(exc.__traceback__)
        self.failure = exc
        self.links.close(reason=f"rank {self.links.rank} failed in {why}: {exc}")
        self.close_segments()

    def close_segments(self) -> None:
        for segment in self.segments:
            segment.close()


class SparkdlCommunicator(BaseCommunicator):
    """Every operation among ``members`` (global ranks); this process is ``rank`` of them. See :meth:`connect`."""

    capabilities = _Capabilities()

    def __init__(self, job: _Job, members: Sequence[int], group: int, algorithm: str | None):
        super().__init__()
        self._job, self.members, self.group, self.algorithm = job, tuple(members), group, algorithm
        self.size = len(self.members)
        self.rank = self.members.index(job.links.rank)
        self._ring = job.topology.ring(self.members)
        self._shared: shm.SharedMemoryGroup | None = None  # this communicator's segment, see _open_segment
        self._seq = 0
        self._splits = 0
        self._subgroups: dict[str, SparkdlCommunicator] = {}
        # One of each per communicator, as a subgroup's operations run beside the parent's:
        self._scratch = _KeptBuffer()  # received segments land here
        self._work = _KeptBuffer()  # a reduce-scatter's partial sums

    @classmethod
    def connect(
        cls,
        rank: int,
        addresses: Sequence[str],
        listener: Listener,
        secret: bytes,
        timeout: float = 300.0,
        *,
        encrypt: bool = False,
        hosts: Sequence[str] | None = None,
        shared_memory: bool = True,
        algorithm: str | None = None,
    ) -> SparkdlCommunicator:
        """Joins the job of ``len(addresses)`` ranks as ``rank``; ``addresses[i]`` is rank i's listener. Collective:
        it returns once every rank has joined.

        ``hosts[i]`` names rank i's host (by default the host of its address); ranks of one host exchange through
        shared memory unless ``shared_memory=False``. ``timeout`` bounds every single wait; ``encrypt`` seals
        every link; ``algorithm`` is the default for the operations that have it.
        """
        if algorithm is not None and algorithm not in algorithms.names():
            raise ValueError(
                f"Expected `algorithm` to be one of {sorted(algorithms.names())}. Received: algorithm={algorithm!r}"
            )
        hosts = list(hosts) if hosts is not None else [address.rsplit(":", 1)[0] for address in addresses]
        if len(hosts) != len(addresses):
            raise ValueError(f"Expected one host per address ({len(addresses)}). Received: {len(hosts)} hosts")
        links = Links(rank, addresses, listener, secret, timeout, encrypt=encrypt)
        job = _Job(links, Topology(tuple(hosts)), secret, timeout, shared_memory)
        try:
            comm = cls(job, range(len(addresses)), 0, algorithm)
            if comm.size > 1:
                links.open(sorted({comm._ring_neighbour(+1), comm._ring_neighbour(-1)}))
            comm._open_segment()
            if comm.size > 1:  # as NCCL's init: no rank returns (and may leave) before every rank is linked
                comm.barrier()
        except BaseException as exc:
            links.close(reason=f"rank {rank} failed to join the job: {exc}")
            job.close_segments()
            raise
        return comm

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Payload bytes (sent, received) so far between this rank and each linked peer (global ranks), over TCP."""
        return self._job.links.traffic()

    def bytes_sent(self) -> dict[str, dict[str, dict[str, int]]]:
        """The payload bytes this rank has sent so far, subgroups included, by transport, operation and dtype:
        ``{"tcp": {"allreduce": {"float32": n}}, "shm": {...}}``. ``tcp``: the frames' bytes over its links;
        ``shm``: the bytes it wrote into its host's segment for its peers, once per peer reading them
        (:attr:`shm.SharedMemoryGroup.delivered`). ``send`` and ``recv`` count under ``send``."""
        by_transport: dict[str, dict[str, dict[str, int]]] = {"tcp": {}, "shm": {}}
        for (op, dtype), nbytes in self._job.links.sent_by_operation().items():
            by_transport["tcp"].setdefault(operation_name(op), {})[dtype_name(dtype)] = nbytes
        delivered: collections.Counter[tuple[str, str]] = collections.Counter()
        for segment in self._job.segments:
            delivered.update(segment.delivered)
        for (name, dtype_text), nbytes in delivered.items():
            by_transport["shm"].setdefault(name, {})[dtype_text] = nbytes
        return by_transport

    def _ring_neighbour(self, step: int) -> int:
        position = self._ring.index(self.rank)
        return self.members[self._ring[(position + step) % self.size]]

    # -- groups -------------------------------------------------------------------------------------

    def split(self, ranks: Sequence[int]) -> SparkdlCommunicator | None:
        """A communicator of ``ranks`` (of this one, in that order); all ranks call it, others get None."""
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.size for r in ranks) or not ranks:
            raise ValueError(f"Expected distinct ranks in 0..{self.size - 1}. Received: ranks={ranks}")
        self._splits += 1
        group = _group_id(self.group, f"split {self._splits} {ranks}")
        if self.rank not in ranks:
            return None
        return self._subgroup([self.members[r] for r in ranks], group)

    def local(self) -> SparkdlCommunicator:
        return self._derived("local", self._job.topology.local(self.members, self._job.links.rank))

    def cross(self) -> SparkdlCommunicator:
        return self._derived("cross", self._job.topology.cross(self.members, self._job.links.rank))

    def _derived(self, name: str, members: list[int]) -> SparkdlCommunicator:
        if name not in self._subgroups:
            self._subgroups[name] = self._subgroup(members, _group_id(self.group, f"{name} {members}"))
        return self._subgroups[name]

    def _subgroup(self, members: list[int], group: int) -> SparkdlCommunicator:
        """A communicator of ``members`` with its segment open (collective among its ranks on this host)."""
        job = self._job
        if job.failure is not None:
            raise CollectiveError(
                f"rank {self.rank}: a subgroup of a communicator that already failed: {job.failure}"
            ) from job.failure
        subgroup = SparkdlCommunicator(job, members, group, self.algorithm)
        try:
            subgroup._open_segment()
        except BaseException as exc:
            job.fail(exc, f"the shared memory setup of subgroup {members}")
            raise
        return subgroup

    def _open_segment(self) -> None:
        """Opens this communicator's own segment among its ranks on this host, where every host holds as many of its
        ranks and this one holds more than one; local rank 0 creates it, the others join (collective among them).
        Its name is the job secret's, this host's and this communicator's, so no other job's or group's meets it, and
        this attempt's: every rank's listener address (new ports each time a stage is retried), so a name seen in
        /proc/net/unix and squatted by another user is never used again."""
        job, rank = self._job, self._job.links.rank
        local = job.topology.local(self.members, rank)
        if job.shared_memory and len(local) > 1 and job.topology.balanced(self.members):
            self._shared = _open_shared(local, rank, job, self.group)
            job.segments.append(self._shared)

    # -- running an operation -----------------------------------------------------------------------

    def _run(self, name: str, **arguments: Any) -> Any:
        job = self._job
        if job.failure is not None:
            raise CollectiveError(
                f"rank {self.rank}: {name} on a communicator that already failed: {job.failure}"
            ) from job.failure
        try:
            return getattr(self, "_" + name)(**arguments)
        except (ValueError, TypeError):
            raise  # refused before anything was sent: the ranks are still in step
        except BaseException as exc:
            job.fail(exc, name)
            raise

    # -- what the algorithms use (algorithms.base) ------------------------------------------------------

    def transfer(self, name: str, *, kind: Kind = Kind.COLLECTIVE, tag: int = 0) -> Transfer:
        """The frames of one call of operation ``name``: a collective's take the next sequence number."""
        seq = 0
        if kind == Kind.COLLECTIVE:
            seq, self._seq = self._seq, (self._seq + 1) & 0xFFFFFFFF
        return Transfer(self._job.links, self.members, self._ring, self.group, OP_CODES[name], seq, kind=kind, tag=tag)

    def scratch(self, nbytes: int) -> np.ndarray:
        """At least ``nbytes`` kept between calls, where received segments land."""
        return self._scratch.at_least(nbytes)

    def work(self, nbytes: int) -> np.ndarray:
        """At least ``nbytes`` kept between calls, apart from :meth:`scratch` (a reduce-scatter's partial sums)."""
        return self._work.at_least(nbytes)

    @property
    def segment(self) -> shm.SharedMemoryGroup | None:
        """This communicator's shared-memory segment among its ranks of this host, if it has one."""
        return self._shared

    def _algorithm(self, name: str, requested: str | None, nbytes: int) -> Algorithm:
        # A communicator of one rank moves nothing, so any algorithm "runs" on it.
        shared_memory = self._shared is not None or self.size == 1
        one_host = self._shared is not None and self._shared.ranks == list(self.members)
        return algorithms.algorithm(algorithms.choose(name, requested, self.algorithm, nbytes, shared_memory, one_host))

    def _root(self, root: int) -> int:
        if not 0 <= root < self.size:
            raise ValueError(f"Expected `root` in 0..{self.size - 1}. Received: root={root}")
        return root

    # -- the operations: checked here, run by the algorithm chosen ----------------------------------------

    def _allreduce(self, array, op, out, algorithm) -> np.ndarray:
        source, flat = _flat(array)
        check_reduce_op(op, source.dtype)
        result = output_array(out, source.shape, source.dtype)
        out_flat = result.reshape(-1)
        chosen = self._algorithm("allreduce", algorithm, source.nbytes)
        if self.size == 1:
            out_flat[...] = flat
        else:
            chosen.allreduce(self, flat, out_flat, op)
        if op is ReduceOp.MEAN:
            np.true_divide(out_flat, self.size, out=out_flat)
        return result

    def _reduce(self, array, root, op, algorithm) -> np.ndarray | None:
        source, flat = _flat(array)
        check_reduce_op(op, source.dtype)
        root = self._root(root)
        out = np.empty_like(flat)
        if self.size == 1:
            out[...] = flat
        else:
            self._algorithm("reduce", algorithm, source.nbytes).reduce(self, flat, out, root, op)
        if self.rank != root:
            return None
        if op is ReduceOp.MEAN:
            np.true_divide(out, self.size, out=out)
        return out.reshape(source.shape)

    def _broadcast(self, array, root, algorithm) -> np.ndarray:
        source = np.asarray(array)
        dtype_code(source.dtype)
        root = self._root(root)
        out = np.array(source, copy=True, order="C").reshape(-1)
        if self.size > 1:
            self._algorithm("broadcast", algorithm, source.nbytes).broadcast(self, out, root)
        return out.reshape(source.shape)

    def _allgather(self, array, out, algorithm) -> np.ndarray:
        source = np.asarray(array)
        dtype_code(source.dtype)
        out = output_array(out, (self.size, *source.shape), source.dtype)
        rows = out.reshape(self.size, source.size)
        rows[self.rank] = source.reshape(-1)
        chosen = self._algorithm("allgather", algorithm, source.nbytes)
        if self.size > 1:
            chosen.allgather(self, rows)
        return out

    def _reduce_scatter(self, array, op, out, algorithm) -> np.ndarray:
        source, flat = _flat(array)
        check_reduce_op(op, source.dtype)
        if source.ndim == 0:
            raise ValueError("Expected an array of at least one dimension to scatter by rows. Received: a scalar")
        chosen = self._algorithm("reduce_scatter", algorithm, source.nbytes)
        rows = source.shape[0]
        row_bounds = chunk_bounds(rows, self.size)
        row = flat.size // rows if rows else 0
        bounds = [b * row for b in row_bounds]  # by elements of ``flat``
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        result = output_array(out, (row_bounds[self.rank + 1] - row_bounds[self.rank], *source.shape[1:]), source.dtype)
        if self.size == 1:
            result.reshape(-1)[...] = flat[lo:hi]
        else:
            chosen.reduce_scatter(self, flat, result.reshape(-1), bounds, op)
        if op is ReduceOp.MEAN:
            np.true_divide(result, self.size, out=result)
        return result

    def _gather(self, array, root) -> list[np.ndarray] | None:
        source = np.asarray(array)
        dtype_code(source.dtype)
        return self._algorithm("gather", None, source.nbytes).gather(self, source, self._root(root))

    def _scatter(self, arrays, root) -> np.ndarray:
        root = self._root(root)
        if self.rank == root:
            arrays = [np.asarray(a) for a in arrays] if arrays is not None else []
            if len(arrays) != self.size:
                raise ValueError(f"Expected {self.size} arrays to scatter from rank {root}. Received: {len(arrays)}")
            for a in arrays:
                dtype_code(a.dtype)
        return self._algorithm("scatter", None, 0).scatter(self, arrays, root)

    def _allgather_v(self, array) -> list[np.ndarray]:
        source = np.asarray(array)
        dtype_code(source.dtype)
        return self._algorithm("allgather_v", None, source.nbytes).allgather_v(self, source)

    def _alltoall(self, arrays) -> list[np.ndarray]:
        arrays = [np.asarray(a) for a in arrays]
        if len(arrays) != self.size:
            raise ValueError(f"Expected {self.size} arrays, one per rank. Received: {len(arrays)}")
        for a in arrays:
            dtype_code(a.dtype)
        return self._algorithm("alltoall", None, sum(a.nbytes for a in arrays)).alltoall(self, arrays)

    def _barrier(self) -> None:
        if self.size > 1:
            self._algorithm("barrier", None, 0).barrier(self)

    def _send(self, array, dest, tag) -> None:
        source = np.asarray(array)
        dtype_code(source.dtype)
        dest = self._peer(dest, "dest")
        self._algorithm("send", None, source.nbytes).send(self, source, dest, _tag(tag))

    def _recv(self, source, tag, out) -> np.ndarray:
        source = self._peer(source, "source")
        return self._algorithm("recv", None, 0).recv(self, source, _tag(tag), out)

    def _peer(self, peer: int, name: str) -> int:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"Expected `{name}` to be another rank in 0..{self.size - 1}. Received: {name}={peer}")
        return peer

    def _close(self) -> None:
        if self.group != 0:  # a subgroup's links are the job's; its segment is its own
            if self._shared is not None:
                self._shared.close()
            return
        self._job.links.close()
        self._job.close_segments()


def _flat(array) -> tuple[np.ndarray, np.ndarray]:
    source = np.asarray(array)
    dtype_code(source.dtype)
    return source, np.ascontiguousarray(source).reshape(-1)


def _tag(tag: int) -> int:
    if not 0 <= tag <= 0xFFFFFFFF:
        raise ValueError(f"Expected `tag` in 0..2**32-1. Received: tag={tag}")
    return tag


def _group_id(parent: int, name: str) -> int:
    """A subgroup's id on the wire: the same on every member, distinct from its parent's and siblings'."""
    return zlib.crc32(f"{parent} {name}".encode()) or 1


def _open_shared(local: list[int], rank: int, job: _Job, group: int) -> shm.SharedMemoryGroup:
    attempt = " ".join(job.links.addresses)
    about = f" shared memory {job.topology.hosts[rank]} group {group} listeners {attempt}"
    name = hashlib.sha256(job.secret + about.encode()).hexdigest()[:32]
    return shm.SharedMemoryGroup.open(local.index(rank), local, name=name, secret=job.secret, timeout=job.timeout)


class _KeptBuffer:
    """Bytes kept between a communicator's calls (its operations run one at a time), grown to the largest size
    asked for: no allocation, and no page faults, per call."""

    def __init__(self) -> None:
        self._bytes = np.empty(0, np.uint8)

    def at_least(self, nbytes: int) -> np.ndarray:
        if self._bytes.nbytes < nbytes:
            self._bytes = np.empty(nbytes, np.uint8)
        return self._bytes
