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

from sparkdl.collective.algorithms.rooted import Rooted
from sparkdl.collective.cost.model import Cost
from sparkdl.collective.transport.transfer import Transfer
from sparkdl.net.frames import Kind


def reduce(tx: Transfer, flat: np.ndarray, out: np.ndarray, root: int, combine, scratch: np.ndarray) -> None:
    """``out`` on ``root`` gets every rank's ``flat`` combined, received one whole array at a time."""
    if tx.rank != root:
        tx.send(root, flat)
        return
    out[...] = flat
    received = scratch[: flat.nbytes].view(flat.dtype)
    for peer in range(tx.size):
        if peer != root:
            combine(out, tx.recv(peer, received), out=out)


def broadcast(tx: Transfer, out: np.ndarray, root: int) -> None:
    if tx.rank == root:
        for peer in range(tx.size):
            if peer != root:
                tx.send(peer, out)
    else:
        tx.recv(root, out)


def allgather(tx: Transfer, rows: np.ndarray) -> None:
    """Every rank sends its row to every other rank."""
    for offset in range(1, tx.size):
        tx.send((tx.rank + offset) % tx.size, rows[tx.rank])
    for offset in range(1, tx.size):
        peer = (tx.rank - offset) % tx.size
        tx.recv(peer, rows[peer])


def gather(tx: Transfer, array: np.ndarray, root: int) -> list[np.ndarray] | None:
    if tx.rank != root:
        tx.send_array(root, array)
        return None
    return [np.array(array, copy=True) if peer == root else tx.recv_array(peer) for peer in range(tx.size)]


def scatter(tx: Transfer, arrays, root: int) -> np.ndarray:
    if tx.rank != root:
        return tx.recv_array(root)
    for peer in range(tx.size):
        if peer != root:
            tx.send_array(peer, arrays[peer])
    return np.array(arrays[root], copy=True)


def alltoall(tx: Transfer, arrays) -> list[np.ndarray]:
    """``arrays[j]`` to rank j, pairwise: at step i send to rank+i while receiving from rank-i."""
    received: list[np.ndarray] = [np.empty(0)] * tx.size
    received[tx.rank] = np.array(arrays[tx.rank], copy=True)
    for offset in range(1, tx.size):
        tx.send_array((tx.rank + offset) % tx.size, arrays[(tx.rank + offset) % tx.size])
        source = (tx.rank - offset) % tx.size
        received[source] = tx.recv_array(source)
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


class Naive(Rooted):
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

    reduce_over = staticmethod(reduce)
    broadcast_over = staticmethod(broadcast)

    def allgather(self, comm, rows: np.ndarray) -> None:
        with comm.transfer("allgather") as tx:
            allgather(tx, rows)

    def gather(self, comm, array: np.ndarray, root: int) -> list[np.ndarray] | None:
        with comm.transfer("gather") as tx:
            return gather(tx, array, root)

    def scatter(self, comm, arrays: Sequence[np.ndarray], root: int) -> np.ndarray:
        with comm.transfer("scatter") as tx:
            return scatter(tx, arrays, root)

    def allgather_v(self, comm, array: np.ndarray) -> list[np.ndarray]:
        with comm.transfer("allgather_v") as tx:
            return alltoall(tx, [array] * tx.size)

    def alltoall(self, comm, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        with comm.transfer("alltoall") as tx:
            return alltoall(tx, arrays)

    def send(self, comm, array: np.ndarray, dest: int, tag: int) -> None:
        with comm.transfer("send", kind=Kind.MESSAGE, tag=tag) as tx:
            tx.send_array(dest, array)

    def recv(self, comm, source: int, tag: int, out: np.ndarray | None) -> np.ndarray:
        return comm.transfer("send", kind=Kind.MESSAGE, tag=tag).recv_array(source, out=out)
