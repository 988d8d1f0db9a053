"""The communicator of the task a ``sparkdl.run(..., backend="sparkdl")`` function runs in, as module functions.

Inside such a function::

    from sparkdl import collective
    from sparkdl.collective import ReduceOp
    collective.rank(), collective.size()
    total = collective.allreduce(np.ones(3))                     # sum over ranks
    mean = collective.allreduce(np.ones(3), ReduceOp.MEAN)
    rows = collective.allgather(np.array([rank]))                 # shape (size, 1), by rank
    weights = collective.broadcast(weights, root=0)               # rank 0's array everywhere
    work = collective.allreduce_async(gradients)                  # ... compute ...; work.wait()
    collective.send(activations, dest=1, tag=7); collective.recv(source=0, tag=7)
    collective.barrier()

Each function is the :class:`~sparkdl.collective.api.Communicator` method of
the same name (see :data:`~sparkdl.collective.api.OPERATIONS`); every wait is
bounded by the ``timeout`` given to ``sparkdl.run``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sparkdl.collective.api import Communicator

_active: Communicator | None = None


@contextlib.contextmanager
def bound(communicator: Communicator) -> Iterator[Communicator]:
    """Makes ``communicator`` the one this module's functions use while the block runs."""
    global _active
    previous, _active = _active, communicator
    try:
        yield communicator
    finally:
        _active = previous


def communicator() -> Communicator:
    """The task's communicator (for subgroups: ``communicator().split(...)``, ``.local()``, ``.cross()``)."""
    if _active is None:
        raise RuntimeError(
            "No sparkdl collective here: these functions work inside a function run by "
            "sparkdl.run(fn, num_workers=..., backend='sparkdl')."
        )
    return _active


def rank() -> int:
    """This task's rank: 0..size()-1, its partition index."""
    return communicator().rank


def size() -> int:
    """The number of ranks (``num_workers``)."""
    return communicator().size


def _forward(name: str):
    def operation(*args, **kwargs):
        return getattr(communicator(), name)(*args, **kwargs)

    operation.__name__ = operation.__qualname__ = name
    operation.__doc__ = getattr(Communicator, name).__doc__ or f"The task communicator's ``{name}``."
    return operation


allreduce = _forward("allreduce")
allreduce_async = _forward("allreduce_async")
allgather = _forward("allgather")
allgather_async = _forward("allgather_async")
broadcast = _forward("broadcast")
broadcast_async = _forward("broadcast_async")
barrier = _forward("barrier")
barrier_async = _forward("barrier_async")
reduce = _forward("reduce")
reduce_async = _forward("reduce_async")
gather = _forward("gather")
gather_async = _forward("gather_async")
scatter = _forward("scatter")
scatter_async = _forward("scatter_async")
allgather_v = _forward("allgather_v")
allgather_v_async = _forward("allgather_v_async")
reduce_scatter = _forward("reduce_scatter")
reduce_scatter_async = _forward("reduce_scatter_async")
alltoall = _forward("alltoall")
alltoall_async = _forward("alltoall_async")
send = _forward("send")
send_async = _forward("send_async")
recv = _forward("recv")
recv_async = _forward("recv_async")
