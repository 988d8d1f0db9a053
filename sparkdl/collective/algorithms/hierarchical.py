"""The hierarchical allreduce: within each host through shared memory, across hosts by a ring of one rank per host.

As Horovod's hierarchical allreduce: every host's ranks reduce through their
shared-memory segment, so each of them holds the host's sum; local rank l
then allreduces slice l of it with the ranks of local rank l on the other
hosts (a TCP ring, one rank per host, all slices at once over separate
links); finally each local rank shares its finished slice with the others of
its host through the segment. Hosts must hold equal numbers of ranks.
"""

from __future__ import annotations

import numpy as np

from sparkdl.collective.algorithms.base import SEGMENT_OP, Algorithm, Sharing
from sparkdl.collective.algorithms.ring import chunk_bounds
from sparkdl.collective.api import ReduceOp
from sparkdl.collective.cost import collectives as counted


def allreduce(shared, cross, flat: np.ndarray, out: np.ndarray, op_name: str, cross_op) -> None:
    """``shared``: this host's SharedMemoryGroup; ``cross``: the communicator of this local rank across hosts."""
    shared.allreduce(flat, op_name, out)
    if cross.size == 1:
        return
    bounds = chunk_bounds(out.size, shared.local_size)
    mine = out[bounds[shared.local_rank] : bounds[shared.local_rank + 1]]
    cross.allreduce(mine, cross_op, out=mine, algorithm="ring")
    for local_rank in range(shared.local_size):
        part = out[bounds[local_rank] : bounds[local_rank + 1]]
        shared.broadcast(part, local_rank, part)


class Hierarchical(Algorithm):
    """The allreduce wherever the ranks share hosts in equal numbers (before the tree's, whatever the size)."""

    name = "hierarchical"
    operations = frozenset({"allreduce"})
    costs = {"allreduce": counted.hierarchical_allreduce}
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
