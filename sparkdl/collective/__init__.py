"""Collective communication among training ranks: one protocol, sparkdl's own backend, Horovod's.

:class:`Communicator` (in :mod:`.api`) is what every backend implements and
every mode uses: allreduce, reduce, broadcast, gather, scatter, allgather
(and ``allgather_v`` of unequal shapes), reduce_scatter, alltoall, barrier,
point-to-point ``send``/``recv`` with tags, each with an ``*_async`` twin.
sparkdl's backend (:class:`SparkdlCommunicator`) runs them over
authenticated TCP links and, between ranks of one host, shared memory.
Inside a function run by ``sparkdl.run(..., backend="sparkdl")`` the task's
communicator is reachable through this module's functions (:mod:`.context`).
An algorithm of one's own is an :class:`Algorithm` given to
:func:`register_algorithm` (:mod:`.algorithms`).
"""

from sparkdl.collective.algorithms import Algorithm, register_algorithm, unregister_algorithm
from sparkdl.collective.api import OPERATIONS, Capabilities, Communicator, ReduceOp, Work
from sparkdl.collective.communicator import SparkdlCommunicator
from sparkdl.collective.context import (
    allgather,
    allgather_async,
    allgather_v,
    allgather_v_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    barrier_async,
    broadcast,
    broadcast_async,
    communicator,
    gather,
    gather_async,
    rank,
    recv,
    recv_async,
    reduce,
    reduce_async,
    reduce_scatter,
    reduce_scatter_async,
    scatter,
    scatter_async,
    send,
    send_async,
    size,
)
from sparkdl.collective.transport.mesh import Listener
from sparkdl.net.errors import CollectiveError, CollectiveTimeout

__all__ = [
    "OPERATIONS",
    "Algorithm",
    "Capabilities",
    "CollectiveError",
    "CollectiveTimeout",
    "Communicator",
    "Listener",
    "ReduceOp",
    "SparkdlCommunicator",
    "Work",
    "allgather",
    "allgather_async",
    "allgather_v",
    "allgather_v_async",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "barrier_async",
    "broadcast",
    "broadcast_async",
    "communicator",
    "gather",
    "gather_async",
    "rank",
    "recv",
    "recv_async",
    "reduce",
    "reduce_async",
    "reduce_scatter",
    "reduce_scatter_async",
    "register_algorithm",
    "scatter",
    "scatter_async",
    "send",
    "send_async",
    "size",
    "unregister_algorithm",
]
