"""What every backend shares: argument checks, the asynchronous twins, and one ordered stream of operations.

A backend subclasses :class:`BaseCommunicator` and implements ``_run(name,
**arguments)`` for the operations it has (its :class:`Capabilities` lists
them). Every public operation, synchronous or not, goes through
:meth:`BaseCommunicator._call`: operations run one at a time in the order
they were called, as a CUDA stream runs kernels. An ``*_async`` call queues
its operation on the communicator's one worker thread and returns a
:class:`FutureWork`; a synchronous call runs in the calling thread once the
queue is empty, so it costs no thread hand-off when nothing is pending.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from sparkdl.collective.api import Capabilities, Communicator, ReduceOp
from sparkdl.net.errors import CollectiveError, CollectiveTimeout


class FutureWork:
    """A queued operation's handle (:class:`~sparkdl.collective.api.Work`)."""

    def __init__(self, future: Future, name: str, rank: int):
        self._future, self._name, self._rank = future, name, rank

    def wait(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise CollectiveTimeout(
                f"rank {self._rank}: {self._name} was not done after waiting {timeout}s for it; it goes on running"
            ) from None

    def done(self) -> bool:
        return self._future.done()


def check_reduce_op(op: ReduceOp, dtype: np.dtype) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"Expected `op` to be a sparkdl.collective.ReduceOp. Received: op={op!r}")
    if op is ReduceOp.MEAN and not np.issubdtype(dtype, np.inexact) and dtype.name != "bfloat16":
        raise TypeError(
            f"ReduceOp.MEAN of a {dtype} array would be floor-divided; reduce with SUM and divide, "
            "or pass a floating-point array"
        )
    return op


class BaseCommunicator:
    """The public operations of :class:`~sparkdl.collective.api.Communicator`, over a backend's ``_run``."""

    rank: int
    size: int
    capabilities: Capabilities

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one operation at a time, in call order
        self._queue: ThreadPoolExecutor | None = None
        self._pending = 0
        self._closed = False

    # -- what a backend implements --------------------------------------------------------------

    def _run(self, name: str, **arguments: Any) -> Any:
        raise NotImplementedError

    def _close(self) -> None:
        """Releases the backend's links; called once."""

    # -- the stream ------------------------------------------------------------------------------

    def _call(self, name: str, asynchronous: bool, **arguments: Any) -> Any:
        if name not in self.capabilities.operations:
            raise CollectiveError(
                f"rank {self.rank}: the {self.capabilities.backend} backend has no {name}; "
                f"it offers {', '.join(sorted(self.capabilities.operations))}"
            )
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: {name} on a closed communicator")
        if asynchronous:
            return self._submit(name, arguments)
        with self._lock:
            if self._pending == 0:
                return self._run(name, **arguments)
        return self._submit(name, arguments).wait()

    def _submit(self, name: str, arguments: dict[str, Any]) -> FutureWork:
        with self._lock:
            if self._queue is None:
                self._queue = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sparkdl-rank{self.rank}-ops")
            self._pending += 1
            future = self._queue.submit(self._run_queued, name, arguments)
        return FutureWork(future, name, self.rank)

    def _run_queued(self, name: str, arguments: dict[str, Any]) -> Any:
        with self._lock:
            try:
                return self._run(name, **arguments)
            finally:
                self._pending -= 1

    def close(self) -> None:
        """Waits for queued operations, then releases the links; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._queue is not None:
            self._queue.shutdown(wait=True)
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- the operations (api.OPERATIONS), each with its asynchronous twin --------------------------

    def allreduce(self, array, op=ReduceOp.SUM, *, out=None, algorithm=None) -> np.ndarray:
        return self._call("allreduce", False, array=array, op=op, out=out, algorithm=algorithm)

    def allreduce_async(self, array, op=ReduceOp.SUM, *, out=None, algorithm=None):
        return self._call("allreduce", True, array=array, op=op, out=out, algorithm=algorithm)

    def reduce(self, array, root=0, op=ReduceOp.SUM, *, algorithm=None):
        return self._call("reduce", False, array=array, root=root, op=op, algorithm=algorithm)

    def reduce_async(self, array, root=0, op=ReduceOp.SUM, *, algorithm=None):
        return self._call("reduce", True, array=array, root=root, op=op, algorithm=algorithm)

    def broadcast(self, array, root=0, *, algorithm=None) -> np.ndarray:
        return self._call("broadcast", False, array=array, root=root, algorithm=algorithm)

    def broadcast_async(self, array, root=0, *, algorithm=None):
        return self._call("broadcast", True, array=array, root=root, algorithm=algorithm)

    def gather(self, array, root=0):
        return self._call("gather", False, array=array, root=root)

    def gather_async(self, array, root=0):
        return self._call("gather", True, array=array, root=root)

    def scatter(self, arrays, root=0) -> np.ndarray:
        return self._call("scatter", False, arrays=arrays, root=root)

    def scatter_async(self, arrays, root=0):
        return self._call("scatter", True, arrays=arrays, root=root)

    def allgather(self, array, *, out=None, algorithm=None) -> np.ndarray:
        return self._call("allgather", False, array=array, out=out, algorithm=algorithm)

    def allgather_async(self, array, *, out=None, algorithm=None):
        return self._call("allgather", True, array=array, out=out, algorithm=algorithm)

    def allgather_v(self, array) -> list[np.ndarray]:
        return self._call("allgather_v", False, array=array)

    def allgather_v_async(self, array):
        return self._call("allgather_v", True, array=array)

    def reduce_scatter(self, array, op=ReduceOp.SUM, *, out=None, algorithm=None) -> np.ndarray:
        return self._call("reduce_scatter", False, array=array, op=op, out=out, algorithm=algorithm)

    def reduce_scatter_async(self, array, op=ReduceOp.SUM, *, out=None, algorithm=None):
        return self._call("reduce_scatter", True, array=array, op=op, out=out, algorithm=algorithm)

    def alltoall(self, arrays) -> list[np.ndarray]:
        return self._call("alltoall", False, arrays=arrays)

    def alltoall_async(self, arrays):
        return self._call("alltoall", True, arrays=arrays)

    def barrier(self) -> None:
        return self._call("barrier", False)

    def barrier_async(self):
        return self._call("barrier", True)

    def send(self, array, dest, tag=0) -> None:
        return self._call("send", False, array=array, dest=dest, tag=tag)

    def send_async(self, array, dest, tag=0):
        return self._call("send", True, array=array, dest=dest, tag=tag)

    def recv(self, source, tag=0, *, out=None) -> np.ndarray:
        return self._call("recv", False, source=source, tag=tag, out=out)

    def recv_async(self, source, tag=0, *, out=None):
        return self._call("recv", True, source=source, tag=tag, out=out)

    # -- groups: backends that have them override these --------------------------------------------

    def split(self, ranks: Sequence[int]) -> Communicator | None:
        raise CollectiveError(f"rank {self.rank}: the {self.capabilities.backend} backend cannot form subgroups")

    def local(self) -> Communicator:
        raise CollectiveError(f"rank {self.rank}: the {self.capabilities.backend} backend cannot form subgroups")

    def cross(self) -> Communicator:
        raise CollectiveError(f"rank {self.rank}: the {self.capabilities.backend} backend cannot form subgroups")


def output_array(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``out`` checked to fit an operation's result of ``shape`` and ``dtype`` (a new array where None)."""
    if out is None:
        return np.empty(shape, dtype)
    if out.shape != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(
            f"Expected `out` to be a writeable C-contiguous {dtype} array of shape {tuple(shape)}. "
            f"Received: {out.dtype} of shape {out.shape}"
        )
    return out
