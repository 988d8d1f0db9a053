"""HorovodCommunicator against numpy: every operation it offers, on two Spark tasks, sync and async, and its refusals.

Runs in the Horovod stack's environment (conf/horovod/install.sh; CI's second pass, with
SPARKDL_EXPECT_HOROVOD=1 so that a broken install fails instead of skipping). Each rank makes
every call, records what differs from numpy, and raises at the end: no rank stops early and
leaves the other waiting in a collective.
"""

import os

import numpy as np
import pytest

if os.environ.get("SPARKDL_EXPECT_HOROVOD"):
    import horovod.tensorflow  # noqa: F401  (must be importable: fail, don't skip)
else:
    pytest.importorskip("horovod.tensorflow", reason="the Horovod stack is not installed (conf/horovod/install.sh)")

import sparkdl

pytestmark = pytest.mark.horovod

DTYPES = ("float32", "float64", "int32", "int64")
OPS = ("SUM", "MEAN", "MIN", "MAX")


def data(rank, shape, dtype, salt=0):
    """Rank ``rank``'s array: distinct per rank, negative values included, exact in every dtype."""
    values = (np.arange(int(np.prod(shape)), dtype=np.int64) * (rank + 3) + 7 * salt + 11 * rank) % 53 - 20
    if np.dtype(dtype).kind == "c":
        values = values + 1j * values[::-1]
    return values.astype(dtype).reshape(shape)


def combined(op, arrays):
    stacked = np.stack(arrays)
    if op == "MEAN":
        return np.mean(stacked.astype(np.float64), axis=0).astype(stacked.dtype)
    return {"SUM": np.sum, "MIN": np.min, "MAX": np.max}[op](stacked, axis=0).astype(stacked.dtype)


class Checks:
    """Collects mismatches instead of raising, so every rank makes every collective call."""

    def __init__(self):
        self.failures, self.count = [], 0

    def equal(self, label, got, want):
        self.count += 1
        if want is None or got is None:
            if got is not want:
                self.failures.append(f"{label}: got {got!r}, expected {want!r}")
            return
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
            self.failures.append(
                f"{label}: got {getattr(got, 'dtype', type(got))} {getattr(got, 'shape', '')}, "
                f"expected {want.dtype} {want.shape}"
            )
        elif want.dtype.kind == "f" and not np.allclose(got, want, rtol=1e-6, atol=1e-6):
            self.failures.append(f"{label}: got {got}, expected {want}")
        elif want.dtype.kind != "f" and not np.array_equal(got, want):
            self.failures.append(f"{label}: got {got}, expected {want}")

    def lists(self, label, got, want):
        if want is None or got is None:
            self.equal(label, got, want)
            return
        if not isinstance(got, list) or len(got) != len(want):
            self.count += 1
            self.failures.append(f"{label}: got {type(got).__name__} of {len(got)}, expected {len(want)} arrays")
            return
        for i, (g, w) in enumerate(zip(got, want)):
            self.equal(f"{label}[{i}]", g, w)

    def raises(self, label, error, match, call):
        self.count += 1
        try:
            call()
        except error as caught:
            if match not in str(caught):
                self.failures.append(f"{label}: {type(caught).__name__} without {match!r}: {caught}")
        except Exception as caught:  # noqa: BLE001  (recorded, not raised: the other rank must not hang)
            self.failures.append(f"{label}: raised {type(caught).__name__}: {caught}, expected {error.__name__}")
        else:
            self.failures.append(f"{label}: did not raise {error.__name__}")

    def done(self, rank):
        if self.failures:
            raise AssertionError(
                f"rank {rank}: {len(self.failures)} of {self.count} checks failed:\n" + "\n".join(self.failures)
            )
        return self.count


# -- what every rank runs ----------------------------------------------------------------------------


