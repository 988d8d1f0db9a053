"""Binomial-tree algorithms: log2(N) rounds, for small arrays where a ring's N-1 latencies dominate.

Ranks are numbered relative to the root (v = (rank - root) mod N); in the
round of ``mask`` a rank below ``mask`` sends to v + mask (broadcast), or a
rank with that bit set sends its partial result to v - mask (reduce).
"""

from __future__ import annotations

import numpy as np

from sparkdl.collective.algorithms.base import COMBINE, Algorithm, Sharing
from sparkdl.collective.api import ReduceOp
from sparkdl.collective.cost import collectives as counted
from sparkdl.collective.exchange import Exchange

#: Below this many bytes a tree's log2(N) rounds beat a ring's 2(N-1) steps.
SMALL_BYTES = 64 << 10


def broadcast(ex: Exchange, out: np.ndarray, root: int) -> None:
    size, v = ex.size, (ex.rank - root) % ex.size
    mask = 1
    while mask < size:
        if v < mask:
            if v + mask < size:
                ex.send((v + mask + root) % size, out)
        elif v < 2 * mask:
            ex.recv((v - mask + root) % size, out)
        mask <<= 1


def reduce(ex: Exchange, flat: np.ndarray, out: np.ndarray, root: int, combine, scratch: np.ndarray) -> None:
    """``out`` on ``root`` gets the reduction; on the other ranks it holds a partial one, sent on."""
    size, v = ex.size, (ex.rank - root) % ex.size
    out[...] = flat
    received = scratch[: flat.nbytes].view(flat.dtype)
    mask = 1
    while mask < size:
        if v & mask:
            ex.send((v - mask + root) % size, out)
            return
        if v + mask < size:
            combine(out, ex.recv((v + mask + root) % size, received), out=out)
        mask <<= 1


def allreduce(ex: Exchange, flat: np.ndarray, out: np.ndarray, combine, scratch: np.ndarray) -> None:
    reduce(ex, flat, out, 0, combine, scratch)
    ex.flush()  # a partial sum still being sent must not be overwritten by the broadcast
    broadcast(ex, out, 0)


class Tree(Algorithm):
    """The binomial tree's allreduce, broadcast, reduce and barrier; wanted for allreduces and broadcasts of fewer
    than :data:`SMALL_BYTES`."""

    name = "tree"
    operations = frozenset({"allreduce", "broadcast", "reduce", "barrier"})
    costs = {"allreduce": counted.tree_allreduce, "broadcast": counted.tree_broadcast}
    precedence = 1

    def wanted(self, operation: str, nbytes: int, sharing: Sharing) -> bool:
        return operation in ("allreduce", "broadcast") and nbytes < SMALL_BYTES

    def allreduce(self, comm, flat: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        with comm.exchange("allreduce") as ex:
            allreduce(ex, flat, out, COMBINE[op], comm.scratch(flat.nbytes))

    def reduce(self, comm, flat: np.ndarray, out: np.ndarray, root: int, op: ReduceOp) -> None:
        with comm.exchange("reduce") as ex:
            reduce(ex, flat, out, root, COMBINE[op], comm.scratch(flat.nbytes))

    def broadcast(self, comm, out: np.ndarray, root: int) -> None:
        with comm.exchange("broadcast") as ex:
            broadcast(ex, out, root)

    def barrier(self, comm) -> None:
        # A tree allreduce of one byte, in frames of its own code: a barrier facing another rank's allreduce is a
        # desync named as such, not a silently matched allreduce.
        flag = np.zeros(1, np.uint8)
        with comm.exchange("barrier") as ex:
            allreduce(ex, flag, np.empty_like(flag), np.maximum, comm.scratch(flag.nbytes))
