"""Collective communication (allreduce, allgather, broadcast, barrier) among training ranks.

Ranks connect in an authenticated TCP ring; see :class:`RingCommunicator`.
Inside a function run by ``sparkdl.run(..., backend="ring")`` the task's ring
is reachable through :func:`rank`, :func:`size`, :func:`allreduce`,
:func:`allgather`, :func:`broadcast` and :func:`barrier`.
"""

from sparkdl.collective.context import allgather, allreduce, barrier, broadcast, rank, size
from sparkdl.collective.ring import RingCommunicator
from sparkdl.collective.transport import CollectiveError, CollectiveTimeout, Listener

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "Listener",
    "RingCommunicator",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "rank",
    "size",
]
