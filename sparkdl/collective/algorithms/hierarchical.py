"""The hierarchical allreduce: within each host through shared memory, across hosts by a ring of one rank per host.

As Horovod's hierarchical allreduce: every host's ranks reduce through their
shared-memory segment, so each of them holds the host's sum; local rank l
then allreduces slice l of it with the ranks of local rank l on the other
hosts (a TCP ring, one rank per host, all slices at once over separate
links); finally each local rank shares its finished slice with the others of
its host through the segment. Hosts must hold equal numbers of ranks.
Its counts for the cost model are here too.
"""

from __future__ import annotations

import numpy as np

from sparkdl.collective.algorithms import ring
from sparkdl.collective.algorithms.base import SEGMENT_OP, Algorithm, Sharing
from sparkdl.collective.api import ReduceOp
from sparkdl.collective.cost.model import Cost


def allreduce(shared, cross, flat: np.ndarray, out: np.ndarray, op_name: str, cross_op) -> None:
    """``shared``: this host's SharedMemoryGroup; ``cross``: the communicator of this local rank across hosts."""
    shared.allreduce(flat, op_name, out)
    if cross.size == 1:
        return
    bounds = ring.chunk_bounds(out.size, shared.local_size)
    mine = out[bounds[shared.local_rank] : bounds[shared.local_rank + 1]]
    cross.allreduce(mine, cross_op, out=mine, algorithm="ring")
    for local_rank in range(shared.local_size):
        part = out[bounds[local_rank] : bounds[local_rank + 1]]
        shared.broadcast(part, local_rank, part)


def allreduce_cost(n: int, k: float, local: int = 1) -> Cost:
    """Hierarchical allreduce (Horovod's): shared memory within each of H = N/L hosts, a ring across hosts.

    The L ranks of a host reduce K through their segment; local rank l then ring-allreduces slice l
    (K/L) with local rank l of the other hosts, so the host's link carries L rings of K/L, 2(H-1)/H K in
    all, in 2(H-1) steps; each rank then copies the finished slices out of the segment. With L = 1 it is
    the ring. T = (2(H-1) + 2) alpha + 2(H-1)/H K beta + (K + (H-1)/H K/L) gamma (Sergeev and Del
    Balso, "Horovod", 2018; the two shared-memory phases counted as steps, their copies as memory bytes).
    """
    if local < 1 or n % local:
        raise ValueError(f"Expected `local` to divide n={n}. Received: local={local}")
    hosts = n // local
    if local == 1:
        return ring.allreduce_cost(n, k)
    cross = 2 * (hosts - 1) * k / hosts
    return Cost(
        steps=2 * (hosts - 1) + 2,
        link_bytes=cross,
        memory_bytes=k + (hosts - 1) * k / hosts / local,
        messages=2 * (hosts - 1) * ring.segment_count(k / local / hosts),
        rank_sent=cross / local,
        rank_received=cross / local,
        total_bytes=hosts * cross,
    )


class Hierarchical(Algorithm):
    """The allreduce wherever the ranks share hosts in equal numbers (before the tree's, whatever the size)."""

    name = "hierarchical"
    operations = frozenset({"allreduce"})
    costs = {"allreduce": allreduce_cost}
    precedence = 2

    def usable(self, sharing: Sharing) -> bool:
        return sharing.shared_memory

    def refusal(self, operation: str) -> str:
        return (
            "algorithm='hierarchical' needs ranks that share hosts in equal numbers (shared memory on); "
            "this communicator has none"
        )

    def wanted(self, operation: str, nbytes: int, sharing: Sharing) -> bool:
        return True

    def allreduce(self, comm, flat: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        cross_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
        allreduce(comm.segment, comm.cross(), flat, out, SEGMENT_OP[op], cross_op)