def every_operation(dtypes=DTYPES):
    """Every offered operation, each dtype, each op, odd sizes; expected values from every rank's known data."""
    from sparkdl.collective.api import ReduceOp
    from sparkdl.collective.horovod import HorovodCommunicator

    checks = Checks()
    with HorovodCommunicator() as comm:
        rank, size = comm.rank, comm.size
        for dtype in dtypes:
            floating = np.dtype(dtype).kind == "f"
            for shape in [(7,), (3, 5), (1,), ()]:
                everyone = [data(q, shape, dtype) for q in range(size)]
                mine = everyone[rank]
                for op in OPS:
                    if op == "MEAN" and not floating:
                        continue
                    label = f"{dtype} {shape} {op}"
                    checks.equal(f"allreduce {label}", comm.allreduce(mine, ReduceOp[op]), combined(op, everyone))
                    out = np.empty_like(mine)
                    result = comm.allreduce(mine, ReduceOp[op], out=out)
                    checks.equal(f"allreduce out= {label}", out, combined(op, everyone))
                    checks.count += 1
                    if result is not out:
                        checks.failures.append(f"allreduce out= {label}: did not return out")
                    for root in range(size):
                        want = combined(op, everyone) if rank == root else None
                        checks.equal(f"reduce root={root} {label}", comm.reduce(mine, root, ReduceOp[op]), want)
                for root in range(size):
                    sent = mine if rank == root else np.zeros_like(mine)
                    checks.equal(f"broadcast root={root} {dtype} {shape}", comm.broadcast(sent, root), everyone[root])
                checks.equal(f"allgather {dtype} {shape}", comm.allgather(mine), np.stack(everyone))
            # reduce_scatter: odd first dimensions, one shorter than the ranks
            for shape in [(7,), (5, 3), (1, 2), (2,)]:
                everyone = [data(q, shape, dtype, salt=1) for q in range(size)]
                for op in OPS:
                    if op == "MEAN" and not floating:
                        continue
                    want = np.array_split(combined(op, everyone), size)[rank]
                    got = comm.reduce_scatter(everyone[rank], ReduceOp[op])
                    checks.equal(f"reduce_scatter {dtype} {shape} {op}", got, want)
            # any shapes, one dtype: rank q's shape depends on q
            for variant in range(2):
                shapes = [[(3,), (2, 5), (0,), ()][(2 * variant + q) % 4] for q in range(size)]
                everyone = [data(q, shapes[q], dtype, salt=2) for q in range(size)]
                checks.lists(f"allgather_v {dtype} {shapes}", comm.allgather_v(everyone[rank]), everyone)
                for root in range(size):
                    want = everyone if rank == root else None
                    checks.lists(f"gather root={root} {dtype} {shapes}", comm.gather(everyone[rank], root), want)

            # alltoall: what rank q sends rank j has shape (q + 2 * j + 1,), or 2-d for the last rank
            def sent(q, j, dtype=dtype):
                shape = (q + 2 * j + 1,) if j < size - 1 else (q + 1, 3)
                return data(q, shape, dtype, salt=3 + j)

            got = comm.alltoall([sent(rank, j) for j in range(size)])
            checks.lists(f"alltoall {dtype}", got, [sent(q, rank) for q in range(size)])
            for root in range(size):
                arrays = [sent(root, j) for j in range(size)] if rank == root else None
                checks.equal(f"scatter root={root} {dtype}", comm.scatter(arrays, root), sent(root, rank))
        checks.count += 1
        comm.barrier()
        return checks.done(rank)


def every_async_twin():
    """Each ``*_async`` queued at once, waited in order, equals its synchronous twin; a sync call after them waits."""
    from sparkdl.collective.api import Communicator, ReduceOp, Work
    from sparkdl.collective.horovod import HorovodCommunicator

    checks = Checks()
    with HorovodCommunicator() as comm:
        rank, size = comm.rank, comm.size
        checks.count += 1
        if not isinstance(comm, Communicator):
            checks.failures.append("HorovodCommunicator is not a sparkdl.collective.api.Communicator")
        for dtype in DTYPES:
            floating = np.dtype(dtype).kind == "f"
            everyone = [data(q, (5, 3), dtype) for q in range(size)]
            mine = everyone[rank]
            ragged = [data(q, (q + 2,), dtype) for q in range(size)]
            to_each = [data(rank, (rank + j + 1,), dtype, salt=j) for j in range(size)]
            op = ReduceOp.MEAN if floating else ReduceOp.SUM
            out = np.empty_like(mine)
            works = {
                "allreduce": comm.allreduce_async(mine, op),
                "allreduce out=": comm.allreduce_async(mine, ReduceOp.MAX, out=out),
                "reduce": comm.reduce_async(mine, 1, ReduceOp.MIN),
                "broadcast": comm.broadcast_async(mine if rank == 1 else np.zeros_like(mine), 1),
                "allgather": comm.allgather_async(mine),
                "allgather_v": comm.allgather_v_async(ragged[rank]),
                "gather": comm.gather_async(ragged[rank], 1),
                "reduce_scatter": comm.reduce_scatter_async(mine, ReduceOp.SUM),
                "reduce_scatter max": comm.reduce_scatter_async(mine, ReduceOp.MAX),
                "alltoall": comm.alltoall_async(to_each),
                "scatter": comm.scatter_async(to_each if rank == 0 else None, 0),
                "barrier": comm.barrier_async(),
            }
            after = comm.allreduce(mine, ReduceOp.SUM)  # queued behind the asynchronous ones
            wants = {
                "allreduce": combined(op.name, everyone),
                "allreduce out=": combined("MAX", everyone),
                "reduce": combined("MIN", everyone) if rank == 1 else None,
                "broadcast": everyone[1],
                "allgather": np.stack(everyone),
                "allgather_v": ragged,
                "gather": ragged if rank == 1 else None,
                "reduce_scatter": np.array_split(combined("SUM", everyone), size)[rank],
                "reduce_scatter max": np.array_split(combined("MAX", everyone), size)[rank],
                "alltoall": [data(q, (q + rank + 1,), dtype, salt=rank) for q in range(size)],
                "scatter": data(0, (rank + 1,), dtype, salt=rank),
            }
            for name, work in works.items():
                checks.count += 1
                if not isinstance(work, Work):
                    checks.failures.append(f"{name}_async {dtype}: returned {type(work).__name__}, not a Work")
                result = work.wait(timeout=120)
                checks.count += 1
                if not work.done():
                    checks.failures.append(f"{name}_async {dtype}: not done after wait")
                if name == "barrier":
                    checks.equal(f"barrier_async {dtype}", result, None)
                elif isinstance(wants[name], list) or (wants[name] is None and name == "gather"):
                    checks.lists(f"{name}_async {dtype}", result, wants[name])
                else:
                    checks.equal(f"{name}_async {dtype}", result, wants[name])
            checks.count += 1
            if works["allreduce out="].wait() is not out:
                checks.failures.append(f"allreduce_async out= {dtype}: did not return out")
            checks.equal(f"allreduce after the async ones {dtype}", after, combined("SUM", everyone))
        return checks.done(rank)


def refusals_and_bytes():
    """What it refuses (before anything is sent), dtypes Horovod lacks moved as bytes, and the in-graph allreduce."""
    import tensorflow as tf

    from sparkdl.collective.api import OPERATION_NAMES, ReduceOp
    from sparkdl.collective.horovod import HorovodCommunicator
    from sparkdl.net.errors import CollectiveError

    checks = Checks()
    with HorovodCommunicator() as comm:
        rank, size = comm.rank, comm.size
        x = np.arange(5, dtype=np.float32)
        ints = np.arange(5, dtype=np.int64)
        absent = "the horovod backend has no"
        checks.raises("send", CollectiveError, f"{absent} send", lambda: comm.send(x, 1 - rank))
        checks.raises("recv", CollectiveError, f"{absent} recv", lambda: comm.recv(1 - rank))
        checks.raises("send_async", CollectiveError, f"{absent} send", lambda: comm.send_async(x, 1 - rank))
        checks.raises("recv_async", CollectiveError, f"{absent} recv", lambda: comm.recv_async(1 - rank))
        checks.raises("split", CollectiveError, "cannot form subgroups", lambda: comm.split([0]))
        for name, call in {
            "allreduce": lambda: comm.allreduce(x, algorithm="ring"),
            "allreduce_async": lambda: comm.allreduce_async(x, algorithm="tree"),
            "reduce": lambda: comm.reduce(x, algorithm="naive"),
            "broadcast": lambda: comm.broadcast(x, algorithm="ring"),
            "allgather": lambda: comm.allgather(x, algorithm="hierarchical"),
            "reduce_scatter": lambda: comm.reduce_scatter(x, algorithm="ring"),
        }.items():
            checks.raises(f"{name} algorithm", ValueError, "['horovod']", call)
        checks.raises("mean of ints", TypeError, "floor-divided", lambda: comm.allreduce(ints, ReduceOp.MEAN))
        checks.raises(
            "mean of ints async", TypeError, "floor-divided", lambda: comm.allreduce_async(ints, ReduceOp.MEAN)
        )
        checks.raises(
            "reduce_scatter mean of ints", TypeError, "floor-divided", lambda: comm.reduce_scatter(ints, ReduceOp.MEAN)
        )
        checks.raises("reduce mean of ints", TypeError, "floor-divided", lambda: comm.reduce(ints, 0, ReduceOp.MEAN))
        checks.raises("op as a string", TypeError, "ReduceOp", lambda: comm.allreduce(x, "sum"))
        checks.raises("int16 sum", TypeError, "reduces arrays of", lambda: comm.allreduce(x.astype(np.int16)))
        checks.raises("root", ValueError, "`root`", lambda: comm.broadcast(x, root=size))
        checks.raises("out=", ValueError, "`out`", lambda: comm.allreduce(x, out=np.empty(4, np.float32)))
        checks.raises("0-d reduce_scatter", ValueError, "at least one dimension", lambda: comm.reduce_scatter(x[0]))
        checks.raises("alltoall count", ValueError, "one array per rank", lambda: comm.alltoall([x]))
        checks.raises("alltoall dtypes", TypeError, "one dtype", lambda: comm.alltoall([x, ints][:size]))
        checks.raises("big-endian", TypeError, "native byte order", lambda: comm.broadcast(x.astype(">f4")))
        checks.count += 1
        offered = comm.capabilities.operations
        if (
            not offered <= set(OPERATION_NAMES)
            or offered & {"send", "recv"}
            or not comm.capabilities.in_graph_allreduce
        ):
            checks.failures.append(f"capabilities: {comm.capabilities}")

        # Dtypes Horovod does not move travel as their bytes.
        for dtype in ("uint32", "uint64", "complex64", "complex128"):
            everyone = [data(q, (3, 2), dtype) for q in range(size)]
            checks.equal(
                f"broadcast {dtype}",
                comm.broadcast(everyone[rank] if rank == 1 else np.zeros((3, 2), dtype), 1),
                everyone[1],
            )
            checks.equal(f"allgather {dtype}", comm.allgather(everyone[rank]), np.stack(everyone))
            ragged = [data(q, [(3,), (2, 2), ()][q % 3], dtype) for q in range(size)]
            checks.lists(f"allgather_v {dtype}", comm.allgather_v(ragged[rank]), ragged)
            to_each = [data(rank, (rank + j,), dtype, salt=j) for j in range(size)]
            checks.lists(
                f"alltoall {dtype}",
                comm.alltoall(to_each),
                [data(q, (q + rank,), dtype, salt=rank) for q in range(size)],
            )
            arrays = [data(1, (j + 1, 2), dtype, salt=j) for j in range(size)] if rank == 1 else None
            checks.equal(f"scatter {dtype}", comm.scatter(arrays, 1), data(1, (rank + 1, 2), dtype, salt=rank))

        # A rank that sends another dtype: every rank refuses alike, and the communicator goes on.
        checks.raises(
            "allgather_v of two dtypes",
            CollectiveError,
            "one dtype on every rank",
            lambda: comm.allgather_v(np.zeros(2, np.float32 if rank == 0 else np.int32)),
        )
        checks.equal("after a refusal", comm.allreduce(np.ones(2, np.int32)), np.full(2, size, np.int32))

        # The trainer's in-graph allreduce: None passes through, MEAN by default.
        @tf.function
        def step(a, b):
            return comm.allreduce_tensors([a, None, b]), comm.allreduce_tensors([b], op=ReduceOp.SUM)

        a = tf.constant(data(rank, (4,), "float32"))
        b = tf.constant(data(rank, (2, 3), "float64"))
        averaged, summed = step(a, b)
        checks.count += 1
        if averaged[1] is not None or len(averaged) != 3:
            checks.failures.append(f"allreduce_tensors: {averaged}")
        checks.equal(
            "allreduce_tensors a",
            averaged[0].numpy(),
            combined("MEAN", [data(q, (4,), "float32") for q in range(size)]),
        )
        checks.equal(
            "allreduce_tensors b",
            averaged[2].numpy(),
            combined("MEAN", [data(q, (2, 3), "float64") for q in range(size)]),
        )
        checks.equal(
            "allreduce_tensors sum",
            summed[0].numpy(),
            combined("SUM", [data(q, (2, 3), "float64") for q in range(size)]),
        )
        checks.count += 1
        if comm.allreduce_tensors([None, None]) != [None, None]:
            checks.failures.append("allreduce_tensors([None, None]) is not [None, None]")
        checks.raises(
            "allreduce_tensors mean of ints",
            TypeError,
            "floor-divided",
            lambda: comm.allreduce_tensors([tf.constant([1, 2])]),
        )
        return checks.done(rank)


# -- the tests -------------------------------------------------------------------------------------


def test_every_operation_matches_numpy_on_two_ranks(spark):
    checked = sparkdl.run(every_operation, num_workers=2, backend="horovod", timeout=300)
    assert checked > 400


def test_every_async_twin_matches_its_synchronous_result(spark):
    checked = sparkdl.run(every_async_twin, num_workers=2, backend="horovod", timeout=300)
    assert checked > 100


def test_refusals_bytes_and_the_in_graph_allreduce(spark):
    checked = sparkdl.run(refusals_and_bytes, num_workers=2, backend="horovod", timeout=300)
    assert checked > 40
