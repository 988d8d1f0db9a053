"""Reduce-scatter and allgather through the host's shared-memory segment alone, where one host holds every rank.

The segment's own algorithms (:mod:`sparkdl.collective.shm`): no TCP at all,
each rank's bytes copied once into the segment and once out by each reader.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparkdl.collective.algorithms.base import SEGMENT_OP, Algorithm, Sharing
from sparkdl.collective.api import ReduceOp


class SharedMemory(Algorithm):
    """Wanted for its operations wherever one segment holds every rank of the communicator."""

    name = "shared_memory"
    operations = frozenset({"allgather", "reduce_scatter"})
    precedence = 2

    def usable(self, sharing: Sharing) -> bool:
        return sharing.one_host

    def refusal(self, operation: str) -> str:
        return (
            f"algorithm='shared_memory' needs every rank on one host with shared memory on; {operation} "
            "runs on ranks of several hosts or without it here"
        )

    def wanted(self, operation: str, nbytes: int, sharing: Sharing) -> bool:
        return True

    def allgather(self, comm, rows: np.ndarray) -> None:
        comm.segment.allgather(rows)

    def reduce_scatter(self, comm, flat: np.ndarray, out: np.ndarray, bounds: Sequence[int], op: ReduceOp) -> None:
        comm.segment.reduce_scatter(flat, SEGMENT_OP[op], out, bounds)
