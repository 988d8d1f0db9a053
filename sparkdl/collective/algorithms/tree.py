"""Binomial-tree algorithms: log2(N) rounds, for small arrays where a ring's N-1 latencies dominate.

Ranks are numbered relative to the root (v = (rank - root) mod N); in the
round of ``mask`` a rank below ``mask`` sends to v + mask (broadcast), or a
rank with that bit set sends its partial result to v - mask (reduce).
Each operation's counts for the cost model are here too.
"""

from __future__ import annotations

import math

import numpy as np

from sparkdl.collective.algorithms.base import Sharing
from sparkdl.collective.algorithms.rooted import Rooted, allreduce_through_root
from sparkdl.collective.cost.model import Cost
from sparkdl.collective.transport.transfer import Transfer

#: Below this many bytes a tree's log2(N) rounds beat a ring's 2(N-1) steps.
SMALL_BYTES = 64 << 10


def broadcast(tx: Transfer, out: np.ndarray, root: int) -> None:
    size, v = tx.size, (tx.rank - root) % tx.size
    mask = 1
    while mask < size:
        if v < mask:
            if v + mask < size:
                tx.send((v + mask + root) % size, out)
        elif v < 2 * mask:
            tx.recv((v - mask + root) % size, out)
        mask <<= 1


def reduce(tx: Transfer, flat: np.ndarray, out: np.ndarray, root: int, combine, scratch: np.ndarray) -> None:
    """``out`` on ``root`` gets the reduction; on the other ranks it holds a partial one, sent on."""
    size, v = tx.size, (tx.rank - root) % tx.size
    out[...] = flat
    received = scratch[: flat.nbytes].view(flat.dtype)
    mask = 1
    while mask < size:
        if v & mask:
            tx.send((v - mask + root) % size, out)
            return
        if v + mask < size:
            combine(out, tx.recv((v + mask + root) % size, received), out=out)
        mask <<= 1


# -- the cost model's counts (sparkdl.collective.cost) -----------------------------------------------------------


def _log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def _binomial_children(n: int) -> dict[int, list[int]]:
    """The binomial tree over ranks 0..n-1 rooted at 0 (:func:`broadcast`): v's children are v + 2^j for the
    rounds 2^j after the one v received in, in the order v serves them."""
    children: dict[int, list[int]] = {v: [] for v in range(n)}
    mask = 1
    while mask < n:
        for v in range(mask):
            if v + mask < n:
                children[v].append(v + mask)
        mask <<= 1
    return children


def binomial_paths(n: int) -> tuple[float, float]:
    """(reduce, broadcast): the arrays of K bytes one after another on the critical path of sparkdl's binomial tree.

    sparkdl queues a rank's sends at once (each link has its own sender), so a broadcasting rank's children
    share its uplink and all finish c·K after it got the array (c children); a reducing rank takes its
    children's arrays one at a time on its downlink as they come. The textbook's tree, whose sends
    go one after another, largest subtree first, needs ceil(log2 N) arrays either way; here the
    broadcast needs 2, 3, 6, 10 arrays at N = 3, 4, 8, 16.
    """
    children = _binomial_children(n)
    ready: dict[int, float] = {}

    def reduced(v: int) -> float:
        if v not in ready:
            t = 0.0
            for child in sorted(children[v], key=reduced):
                t = max(t, reduced(child)) + 1
            ready[v] = t
        return ready[v]

    def broadcast_ends(v: int, t: float) -> float:
        done = t + len(children[v])
        return max([t, *(broadcast_ends(child, done) for child in children[v])])

    return reduced(0), broadcast_ends(0, 0.0)


def allreduce_cost(n: int, k: float) -> Cost:
    """Binomial-tree allreduce: a binomial reduce to rank 0 then a binomial broadcast, ceil(log2 N) rounds each.

    Thakur et al. 2005, sections 4.1 and 4.2: 2 ceil(log2 N) steps, the root receiving and then sending K
    in each round, ceil(log2 N) K reduced on the root. On the critical path, sparkdl's tree carries the
    arrays of :func:`binomial_paths` (its broadcast's sends share a rank's uplink): 2 K at N=2, 4 K at
    N=3, 5 K at N=4, 9 K at N=8, against the textbook's 2 ceil(log2 N) K. Few steps: the small-array choice.
    """
    rounds = _log2(n)
    reduce_path, broadcast_path = binomial_paths(n)
    return Cost(
        steps=2 * rounds,
        link_bytes=(reduce_path + broadcast_path) * k,
        memory_bytes=rounds * k,
        messages=rounds,
        rank_sent=rounds * k,
        rank_received=rounds * k,
        total_bytes=2 * (n - 1) * k,
    )


def broadcast_cost(n: int, k: float) -> Cost:
    """Binomial broadcast: ceil(log2 N) rounds (Thakur et al. 2005, section 4.1), the root sending K to each of
    its ceil(log2 N) children; on the critical path the arrays of :func:`binomial_paths` (a rank's children
    share its uplink), plus K of memory for the result's copy."""
    rounds = _log2(n)
    return Cost(rounds, binomial_paths(n)[1] * k, k, rounds, rounds * k, k, (n - 1) * k)


class Tree(Rooted):
    """The binomial tree's allreduce, broadcast, reduce and barrier; wanted for allreduces and broadcasts of fewer
    than :data:`SMALL_BYTES`."""

    name = "tree"
    operations = frozenset({"allreduce", "broadcast", "reduce", "barrier"})
    costs = {"allreduce": allreduce_cost, "broadcast": broadcast_cost}
    precedence = 1

    def wanted(self, operation: str, nbytes: int, sharing: Sharing) -> bool:
        return operation in ("allreduce", "broadcast") and nbytes < SMALL_BYTES

    reduce_over = staticmethod(reduce)
    broadcast_over = staticmethod(broadcast)

    def barrier(self, comm) -> None:
        # A tree allreduce of one byte, in frames of its own code: a barrier facing another rank's allreduce is a
        # desync named as such, not a silently matched allreduce.
        flag = np.zeros(1, np.uint8)
        with comm.transfer("barrier") as tx:
            allreduce_through_root(tx, self, flag, np.empty_like(flag), np.maximum, comm.scratch(flag.nbytes))
