"""The naive algorithms: everything through one root (a star), or every rank to every other directly.

The lectures' baseline: a naive allreduce gathers all arrays at rank 0,
reduces there and sends the result back, so the root moves 2(N-1)K bytes
while each other rank moves 2K; compare :mod:`.ring`, where every rank
moves 2(N-1)K/N. Gather, scatter, the unequal allgather and alltoall are
naturally direct: each array goes straight from its sender to its receiver.
Each operation's counts for the cost model are here too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparkdl.collective.algorithms.base import COMBINE, Algorithm
from sparkdl.collective.api import ReduceOp
from sparkdl.collective.cost.model import Cost
from sparkdl.collective.exchange import Exchange
from sparkdl.net.frames import Kind


def reduce(ex: Exchange, flat: np.ndarray, out: np.ndarray, root: int, combine, scratch: np.ndarray) -> None:
    """``out`` on ``root`` gets every rank's ``flat`` combined, received one whole array at a time."""
    if ex.rank != root:
        ex.send(root, flat)
        return
    out[...] = flat
    received = scratch[: flat.nbytes].view(flat.dtype)
    for peer in range(ex.size):
        if peer != root:
            combine(out, ex.recv(peer, received), out=out)


def broadcast(ex: Exchange, out: np.ndarray, root: int) -> None:
    if ex.rank == root:
        for peer in range(ex.size):
            if peer != root:
                ex.send(peer, out)
    else:
        ex.recv(root, out)


def allreduce(ex: Exchange, flat: np.ndarray, out: np.ndarray, combine, scratch: np.ndarray) -> None:
    reduce(ex, flat, out, 0, combine, scratch)
    ex.flush()
    broadcast(ex, out, 0)


def allgather(ex: Exchange, rows: np.ndarray) -> None:
    """Every rank sends its row to every other rank."""
    for offset in range(1, ex.size):
        ex.send((ex.rank + offset) % ex.size, rows[ex.rank])
    for offset in range(1, ex.size):
        peer = (ex.rank - offset) % ex.size
        ex.recv(peer, rows[peer])


def gather(ex: Exchange, array: np.ndarray, root: int) -> list[np.ndarray] | None:
    if ex.rank != root:
        ex.send_array(root, array)
        return None
    return [np.array(array, copy=True) if peer == root else ex.recv_array(peer) for peer in range(ex.size)]


def scatter(ex: Exchange, arrays, root: int) -> np.ndarray:
    if ex.rank != root:
        return ex.recv_array(root)
    for peer in range(ex.size):
        if peer != root:
            ex.send_array(peer, arrays[peer])
    return np.array(arrays[root], copy=True)


def alltoall(ex: Exchange, arrays) -> list[np.ndarray]:
    """``arrays[j]`` to rank j, pairwise: at step i send to rank+i while receiving from rank-i."""
    received: list[np.ndarray] = [np.empty(0)] * ex.size
    received[ex.rank] = np.array(arrays[ex.rank], copy=True)
    for offset in range(1, ex.size):
        ex.send_array((ex.rank + offset) % ex.size, arrays[(ex.rank + offset) % ex.size])
        source = (ex.rank - offset) % ex.size
        received[source] = ex.recv_array(source)
    return received


# -- the cost model's counts (sparkdl.collective.cost) -----------------------------------------------------------


def allreduce_cost(n: int, k: float) -> Cost:
    """Naive allreduce: every rank's array to one root, reduced there, the result sent back to each.

    The lectures' baseline (Thakur et al. 2005, the "reduce followed by broadcast" with a linear
    reduce and broadcast): the root receives (N-1)K and then sends (N-1)K, one after the other, so its
    link carries 2(N-1)K on the critical path while each other rank moves 2K:
    T = 2 alpha + 2(N-1) K beta + (N-1) K gamma. The root's traffic grows with N; a ring rank's does not.
    """
    if n < 2:
        return Cost(0, 0)
    return Cost(
        steps=2,
        link_bytes=2 * (n - 1) * k,
        memory_bytes=(n - 1) * k,
        messages=n - 1,
        rank_sent=(n - 1) * k,
        rank_received=(n - 1) * k,
        total_bytes=2 * (n - 1) * k,
    )


def allgather_cost(n: int, k: float) -> Cost:
    """Direct allgather of K bytes in all: each rank sends its K/N to every other rank itself.

    The same bytes as the ring, sent as N-1 messages by each rank (Thakur et al. 2005: a direct
    algorithm pays (N-1) alpha): T = (N-1) alpha + (N-1)/N K beta.
    """
    if n < 2:
        return Cost(0, 0)
    per_rank = (n - 1) * k / n
    return Cost(n - 1, per_rank, 0.0, n - 1, per_rank, per_rank, n * per_rank)


def broadcast_cost(n: int, k: float) -> Cost:
    """Linear broadcast: the root sends K to each of the N-1 others: T = (N-1)(alpha + K beta) + K gamma."""
    if n < 2:
        return Cost(0, 0)
    return Cost(n - 1, (n - 1) * k, k, n - 1, (n - 1) * k, k, (n - 1) * k)


class Naive(Algorithm):
    """Through one root (allreduce, reduce, broadcast) or directly (the rest): only when asked for, except where it
    is the operation's one algorithm (gather, scatter, allgather_v, alltoall, send and recv)."""

    name = "naive"
    operations = frozenset(
        {
            "allreduce",
            "broadcast",
            "reduce",
            "allgather",
            "gather",
            "scatter",
            "allgather_v",
            "alltoall",
            "send",
            "recv",
        }
    )
    costs = {"allreduce": allreduce_cost, "broadcast": broadcast_cost, "allgather": allgather_cost}

    def allreduce(self, comm, flat: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        with comm.exchange("allreduce") as ex:
            allreduce(ex, flat, out, COMBINE[op], comm.scratch(flat.nbytes))

    def reduce(self, comm, flat: np.ndarray, out: np.ndarray, root: int, op: ReduceOp) -> None:
        with comm.exchange("reduce") as ex:
            reduce(ex, flat, out, root, COMBINE[op], comm.scratch(flat.nbytes))

    def broadcast(self, comm, out: np.ndarray, root: int) -> None:
        with comm.exchange("broadcast") as ex:
            broadcast(ex, out, root)

    def allgather(self, comm, rows: np.ndarray) -> None:
        with comm.exchange("allgather") as ex:
            allgather(ex, rows)

    def gather(self, comm, array: np.ndarray, root: int) -> list[np.ndarray] | None:
        with comm.exchange("gather") as ex:
            return gather(ex, array, root)

    def scatter(self, comm, arrays: Sequence[np.ndarray], root: int) -> np.ndarray:
        with comm.exchange("scatter") as ex:
            return scatter(ex, arrays, root)

    def allgather_v(self, comm, array: np.ndarray) -> list[np.ndarray]:
        with comm.exchange("allgather_v") as ex:
            return alltoall(ex, [array] * ex.size)

    def alltoall(self, comm, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        with comm.exchange("alltoall") as ex:
            return alltoall(ex, arrays)

    def send(self, comm, array: np.ndarray, dest: int, tag: int) -> None:
        with comm.exchange("send", kind=Kind.MESSAGE, tag=tag) as ex:
            ex.send_array(dest, array)

    def recv(self, comm, source: int, tag: int, out: np.ndarray | None) -> np.ndarray:
        return comm.exchange("send", kind=Kind.MESSAGE, tag=tag).recv_array(source, out=out)
