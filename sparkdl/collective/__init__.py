"""Collective communication (allreduce, allgather, broadcast, barrier) among training ranks.

Ranks connect in an authenticated TCP ring; see :class:`RingCommunicator`.
"""

from sparkdl.collective.ring import RingCommunicator
from sparkdl.collective.transport import CollectiveError, CollectiveTimeout, Listener

__all__ = ["CollectiveError", "CollectiveTimeout", "Listener", "RingCommunicator"]
