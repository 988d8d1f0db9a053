"""The collective of the task a ``sparkdl.run(..., backend="ring")`` function runs in.

Inside such a function::

    from sparkdl import collective
    collective.rank(), collective.size()
    total = collective.allreduce(np.ones(3))          # sum over ranks (average=True: mean)
    rows = collective.allgather(np.array([rank]))     # shape (size, 1), by rank
    weights = collective.broadcast(weights, root=0)   # rank 0's array everywhere
    collective.barrier()

Every call is a collective: all ranks must make the same calls in the same
order with arrays of the same shape and dtype, and every wait is bounded by
the ``timeout`` given to ``sparkdl.run``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from sparkdl.collective.ring import RingCommunicator

_active: RingCommunicator | None = None


@contextlib.contextmanager
def bound(communicator: RingCommunicator) -> Iterator[RingCommunicator]:
    """Makes ``communicator`` the one this module's functions use while the block runs."""
    global _active
    previous, _active = _active, communicator
    try:
        yield communicator
    finally:
        _active = previous


def _communicator() -> RingCommunicator:
    if _active is None:
        raise RuntimeError(
            "No sparkdl collective here: these functions work inside a function run by "
            "sparkdl.run(fn, num_workers=..., backend='ring')."
        )
    return _active


def rank() -> int:
    """This task's rank: 0..size()-1, its partition index."""
    return _communicator().rank


def size() -> int:
    """The number of ranks (``num_workers``)."""
    return _communicator().size


def allreduce(array: np.ndarray, average: bool = False) -> np.ndarray:
    """Elementwise sum (or mean) over ranks."""
    return _communicator().allreduce(np.asarray(array), average=average)


def allgather(array: np.ndarray) -> np.ndarray:
    """Every rank's ``array`` stacked by rank: shape ``(size, *array.shape)``."""
    return _communicator().allgather(np.asarray(array))


def broadcast(array: np.ndarray, root: int = 0) -> np.ndarray:
    """Rank ``root``'s ``array`` on every rank."""
    return _communicator().broadcast(np.asarray(array), root=root)


def barrier() -> None:
    """Returns once every rank has called it."""
    _communicator().barrier()
