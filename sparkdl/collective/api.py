"""What every collective backend offers and every mode uses: the ``Communicator`` protocol, its operations and ops.

Shaped like PyTorch's process groups (one interface, asynchronous work
handles): a backend implements :class:`Communicator`; :data:`OPERATIONS` is
the one table of operations from which the asynchronous twins, the wire op
codes and the functions of :mod:`sparkdl.collective` are derived, and a test
keeps protocol, table and module functions in step. A backend that lacks an
operation says so in :attr:`Capabilities.operations` and refuses it with a
clear error.

Every operation is collective over its communicator (all ranks call the same
operations in the same order) except ``send``/``recv``, which pair one rank
with another by tag. Arrays are numpy arrays of any dtype the wire carries
(:func:`sparkdl.net.frames.dtype_code`), bfloat16 included; results are new
arrays unless ``out=`` is given (allreduce, allgather, reduce_scatter, recv).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


class ReduceOp(enum.Enum):
    """How ``allreduce``, ``reduce`` and ``reduce_scatter`` combine the ranks' arrays, elementwise.

    MEAN sums and divides once at the end; it is refused for integer arrays
    (a floor-divided mean would be silently wrong).
    """

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"


@dataclasses.dataclass(frozen=True)
class Operation:
    """One row of :data:`OPERATIONS`: its name and its wire code."""

    name: str
    code: int


#: Every operation a communicator offers, with its wire op code. Each has an ``<name>_async`` twin.
OPERATIONS: tuple[Operation, ...] = (
    Operation("allreduce", 1),
    Operation("allgather", 2),
    Operation("broadcast", 3),
    Operation("barrier", 4),
    Operation("reduce", 5),
    Operation("gather", 6),
    Operation("scatter", 7),
    Operation("allgather_v", 8),
    Operation("reduce_scatter", 9),
    Operation("alltoall", 10),
    Operation("send", 11),
    Operation("recv", 12),
)
OPERATION_NAMES = tuple(operation.name for operation in OPERATIONS)
OP_CODES = {operation.name: operation.code for operation in OPERATIONS}


def operation_name(code: int) -> str:
    for operation in OPERATIONS:
        if operation.code == code:
            return operation.name
    return f"unknown operation {code}"


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do, so that callers can refuse on the driver what it cannot.

    ``in_graph_allreduce``: it also offers ``allreduce_tensors(tensors, op)``,
    which reduces TensorFlow tensors inside a compiled step itself (Horovod's
    ops), so the trainer need not cross into numpy for its gradients.
    """

    backend: str
    operations: frozenset[str]
    algorithms: frozenset[str]
    reduce_ops: frozenset[ReduceOp] = frozenset(ReduceOp)
    in_graph_allreduce: bool = False


@runtime_checkable
class Work(Protocol):
    """A handle on an operation started asynchronously."""

    def wait(self, timeout: float | None = None) -> Any:
        """The operation's result, once done; raises its error. ``timeout`` bounds this wait only."""
        ...

    def done(self) -> bool: ...


@runtime_checkable
class Communicator(Protocol):
    """Collectives and messages among ``size`` ranks; this process is ``rank``.

    ``algorithm`` picks how an operation runs over the links (``"ring"``,
    ``"naive"``, ``"tree"``, ``"hierarchical"``, ...; see
    :attr:`Capabilities.algorithms`); ``None`` lets the communicator choose.
    """

    rank: int
    size: int
    capabilities: Capabilities

    def allreduce(
        self,
        array: np.ndarray,
        op: ReduceOp = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str | None = None,
    ) -> np.ndarray:
        """Every rank gets ``op`` over all ranks' arrays (same shape and dtype everywhere)."""
        ...

    def reduce(
        self, array: np.ndarray, root: int = 0, op: ReduceOp = ReduceOp.SUM, *, algorithm: str | None = None
    ) -> np.ndarray | None:
        """Rank ``root`` gets ``op`` over all ranks' arrays; the others get None."""
        ...

    def broadcast(self, array: np.ndarray, root: int = 0, *, algorithm: str | None = None) -> np.ndarray:
        """Every rank gets ``root``'s array; the others pass an array of the same shape and dtype."""
        ...

    def gather(self, array: np.ndarray, root: int = 0) -> list[np.ndarray] | None:
        """Rank ``root`` gets every rank's array, by rank (shapes may differ, dtypes not); the others None."""
        ...

    def scatter(self, arrays: Sequence[np.ndarray] | None, root: int = 0) -> np.ndarray:
        """Rank r gets ``arrays[r]`` of rank ``root`` (the others pass None)."""
        ...

    def allgather(
        self, array: np.ndarray, *, out: np.ndarray | None = None, algorithm: str | None = None
    ) -> np.ndarray:
        """Every rank's array (all of one shape) stacked by rank: shape ``(size, *array.shape)`` (into ``out``)."""
        ...

    def allgather_v(self, array: np.ndarray) -> list[np.ndarray]:
        """Every rank's array, by rank, of any shapes (one dtype)."""
        ...

    def reduce_scatter(
        self,
        array: np.ndarray,
        op: ReduceOp = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str | None = None,
    ) -> np.ndarray:
        """This rank's part of ``op`` over all ranks: ``np.array_split(result, size)[rank]`` (along axis 0;
        into ``out``)."""
        ...

    def alltoall(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``arrays[j]`` goes to rank j; returns what each rank sent this one, by rank (one dtype, any shapes)."""
        ...

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        ...

    def send(self, array: np.ndarray, dest: int, tag: int = 0) -> None:
        """Sends ``array`` (its dtype and shape travel with it) to rank ``dest``, matched by ``tag``."""
        ...

    def recv(self, source: int, tag: int = 0, *, out: np.ndarray | None = None) -> np.ndarray:
        """The next array rank ``source`` sent with ``tag``; into ``out`` when given (it must match exactly)."""
        ...

    def allreduce_async(
        self,
        array: np.ndarray,
        op: ReduceOp = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str | None = None,
    ) -> Work: ...

    def reduce_async(
        self, array: np.ndarray, root: int = 0, op: ReduceOp = ReduceOp.SUM, *, algorithm: str | None = None
    ) -> Work: ...

    def broadcast_async(self, array: np.ndarray, root: int = 0, *, algorithm: str | None = None) -> Work: ...

    def gather_async(self, array: np.ndarray, root: int = 0) -> Work: ...

    def scatter_async(self, arrays: Sequence[np.ndarray] | None, root: int = 0) -> Work: ...

    def allgather_async(
        self, array: np.ndarray, *, out: np.ndarray | None = None, algorithm: str | None = None
    ) -> Work: ...

    def allgather_v_async(self, array: np.ndarray) -> Work: ...

    def reduce_scatter_async(
        self,
        array: np.ndarray,
        op: ReduceOp = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str | None = None,
    ) -> Work: ...

    def alltoall_async(self, arrays: Sequence[np.ndarray]) -> Work: ...

    def barrier_async(self) -> Work: ...

    def send_async(self, array: np.ndarray, dest: int, tag: int = 0) -> Work: ...

    def recv_async(self, source: int, tag: int = 0, *, out: np.ndarray | None = None) -> Work: ...

    def split(self, ranks: Sequence[int]) -> Communicator | None:
        """A communicator of ``ranks`` (in that order); every rank calls it, those outside get None."""
        ...

    def local(self) -> Communicator:
        """The ranks on this host (collective: every rank calls it)."""
        ...

    def cross(self) -> Communicator:
        """One rank per host: the ranks with this rank's local rank (collective: every rank calls it)."""
        ...

    def close(self) -> None: ...
