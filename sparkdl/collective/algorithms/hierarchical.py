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

from sparkdl.collective.algorithms.ring import chunk_bounds


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
