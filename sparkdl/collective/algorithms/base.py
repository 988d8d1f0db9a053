"""The one interface every collective algorithm implements, so that the communicator runs any of them alike.

Shaped like Gloo's ``Algorithm`` classes (one base class, one subclass per
algorithm, each run on its context) and c10d's backend table: an algorithm
declares its ``name``, the ``operations`` it implements (a method of that
name each, with the signature below), whether it is ``usable`` where the
communicator's ranks sit, whether the automatic choice should pick it for a
call (``wanted``, asked in ``precedence`` order), and ``costs``: the cost
model's counts (:mod:`sparkdl.collective.cost`) of each operation it
implements, ``function(n, nbytes, **options) -> Cost``.

The communicator checks the arguments, flattens the arrays, makes the
results, handles a communicator of one rank and divides a MEAN; the
algorithm moves and combines the bytes. What it may use of the communicator
is ``comm.rank``, ``comm.size``, ``comm.transfer(operation)`` (the frames of
one call: a ``with`` block flushes its sends), ``comm.scratch(nbytes)`` and
``comm.work(nbytes)`` (kept buffers), ``comm.segment`` (the host's shared
memory, or None) and ``comm.cross()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from sparkdl.collective.api import ReduceOp
from sparkdl.collective.cost.model import Cost

if TYPE_CHECKING:
    from sparkdl.collective.communicator import SparkdlCommunicator

#: How an algorithm combines two arrays of a ReduceOp (MEAN sums; the communicator divides once at the end).
COMBINE = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
#: The shared-memory segment's name of each ReduceOp's combination.
SEGMENT_OP = {ReduceOp.SUM: "sum", ReduceOp.MEAN: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


@dataclasses.dataclass(frozen=True)
class Sharing:
    """How a communicator's ranks share hosts: ``shared_memory``, the hosts hold its ranks in equal numbers with a
    segment each (or it has one rank); ``one_host``, one segment holds every rank."""

    shared_memory: bool
    one_host: bool = False


class Algorithm:
    """One way of running some of a communicator's operations; see the module's docstring."""

    name: ClassVar[str]
    operations: ClassVar[frozenset[str]]
    costs: ClassVar[Mapping[str, Callable[..., Cost]]] = {}
    #: The automatic choice asks the algorithms whether they want a call, higher ``precedence`` first.
    precedence: ClassVar[int] = 0

    def usable(self, sharing: Sharing) -> bool:
        """Whether it runs on a communicator whose ranks share hosts as ``sharing`` says."""
        return True

    def refusal(self, operation: str) -> str:
        """The error of a call that asks for it where it is not :meth:`usable`."""
        return f"algorithm={self.name!r} cannot run {operation} on this communicator"

    def wanted(self, operation: str, nbytes: int, sharing: Sharing) -> bool:
        """Whether the communicator should pick it for a call of ``nbytes`` that names no algorithm."""
        return False

    # -- the operations: those named in ``operations`` are overridden ---------------------------------------------

    def allreduce(self, comm: SparkdlCommunicator, flat: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        """Every rank's ``out`` (1-D) gets ``op`` over all ranks' ``flat`` (1-D, contiguous)."""
        raise NotImplementedError

    def reduce(self, comm: SparkdlCommunicator, flat: np.ndarray, out: np.ndarray, root: int, op: ReduceOp) -> None:
        """``out`` on ``root`` gets ``op`` over all ranks' ``flat``; on the others it is scratch."""
        raise NotImplementedError

    def broadcast(self, comm: SparkdlCommunicator, out: np.ndarray, root: int) -> None:
        """Every rank's ``out`` (1-D) gets ``root``'s."""
        raise NotImplementedError

    def allgather(self, comm: SparkdlCommunicator, rows: np.ndarray) -> None:
        """``rows[r]`` (of the 2-D ``(size, n)`` result, this rank's row filled in) from rank r to every rank."""
        raise NotImplementedError

    def reduce_scatter(
        self, comm: SparkdlCommunicator, flat: np.ndarray, out: np.ndarray, bounds: Sequence[int], op: ReduceOp
    ) -> None:
        """``out`` gets this rank's part (``flat[bounds[rank]:bounds[rank + 1]]``) of ``op`` over all ranks."""
        raise NotImplementedError

    def gather(self, comm: SparkdlCommunicator, array: np.ndarray, root: int) -> list[np.ndarray] | None:
        raise NotImplementedError

    def scatter(self, comm: SparkdlCommunicator, arrays: Sequence[np.ndarray], root: int) -> np.ndarray:
        raise NotImplementedError

    def allgather_v(self, comm: SparkdlCommunicator, array: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError

    def alltoall(self, comm: SparkdlCommunicator, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def barrier(self, comm: SparkdlCommunicator) -> None:
        raise NotImplementedError

    def send(self, comm: SparkdlCommunicator, array: np.ndarray, dest: int, tag: int) -> None:
        raise NotImplementedError

    def recv(self, comm: SparkdlCommunicator, source: int, tag: int, out: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError
