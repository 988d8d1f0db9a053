"""The ``Communicator`` protocol over Horovod's TensorFlow collectives (Horovod 0.28.1, Gloo on CPU, NCCL on GPU).

:class:`HorovodCommunicator` joins the job that ``hvd.init()`` finds in the
environment (``sparkdl.collective.horovod.rendezvous.horovod_environment`` sets it inside a
barrier task) and runs every operation through Horovod's eager ops; the
trainer's gradients take Horovod's in-graph allreduce instead
(:meth:`HorovodCommunicator.allreduce_tensors`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sparkdl.collective.algorithms.ring import chunk_bounds
from sparkdl.collective.api import Capabilities, ReduceOp
from sparkdl.collective.base import BaseCommunicator, check_reduce_op, output_array
from sparkdl.net.errors import CollectiveError
from sparkdl.net.frames import dtype_code, dtype_of

#: What Horovod's TensorFlow ops move (broadcast, allgather, alltoall); other dtypes travel as their bytes.
_MOVED = frozenset(
    np.dtype(name)
    for name in ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
)
#: What its allreduce and reducescatter combine.
_REDUCED = frozenset(np.dtype(name) for name in ("uint8", "int8", "int32", "int64", "float16", "float32", "float64"))
_ROOTED = frozenset({"reduce", "broadcast", "gather", "scatter"})


class HorovodCommunicator(BaseCommunicator):
    """sparkdl's collectives over Horovod: every rank makes the same calls in the same order.

    Native (one Horovod op each): ``allreduce`` (SUM, MEAN, MIN, MAX),
    ``broadcast``, ``allgather`` (one ``hvd.allgather`` of the arrays with a
    leading axis of 1), ``reduce_scatter`` with SUM or MEAN (``hvd.reducescatter``
    splits axis 0 as ``np.array_split`` does) and ``barrier`` (Horovod's
    TensorFlow API has no barrier: a one-element allreduce).

    Emulated:

    - ``reduce_scatter`` with MIN or MAX (Horovod's reducescatter has only SUM
      and AVERAGE): a full allreduce, then this rank's slice; it moves the
      whole array, not a 1/size part.
    - ``reduce``: an allreduce, then None on the ranks other than ``root``;
      every rank receives the result.
    - ``allgather_v``: an allgather of each rank's shape record (a few int64),
      then one ``hvd.allgather`` of the flattened arrays (it concatenates
      differing lengths), split by the records: two collectives.
    - ``gather``: ``allgather_v``, then None on the other ranks; every rank
      receives every rank's array, not only ``root``.
    - ``alltoall``: an ``hvd.alltoall`` of the shape records, then one of the
      flattened arrays with per-rank splits: two collectives.
    - ``scatter``: ``root`` sends each rank its shape record, then its array,
      by two ``hvd.alltoall`` in which the other ranks send nothing; only
      ``root``'s arrays move.

    Horovod moves uint8, int8, uint16, int16, int32, int64, float16, float32,
    float64 and bool; the other dtypes sparkdl's frames carry move as their
    bytes. Reductions take uint8, int8, int32, int64, float16, float32 and
    float64 (a TypeError names them for the others).

    Absent: ``send``/``recv`` (Horovod has no point-to-point messages; the
    base class refuses them with a CollectiveError) and subgroups
    (``split``/``local``/``cross``: Horovod's process sets are fixed at
    ``hvd.init``). The only algorithm is Horovod's own (``"horovod"``).
    """

    capabilities = Capabilities(
        backend="horovod",
        operations=frozenset(
            {
                "allreduce",
                "reduce",
                "broadcast",
                "gather",
                "scatter",
                "allgather",
                "allgather_v",
                "reduce_scatter",
                "alltoall",
                "barrier",
            }
        ),
        algorithms=frozenset({"horovod"}),
        in_graph_allreduce=True,
    )

    def __init__(self) -> None:
        super().__init__()
        import horovod.tensorflow as hvd

        hvd.init()
        self._hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        self._calls = 0
        self._ops = {ReduceOp.SUM: hvd.Sum, ReduceOp.MEAN: hvd.Average, ReduceOp.MIN: hvd.Min, ReduceOp.MAX: hvd.Max}
        self._operations: dict[str, Callable[..., Any]] = {
            "allreduce": self._allreduce,
            "reduce": self._reduce,
            "broadcast": self._broadcast,
            "gather": self._gather,
            "scatter": self._scatter,
            "allgather": self._allgather,
            "allgather_v": self._allgather_v,
            "reduce_scatter": self._reduce_scatter,
            "alltoall": self._alltoall,
            "barrier": self._barrier,
        }

    # -- in the compiled train step ----------------------------------------------------------------

    def allreduce_tensors(self, tensors: Sequence, op: ReduceOp = ReduceOp.MEAN) -> list:
        """Inside a compiled step: ``op`` over all ranks of each tensor, by one grouped Horovod allreduce per dtype.

        ``None`` entries (variables without a gradient) pass through. This is what
        ``capabilities.in_graph_allreduce`` announces.
        """
        import tensorflow as tf

        out = list(tensors)
        present = [i for i, tensor in enumerate(out) if tensor is not None]
        if not present:
            return out
        by_dtype: dict[Any, list[int]] = {}  # Horovod groups tensors of one dtype; in first-seen order, as every rank
        for i in present:
            out[i] = tf.convert_to_tensor(out[i])
            dtype = np.dtype(out[i].dtype.as_numpy_dtype)
            self._check_reduced(check_reduce_op(op, dtype), dtype)
            by_dtype.setdefault(out[i].dtype, []).append(i)
        for indices in by_dtype.values():
            reduced = self._hvd.grouped_allreduce([out[i] for i in indices], op=self._ops[op])
            for i, value in zip(indices, reduced):
                out[i] = value
        return out

    # -- the stream ----------------------------------------------------------------------------------

    def _call(self, name: str, asynchronous: bool, **arguments: Any) -> Any:
        """Refuses, when called (not when the operation runs), what Horovod cannot do with these arguments."""
        if name in self.capabilities.operations:
            self._check(name, arguments)
        return super()._call(name, asynchronous, **arguments)

    def _check(self, name: str, arguments: dict[str, Any]) -> None:
        algorithm = arguments.get("algorithm")
        if algorithm is not None and algorithm not in self.capabilities.algorithms:
            raise ValueError(
                f"Expected `algorithm` to be None or one of {sorted(self.capabilities.algorithms)} "
                f"(the {self.capabilities.backend} backend's). Received: algorithm={algorithm!r}"
            )
        root = arguments.get("root", 0)
        if name in _ROOTED and (
            isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self.size
        ):
            raise ValueError(f"Expected `root` to be a rank in [0, {self.size}). Received: root={root!r}")
        if "array" in arguments:
            arguments["array"] = self._check_array(name, np.asarray(arguments["array"]), arguments)
        if name == "alltoall" or (name == "scatter" and self.rank == root):
            arguments["arrays"] = self._check_arrays(name, arguments["arrays"])

    def _check_array(self, name: str, array: np.ndarray, arguments: dict[str, Any]) -> np.ndarray:
        if "op" in arguments:
            self._check_reduced(check_reduce_op(arguments["op"], array.dtype), array.dtype)
        else:
            dtype_code(array.dtype)  # a TypeError naming the dtypes sparkdl carries
        out = arguments.get("out")
        if out is not None and (
            not isinstance(out, np.ndarray) or out.shape != array.shape or out.dtype != array.dtype
        ):
            raise ValueError(
                f"Expected `out` to be an array of shape {array.shape} and dtype {array.dtype}. "
                f"Received: {getattr(out, 'shape', None)} {getattr(out, 'dtype', type(out).__name__)}"
            )
        if name == "reduce_scatter" and array.ndim == 0:
            raise ValueError("reduce_scatter splits axis 0 over the ranks; it needs an array of at least one dimension")
        return array

    def _check_arrays(self, name: str, arrays: Sequence[np.ndarray] | None) -> list[np.ndarray]:
        if arrays is None or len(arrays) != self.size:
            raise ValueError(
                f"Expected `arrays` to hold one array per rank ({self.size}) for {name}. "
                f"Received: {None if arrays is None else len(arrays)} arrays"
            )
        checked = [np.asarray(array) for array in arrays]
        dtypes = {array.dtype for array in checked}
        if len(dtypes) != 1:
            raise TypeError(f"Expected the arrays of {name} to share one dtype. Received: {sorted(map(str, dtypes))}")
        dtype_code(checked[0].dtype)
        return checked

    @staticmethod
    def _check_reduced(op: ReduceOp, dtype) -> None:
        if np.dtype(dtype) not in _REDUCED:
            supported = ", ".join(sorted(d.name for d in _REDUCED))
            raise TypeError(
                f"The horovod backend reduces arrays of {supported}; it cannot {op.name} a {np.dtype(dtype)} array"
            )

    def _run(self, name: str, **arguments: Any) -> Any:
        import tensorflow as tf
        from horovod.common.exceptions import HorovodInternalError

        try:
            return self._operations[name](**arguments)
        except (tf.errors.OpError, HorovodInternalError) as error:
            raise CollectiveError(f"rank {self.rank}: horovod {name} failed: {error}") from error

    def _close(self) -> None:
        self._hvd.shutdown()

    def _name(self, op: str) -> str:
        """Eager Horovod ops are matched across ranks by name; every rank makes the same calls in order."""
        self._calls += 1
        return f"sparkdl.{op}.{self._calls}"

    # -- the operations ------------------------------------------------------------------------------

    def _allreduce(self, array: np.ndarray, op: ReduceOp, out: np.ndarray | None, algorithm: str | None) -> np.ndarray:
        result = _numpy(self._hvd.allreduce(array, op=self._ops[op], name=self._name("allreduce")))
        if out is None:
            return result
        out[...] = result
        return out

    def _reduce(self, array: np.ndarray, root: int, op: ReduceOp, algorithm: str | None) -> np.ndarray | None:
        result = self._allreduce(array, op, None, None)
        return result if self.rank == root else None

    def _broadcast(self, array: np.ndarray, root: int, algorithm: str | None) -> np.ndarray:
        moved = _numpy(self._hvd.broadcast(_to_moved(array), root_rank=root, name=self._name("broadcast")))
        return _from_moved(moved, array.dtype)

    def _allgather(self, array: np.ndarray, out: np.ndarray | None, algorithm: str | None) -> np.ndarray:
        array = np.asarray(array)
        result = output_array(out, (self.size, *array.shape), array.dtype)  # refused before anything moves
        stacked = self._hvd.allgather(_to_moved(array)[np.newaxis], name=self._name("allgather")).numpy()
        if stacked.shape[0] != self.size:
            raise CollectiveError(f"rank {self.rank}: allgather got {stacked.shape[0]} rows from {self.size} ranks")
        result[...] = _from_moved(stacked, array.dtype)
        return result

    def _allgather_v(self, array: np.ndarray) -> list[np.ndarray]:
        records = self._hvd.allgather(_record(array), name=self._name("allgather_v.shapes")).numpy()
        dtype, shapes = _parse_records("allgather_v", self.rank, records, self.size)
        moved = _to_moved(array).reshape(-1)
        flat = self._hvd.allgather(moved, name=self._name("allgather_v")).numpy()
        return _unflatten(flat, dtype, shapes)

    def _gather(self, array: np.ndarray, root: int) -> list[np.ndarray] | None:
        arrays = self._allgather_v(array)
        return arrays if self.rank == root else None

    def _reduce_scatter(
        self, array: np.ndarray, op: ReduceOp, out: np.ndarray | None, algorithm: str | None
    ) -> np.ndarray:
        array = np.asarray(array)
        bounds = chunk_bounds(array.shape[0] if array.ndim else 1, self.size)
        rows = bounds[self.rank + 1] - bounds[self.rank]
        result = output_array(out, (rows, *array.shape[1:]), array.dtype)  # refused before anything moves
        if op in (ReduceOp.SUM, ReduceOp.MEAN):
            result[...] = self._hvd.reducescatter(array, op=self._ops[op], name=self._name("reduce_scatter")).numpy()
        else:  # Horovod's reducescatter has only SUM and AVERAGE
            result[...] = np.array_split(self._allreduce(array, op, None, None), self.size)[self.rank]
        return result

    def _alltoall(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        records = [_record(array) for array in arrays]
        received = self._alltoall_flat(records, np.dtype(np.int64), "alltoall.shapes")
        dtype, shapes = _parse_records("alltoall", self.rank, received, self.size)
        flat = self._alltoall_flat([_to_moved(array).reshape(-1) for array in arrays], _moved_dtype(dtype), "alltoall")
        return _unflatten(flat, dtype, shapes)

    def _scatter(self, arrays: list[np.ndarray] | None, root: int) -> np.ndarray:
        int64, nothing = np.dtype(np.int64), [np.zeros(0, np.int64)] * self.size
        records = [_record(array) for array in arrays] if self.rank == root and arrays is not None else nothing
        record = self._alltoall_flat(records, int64, "scatter.shapes")
        dtype, (shape,) = _parse_records("scatter", self.rank, record, 1)
        moved_dtype = _moved_dtype(dtype)
        if self.rank == root and arrays is not None:
            parts = [_to_moved(array).reshape(-1) for array in arrays]
        else:
            parts = [np.zeros(0, moved_dtype)] * self.size
        flat = self._alltoall_flat(parts, moved_dtype, "scatter")
        return _unflatten(flat, dtype, [shape])[0]

    def _alltoall_flat(self, parts: list[np.ndarray], dtype: np.dtype, name: str) -> np.ndarray:
        """``parts[j]`` (1-D) to rank j; what every rank sent here, concatenated by rank."""
        splits = np.array([len(part) for part in parts], np.int32)
        received, _ = self._hvd.alltoall(
            np.concatenate(parts).astype(dtype, copy=False), splits=splits, name=self._name(name)
        )
        return received.numpy()

    def _barrier(self) -> None:
        self._hvd.allreduce(np.zeros(1, np.int32), op=self._hvd.Sum, name=self._name("barrier"))


# -- arrays as Horovod moves them ---------------------------------------------------------------------


def _numpy(tensor) -> np.ndarray:
    """An eager tensor's values as an array (``Tensor.numpy()`` gives a numpy scalar for a 0-d tensor)."""
    return np.asarray(tensor.numpy())


def _moved_dtype(dtype: np.dtype) -> np.dtype:
    return dtype if dtype in _MOVED else np.dtype(np.uint8)


def _to_moved(array: np.ndarray) -> np.ndarray:
    """``array`` itself where Horovod moves its dtype; else its bytes, shape ``(*array.shape, itemsize)``."""
    if array.dtype in _MOVED:
        return array
    return _contiguous(array)[..., np.newaxis].view(np.uint8)


def _from_moved(moved: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype in _MOVED:
        return moved
    return _contiguous(moved).view(dtype)[..., 0]


def _contiguous(array: np.ndarray) -> np.ndarray:
    return array if array.flags.c_contiguous else array.copy(order="C")  # np.ascontiguousarray makes 0-d 1-d


def _moved_shape(shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    return shape if dtype in _MOVED else (*shape, dtype.itemsize)


def _record(array: np.ndarray) -> np.ndarray:
    """An array's dtype and shape as int64: ``[dtype code, ndim, *shape]``."""
    return np.array([dtype_code(array.dtype), array.ndim, *array.shape], np.int64)


def _parse_records(name: str, rank: int, records: np.ndarray, count: int) -> tuple[np.dtype, list[tuple[int, ...]]]:
    """The one dtype and the ``count`` shapes of concatenated records; CollectiveError if the dtypes differ."""
    codes, shapes, at = [], [], 0
    values = records.tolist()
    while at < len(values):
        codes.append(values[at])
        ndim = values[at + 1]
        shapes.append(tuple(values[at + 2 : at + 2 + ndim]))
        at += 2 + ndim
    if len(shapes) != count:
        raise CollectiveError(f"rank {rank}: {name} expected {count} shape records, received {len(shapes)}")
    if len(set(codes)) != 1:
        names = sorted({dtype_of(code).name for code in codes})
        raise CollectiveError(f"rank {rank}: {name} needs one dtype on every rank; the ranks sent {', '.join(names)}")
    return dtype_of(codes[0]), shapes


def _unflatten(flat: np.ndarray, dtype: np.dtype, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    moved = [_moved_shape(shape, dtype) for shape in shapes]
    ends = np.cumsum([int(np.prod(shape)) for shape in moved])
    if len(shapes) and ends[-1] != flat.size:
        raise CollectiveError(f"received {flat.size} values where the shapes announced {ends[-1]}")
    pieces = np.split(flat, ends[:-1])
    return [_from_moved(piece.reshape(shape).copy(), dtype) for piece, shape in zip(pieces, moved)]
