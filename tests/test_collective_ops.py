"""Every operation of sparkdl's communicator against numpy: N = 1..5 ranks, every wire dtype, every ReduceOp, every
algorithm of the operation (and that it is the one that ran), subgroups, ``out=``, and the API kept in step.

Ranks are threads of this process over real 127.0.0.1 sockets (:mod:`collective_ranks`).
"""

from __future__ import annotations

import functools
import inspect
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from collective_ranks import SentFrames, rank_data, run_ranks

import sparkdl.collective
from sparkdl.collective import CollectiveError, Communicator, Listener, ReduceOp, SparkdlCommunicator, algorithms, api
from sparkdl.collective.algorithms import ring
from sparkdl.collective.api import OP_CODES, OPERATIONS
from sparkdl.collective.base import BaseCommunicator

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
INEXACT = [np.float16, np.float32, np.float64, BFLOAT16]
EXACT = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_]
COMPLEX = [np.complex64, np.complex128]
DTYPES = [np.dtype(d) for d in INEXACT + EXACT + COMPLEX]
#: Sizes that do not divide by N = 2..5, the empty and the one-element array; the last one scatters 11 rows.
SHAPES = [(0,), (1,), (7,), (11, 3)]
COMBINE = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


def reduce_ops(dtype):
    return [ReduceOp.SUM, ReduceOp.MEAN] if dtype.kind == "c" else list(ReduceOp)


def mean_refused(op, dtype):
    return op is ReduceOp.MEAN and dtype.kind in "iub"


def reduced(inputs, op):
    result = functools.reduce(lambda a, b: COMBINE[op](a, b), inputs)
    if op is ReduceOp.MEAN:
        result = np.true_divide(result, len(inputs)).astype(result.dtype)
    return result


def assert_equal(got, want):
    """Same dtype and shape; equal values (within a rounding or two where a mean divides)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if want.dtype == BFLOAT16:
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2)
    elif want.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=4 * np.finfo(want.dtype).eps)
    else:
        np.testing.assert_array_equal(got, want)


def algorithm_for(name, algorithm):
    """The algorithm to ask ``name`` for in the matrix of ``algorithm``: it, if the operation has it; else the default."""
    return algorithm if algorithm in algorithms.ALGORITHMS[name] else None


def runs_in_matrix(name, algorithm):
    """Whether the matrix of ``algorithm`` calls operation ``name``: the default's and hierarchical's (a communicator with
    shared memory, where every operation takes other paths) call all of them; ring's, tree's and naive's only those
    with a choice that includes the algorithm (where it is the only one, the default's matrix already ran it)."""
    choices = algorithms.ALGORITHMS[name]
    return algorithm in (None, "hierarchical") or (algorithm in choices and len(choices) > 1)


@pytest.mark.parametrize("algorithm", [None, "ring", "tree", "naive", "hierarchical"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_every_operation_dtype_and_reduce_op_matches_numpy(size, algorithm):
    """Sync calls for every other dtype, their ``*_async`` twins (``.wait()``) for the rest.

    ``hierarchical`` (allreduce only) runs with shared memory: on one host, and for N=4 on two hosts of two
    ranks each (the host names are made up, so the ranks of "host b" reduce through their own segment); on
    one host the same matrix runs reduce_scatter and allgather through the segment (their default there).
    Ring, tree and naive run the operations that take them (:func:`runs_in_matrix`).
    """

    def runs(name):
        return runs_in_matrix(name, algorithm)

    def body(comm):
        r = comm.rank
        for d, dtype in enumerate(DTYPES):

            def call(name, *args, asynchronous=d % 2 == 1, **kwargs):
                assert runs_in_matrix(name, algorithm), name
                if asynchronous:
                    work = getattr(comm, name + "_async")(*args, **kwargs)
                    assert isinstance(work, api.Work)
                    return work.wait(timeout=30)
                return getattr(comm, name)(*args, **kwargs)

            for s, shape in enumerate(SHAPES):
                seed = 100 * d + s
                inputs = [rank_data(q, shape, dtype, seed) for q in range(size)]
                x = inputs[r].copy()
                root = (d + s) % size
                for op in reduce_ops(dtype):
                    if mean_refused(op, dtype):  # refused before anything is sent: the ranks stay in step
                        for name, args in (("allreduce", ()), ("reduce", (root,)), ("reduce_scatter", ())):
                            if runs(name):
                                with pytest.raises(TypeError, match="floor-divided"):
                                    call(name, x, *args, op, algorithm=algorithm_for(name, algorithm))
                        continue
                    want = reduced(inputs, op)
                    assert_equal(call("allreduce", x, op, algorithm=algorithm_for("allreduce", algorithm)), want)
                    if runs("reduce"):
                        got = call("reduce", x, root, op, algorithm=algorithm_for("reduce", algorithm))
                        if r == root:
                            assert_equal(got, want)
                        else:
                            assert got is None
                    if runs("reduce_scatter"):
                        got = call("reduce_scatter", x, op, algorithm=algorithm_for("reduce_scatter", algorithm))
                        assert_equal(got, np.array_split(want, size)[r])
                got = call("broadcast", x, root, algorithm=algorithm_for("broadcast", algorithm))
                assert_equal(got, inputs[root])
                if runs("allgather"):
                    got = call("allgather", x, algorithm=algorithm_for("allgather", algorithm))
                    assert_equal(got, np.stack(inputs))
                np.testing.assert_array_equal(x, inputs[r])  # inputs untouched
                if not runs("gather"):
                    continue
                gathered = call("gather", x, root)
                if r == root:
                    assert len(gathered) == size
                    for got, want in zip(gathered, inputs):
                        assert_equal(got, want)
                else:
                    assert gathered is None
                # Unequal shapes: rank q's array for rank j has q + j + s elements.
                uneven = [[rank_data(q, (q + j + s,), dtype, seed) for j in range(size)] for q in range(size)]
                assert_equal(call("scatter", uneven[root] if r == root else None, root), uneven[root][r])
                for got, want in zip(call("allgather_v", uneven[r][0]), [uneven[q][0] for q in range(size)]):
                    assert_equal(got, want)
                for got, want in zip(call("alltoall", uneven[r]), [uneven[q][r] for q in range(size)]):
                    assert_equal(got, want)
                np.testing.assert_array_equal(x, inputs[r])  # inputs untouched
            if not runs("barrier"):
                continue
            call("barrier")
            # Messages: two to every other rank, received in the opposite order of their tags.
            for offset in range(1, size):
                dest = (r + offset) % size
                call("send", rank_data(r, (dest + 1,), dtype, d), dest, tag=2 * d)
                call("send", rank_data(r, (2, dest), dtype, d + 1), dest, tag=2 * d + 1)
            for offset in range(1, size):
                source = (r - offset) % size
                assert_equal(call("recv", source, tag=2 * d + 1), rank_data(source, (2, r), dtype, d + 1))
                into = np.empty(r + 1, dtype)
                assert call("recv", source, tag=2 * d, out=into) is into
                assert_equal(into, rank_data(source, (r + 1,), dtype, d))
        return True

    connect = {}
    if algorithm == "hierarchical":
        connect = {"shared_memory": True, "hosts": ["a", "a", "b", "b"] if size == 4 else ["a"] * size}
    assert run_ranks(size, body, algorithm=None, **connect) == [True] * size


@pytest.mark.parametrize("shared_memory", [False, True])
def test_allgather_and_reduce_scatter_write_into_out(shared_memory):
    """``out=`` receives the result (no new array), through the ring or the host's segment; a wrong one is
    refused before anything moves, so the ranks stay in step."""

    def body(comm):
        x = np.arange(10, dtype=np.float32) + comm.rank
        gathered = np.empty((comm.size, 10), np.float32)
        assert comm.allgather(x, out=gathered) is gathered
        mine = np.empty(len(np.array_split(np.arange(10), comm.size)[comm.rank]), np.float32)
        assert comm.reduce_scatter_async(x, ReduceOp.MEAN, out=mine).wait(30) is mine
        with pytest.raises(ValueError, match="Expected `out`"):
            comm.allgather(x, out=np.empty((comm.size, 9), np.float32))
        with pytest.raises(ValueError, match="Expected `out`"):
            comm.reduce_scatter(x, out=np.empty(10, np.float64))
        return gathered, mine, comm.allreduce(np.ones(1))  # still in step

    results = run_ranks(3, body, shared_memory=shared_memory)
    inputs = [np.arange(10, dtype=np.float32) + r for r in range(3)]
    for rank, (gathered, mine, ones) in enumerate(results):
        np.testing.assert_array_equal(gathered, np.stack(inputs))
        np.testing.assert_allclose(mine, np.array_split(np.mean(inputs, axis=0), 3)[rank], rtol=1e-6)
        assert ones.tolist() == [3.0]


def test_bfloat16_and_random_floats_round_within_tolerance():
    """Random floats: each hop rounds (bfloat16 at every one), so sums match numpy's within a tolerance."""

    def inputs(dtype):
        return [np.random.default_rng(q).standard_normal((257, 3)).astype(dtype) for q in range(4)]

    def body(comm):
        return {
            (dtype.name, algorithm): comm.allreduce(inputs(dtype)[comm.rank], algorithm=algorithm)
            for dtype in (np.dtype(np.float64), np.dtype(np.float32), BFLOAT16)
            for algorithm in ("ring", "tree", "naive")
        }

    tolerance = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 0.1}
    for results in run_ranks(4, body):
        for (name, _), got in results.items():
            want = np.sum([x.astype(np.float64) for x in inputs(np.dtype(name))], axis=0)
            assert got.dtype.name == name
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tolerance[name], atol=tolerance[name] * 4)


def test_many_segments_per_chunk(monkeypatch):
    """Tiny segments force the pipelined path (many frames per ring step)."""
    monkeypatch.setattr(ring, "SEGMENT_BYTES", 64)

    def body(comm):
        x = rank_data(comm.rank, (1001,), np.float64)
        rows = rank_data(comm.rank, (101, 3), np.float32)
        return (
            comm.allreduce(x, algorithm="ring"),
            comm.allgather(x, algorithm="ring"),
            comm.broadcast(x, root=2, algorithm="ring"),
            comm.reduce_scatter(rows),
        )

    inputs = [rank_data(rank, (1001,), np.float64) for rank in range(4)]
    rows = [rank_data(rank, (101, 3), np.float32) for rank in range(4)]
    for rank, (summed, gathered, broadcast, scattered) in enumerate(run_ranks(4, body)):
        np.testing.assert_array_equal(summed, np.sum(inputs, axis=0))
        np.testing.assert_array_equal(gathered, np.stack(inputs))
        np.testing.assert_array_equal(broadcast, inputs[2])
        np.testing.assert_array_equal(scattered, np.array_split(np.sum(rows, axis=0), 4)[rank])


@pytest.mark.parametrize("count, parts", [(0, 3), (1, 4), (7, 3), (10, 5), (100_003, 4)])
def test_chunks_are_sized_like_array_split(count, parts):
    bounds = ring.chunk_bounds(count, parts)
    sizes = [len(chunk) for chunk in np.array_split(np.arange(count), parts)]
    assert np.diff(bounds).tolist() == sizes and bounds[0] == 0 and bounds[-1] == count


def test_non_contiguous_and_scalar_inputs():
    def body(comm):
        matrix = np.arange(24, dtype=np.float64).reshape(4, 6) + comm.rank
        return (
            comm.allreduce(matrix[:, ::2]),
            comm.allreduce(matrix.T, algorithm="ring"),
            comm.allreduce(np.float32(comm.rank)),
            comm.allgather(np.int64(comm.rank)),
            comm.broadcast(matrix[::2], root=1),
        )

    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    for strided, transposed, scalar, gathered, broadcast in run_ranks(3, body):
        np.testing.assert_array_equal(strided, sum(base[:, ::2] + r for r in range(3)))
        np.testing.assert_array_equal(transposed, sum(base.T + r for r in range(3)))
        assert scalar.shape == () and scalar == 3
        np.testing.assert_array_equal(gathered, [0, 1, 2])
        np.testing.assert_array_equal(broadcast, base[::2] + 1)


def test_single_rank_needs_no_sockets():
    with Listener() as listener:
        comm = SparkdlCommunicator.connect(0, [listener.address], listener, b"secret", shared_memory=False)
        x = np.arange(6, dtype=np.float32).reshape(3, 2)
        for result in (comm.allreduce(x), comm.allreduce(x, ReduceOp.MEAN), comm.broadcast(x), comm.reduce(x)):
            np.testing.assert_array_equal(result, x)
            assert result is not x
        np.testing.assert_array_equal(comm.allgather(x), x[None])
        np.testing.assert_array_equal(comm.reduce_scatter(x), x)
        assert [a.tolist() for a in comm.gather(x)] == [x.tolist()]
        comm.barrier()
        assert comm.traffic() == {}
        comm.close()


def test_out_is_filled_in_place():
    def body(comm):
        x = np.arange(10, dtype=np.float32) + comm.rank
        out = np.full(10, -1, dtype=np.float32)
        assert comm.allreduce(x, out=out) is out
        assert comm.allreduce_async(x, ReduceOp.MAX, out=out, algorithm="naive").wait() is out
        in_place = x.copy()
        assert comm.allreduce(in_place, out=in_place, algorithm="ring") is in_place
        with pytest.raises(ValueError, match="Expected `out`"):
            comm.allreduce(x, out=np.empty(9, np.float32))
        with pytest.raises(ValueError, match="Expected `out`"):
            comm.allreduce(x, out=np.empty(10, np.float64))
        return out, in_place

    for out, in_place in run_ranks(3, body):
        np.testing.assert_array_equal(out, np.arange(10, dtype=np.float32) + 2)
        np.testing.assert_array_equal(in_place, 3 * np.arange(10, dtype=np.float32) + 3)


def test_unknown_algorithm_is_refused_naming_the_choices():
    with Listener() as listener:
        with pytest.raises(ValueError, match="hierarchical.*naive.*ring.*tree"):
            SparkdlCommunicator.connect(0, [listener.address], listener, b"s", shared_memory=False, algorithm="fast")

    def body(comm):
        with pytest.raises(ValueError, match=r"\['ring', 'tree', 'naive', 'hierarchical'\] for allreduce"):
            comm.allreduce(np.ones(3), algorithm="butterfly")
        with pytest.raises(ValueError, match=r"\['tree', 'naive'\] for reduce"):
            comm.reduce(np.ones(3), algorithm="ring")
        with pytest.raises(ValueError, match="hierarchical.*shared memory"):
            comm.allreduce(np.ones(3), algorithm="hierarchical")
        return comm.allreduce(np.ones(3))  # nothing was sent: still in step

    for result in run_ranks(2, body):
        np.testing.assert_array_equal(result, [2, 2, 2])


def test_async_operations_run_in_call_order():
    def body(comm):
        works = [comm.allreduce_async(np.full(5, comm.rank + i, np.int64)) for i in range(10)]
        works.append(comm.broadcast_async(np.full(3, comm.rank), root=2))
        total = comm.allreduce(np.ones(2, np.int32))  # a synchronous call waits for the queued ones
        assert all(work.done() for work in works)
        return [work.wait() for work in works], total

    for results, total in run_ranks(3, body):
        for i, got in enumerate(results[:10]):
            np.testing.assert_array_equal(got, np.full(5, 3 + 3 * i))
        np.testing.assert_array_equal(results[10], [2, 2, 2])
        np.testing.assert_array_equal(total, [3, 3])


def test_barrier_waits_for_slowest_rank():
    arrived = threading.Event()

    def body(comm):
        if comm.rank == 1:
            time.sleep(0.3)
            arrived.set()
        comm.barrier()
        return arrived.is_set()  # no rank leaves the barrier before rank 1 has reached it

    assert run_ranks(3, body) == [True, True, True]


def test_repeated_mixed_ops_stay_in_step():
    def body(comm):
        log = {}
        for i in range(40):
            x = np.full(i % 7, comm.rank + i, dtype=np.int64)
            kind = i % 5
            if kind == 0:
                log[i] = comm.allreduce(x, algorithm=("ring", "tree", "naive")[i % 3])
            elif kind == 1:
                log[i] = comm.allgather(x)
            elif kind == 2:
                log[i] = comm.broadcast(x, root=i % comm.size)
            elif kind == 3:
                log[i] = comm.allgather_v(x[: comm.rank])
            else:
                comm.barrier()
        return log

    size = 4
    for log in run_ranks(size, body):
        for i, got in log.items():
            inputs = [np.full(i % 7, rank + i, dtype=np.int64) for rank in range(size)]
            if i % 5 == 3:
                assert [a.tolist() for a in got] == [x[:q].tolist() for q, x in enumerate(inputs)]
                continue
            want = [np.sum(inputs, axis=0), np.stack(inputs), inputs[i % size]][i % 5]
            np.testing.assert_array_equal(got, want)


# -- each algorithm is the one that ran ------------------------------------------------------------------------------

N = 5


def tree_up(root):
    """A binomial reduce's edges: relative rank v sends to v without its lowest set bit."""
    return {((v + root) % N, ((v & (v - 1)) + root) % N) for v in range(1, N)}


def tree_down(root):
    """A binomial broadcast's edges: relative rank v receives from v without its highest set bit."""
    return {(((v - (1 << (v.bit_length() - 1))) + root) % N, (v + root) % N) for v in range(1, N)}


RING = {(r, (r + 1) % N) for r in range(N)}
ALL_PAIRS = {(a, b) for a in range(N) for b in range(N) if a != b}
ROOT = 2
#: (operation, algorithm) -> (its call, the (sender, receiver) pairs its frames travel: N = 5, root 2)
TRAFFIC = {
    ("allreduce", "ring"): (lambda c, x: c.allreduce(x, algorithm="ring"), RING),
    ("allreduce", "tree"): (lambda c, x: c.allreduce(x, algorithm="tree"), tree_up(0) | tree_down(0)),
    ("allreduce", "naive"): (
        lambda c, x: c.allreduce(x, algorithm="naive"),
        {(r, 0) for r in range(1, N)} | {(0, r) for r in range(1, N)},
    ),
    ("broadcast", "ring"): (lambda c, x: c.broadcast(x, ROOT, algorithm="ring"), RING - {(ROOT - 1, ROOT)}),
    ("broadcast", "tree"): (lambda c, x: c.broadcast(x, ROOT, algorithm="tree"), tree_down(ROOT)),
    ("broadcast", "naive"): (
        lambda c, x: c.broadcast(x, ROOT, algorithm="naive"),
        {(ROOT, r) for r in range(N)} - {(ROOT, ROOT)},
    ),
    ("reduce", "tree"): (lambda c, x: c.reduce(x, ROOT, algorithm="tree"), tree_up(ROOT)),
    ("reduce", "naive"): (
        lambda c, x: c.reduce(x, ROOT, algorithm="naive"),
        {(r, ROOT) for r in range(N)} - {(ROOT, ROOT)},
    ),
    ("allgather", "ring"): (lambda c, x: c.allgather(x, algorithm="ring"), RING),
    ("allgather", "naive"): (lambda c, x: c.allgather(x, algorithm="naive"), ALL_PAIRS),
    ("reduce_scatter", "ring"): (lambda c, x: c.reduce_scatter(x, algorithm="ring"), RING),
    ("gather", "naive"): (lambda c, x: c.gather(x, ROOT), {(r, ROOT) for r in range(N)} - {(ROOT, ROOT)}),
    ("scatter", "naive"): (
        lambda c, x: c.scatter([x] * N if c.rank == ROOT else None, ROOT),
        {(ROOT, r) for r in range(N)} - {(ROOT, ROOT)},
    ),
    ("allgather_v", "naive"): (lambda c, x: c.allgather_v(x), ALL_PAIRS),
    ("alltoall", "naive"): (lambda c, x: c.alltoall([x] * N), ALL_PAIRS),
    ("barrier", "tree"): (lambda c, x: c.barrier(), tree_up(0) | tree_down(0)),
}


def test_the_traffic_table_covers_every_algorithm_but_the_shared_memory_ones():
    covered = {(name, algorithm) for name, algorithm in TRAFFIC}
    wanted = {
        (name, algorithm)
        for name, names in algorithms.ALGORITHMS.items()
        for algorithm in names
        if algorithm not in ("hierarchical", "shared_memory") and name not in ("send", "recv")
    }
    assert covered == wanted


@pytest.mark.parametrize("name, algorithm", sorted(TRAFFIC))
def test_each_algorithm_is_the_one_that_ran(monkeypatch, name, algorithm):
    """The frames of the call travel exactly the algorithm's edges: e.g. a naive allreduce's go to and from rank 0
    only, a ring's from each rank to the next only."""
    sent = SentFrames(monkeypatch)
    call, edges = TRAFFIC[(name, algorithm)]

    def body(comm):
        comm.barrier()  # opens the links the algorithm will not need, as a long-running job would have them
        comm.allgather_v(np.zeros(1))
        seq = comm._seq
        call(comm, np.arange(4 * N, dtype=np.float32).reshape(N, 4))
        return seq

    seqs = run_ranks(N, body)
    assert len(set(seqs)) == 1
    assert sent.edges(OP_CODES[name], seqs[0]) == edges


def test_default_algorithm_follows_the_size_and_the_communicator():
    assert algorithms.choose("allreduce", None, None, 100, False) == "tree"
    assert algorithms.choose("allreduce", None, None, 1 << 20, False) == "ring"
    assert algorithms.choose("allreduce", None, "naive", 1 << 20, False) == "naive"
    assert algorithms.choose("reduce", None, "ring", 1 << 20, False) == "tree"  # not the reduce's: its own default
    assert algorithms.choose("allreduce", None, None, 100, True) == "hierarchical"
    # one host holding every rank: reduce-scatter and allgather through its segment alone
    assert algorithms.choose("reduce_scatter", None, None, 1 << 20, True, True) == "shared_memory"
    assert algorithms.choose("allgather", None, None, 100, True, True) == "shared_memory"
    assert algorithms.choose("allgather", None, None, 100, True, False) == "ring"  # several hosts
    with pytest.raises(ValueError, match="shared_memory.*one host"):
        algorithms.choose("reduce_scatter", "shared_memory", None, 100, True, False)


# -- subgroups ---------------------------------------------------------------------------------------------------------

HOSTS = ["a", "a", "b", "b"]


def test_split_local_and_cross_run_within_subgroups_over_the_parents_links():
    def body(comm):
        r = comm.rank
        links_before = set(comm.traffic())
        local, cross = comm.local(), comm.cross()
        assert comm.local() is local and comm.cross() is cross
        evens = comm.split([2, 0])  # in that order: global rank 2 is the subgroup's rank 0
        results = {
            "local": (local.rank, local.size, local.allreduce(np.array([r]), algorithm="ring")),
            "cross": (cross.rank, cross.size, cross.allreduce(np.array([r]), algorithm="naive")),
            "all": comm.allreduce(np.array([r])),
        }
        if evens is None:
            assert r % 2
        else:
            results["evens"] = (evens.rank, evens.size, evens.allgather(np.array([r])), evens.broadcast(np.array([r])))
            results["evens_a2a"] = evens.alltoall([np.array([r, j]) for j in range(2)])
        results["local_mean"] = local.allreduce_async(np.array([float(r)]), ReduceOp.MEAN).wait()
        local.barrier()
        cross.barrier()
        results["links"] = set(comm.traffic()) <= links_before | {q for q in range(4) if q != r}
        return results

    results = run_ranks(4, body, hosts=HOSTS)
    for r, got in enumerate(results):
        assert got["local"][:2] == (r % 2, 2) and got["local"][2].tolist() == [1 if r < 2 else 5]
        assert got["cross"][:2] == (r // 2, 2) and got["cross"][2].tolist() == [2 if r % 2 == 0 else 4]
        assert got["all"].tolist() == [6]
        assert got["local_mean"].tolist() == [0.5 if r < 2 else 2.5]
        if r % 2 == 0:
            assert got["evens"][:2] == ({2: 0, 0: 1}[r], 2)
            assert got["evens"][2].tolist() == [[2], [0]] and got["evens"][3].tolist() == [2]
            assert [a.tolist() for a in got["evens_a2a"]] == [[2, {2: 0, 0: 1}[r]], [0, {2: 0, 0: 1}[r]]]
        assert got["links"]


def test_subgroups_do_not_mix_up_frames():
    """Two subgroups of the same ranks interleave on the same links: rank 1 asks for group B's frames first, while
    group A's are already queued ahead of them on its link from rank 0; they are kept for A, not taken for B."""

    def body(comm):
        a = comm.split([0, 1])
        b = comm.split([0, 1])
        if comm.rank == 0:
            a.gather(np.array([10, 11]), root=1)
            b.gather(np.array([20]), root=1)
            a.send(np.array([1.5]), 1, tag=3)
            b.send(np.array([2.5]), 1, tag=3)
            return None
        time.sleep(0.2)  # both groups' frames are queued on the link by now
        from_b = b.gather(np.array([21]), root=1)
        from_b_message = b.recv(0, tag=3)
        from_a = a.gather(np.array([12]), root=1)
        from_a_message = a.recv(0, tag=3)
        return [x.tolist() for x in (*from_a, *from_b, from_a_message, from_b_message)]

    assert run_ranks(2, body)[1] == [[10, 11], [12], [20], [21], [1.5], [2.5]]


def test_subgroups_and_parent_run_at_once_over_shared_links():
    """Each communicator is its own stream: operations of two subgroups and of the parent, in flight at once, read
    the same links from three threads; each gets its own frames and its own scratch space."""

    def body(comm):
        a, b = comm.split([0, 1, 2]), comm.split([2, 1, 0])
        results = []
        for i in range(20):
            works = [
                a.allreduce_async(np.full(3000, comm.rank + i, np.float64), algorithm="ring"),
                b.allreduce_async(np.full(3000, 10 * comm.rank + i, np.float64), algorithm=("naive", "tree")[i % 2]),
                comm.allgather_async(np.full(2, comm.rank + i)),
            ]
            results.append([work.wait(timeout=30) for work in works])
        return results

    for results in run_ranks(3, body):
        for i, (summed_a, summed_b, gathered) in enumerate(results):
            np.testing.assert_array_equal(summed_a, np.full(3000, 3 + 3 * i))
            np.testing.assert_array_equal(summed_b, np.full(3000, 30 + 3 * i))
            np.testing.assert_array_equal(gathered, [[i, i], [i + 1, i + 1], [i + 2, i + 2]])


def test_split_is_refused_for_bad_ranks():
    def body(comm):
        for bad in ([0, 0], [0, 3], []):
            with pytest.raises(ValueError, match="distinct ranks in 0..2"):
                comm.split(bad)
        return True

    assert run_ranks(3, body) == [True] * 3


# -- the API in step ---------------------------------------------------------------------------------------------------


def test_operations_protocol_base_and_module_functions_are_in_step():
    names = [operation.name for operation in OPERATIONS]
    assert len(set(names)) == len(names) and len({op.code for op in OPERATIONS}) == len(names)
    protocol = {name for name, _ in inspect.getmembers(Communicator, inspect.isfunction)}
    base = {name for name, _ in inspect.getmembers(BaseCommunicator, inspect.isfunction)}
    for name in names:
        for method in (name, name + "_async"):
            assert method in protocol, method
            assert method in base, method
            assert callable(getattr(sparkdl.collective, method)), method
            assert method in sparkdl.collective.__all__, method
            assert getattr(sparkdl.collective, method).__name__ == method
            # The same parameters in the protocol and the base class.
            assert list(inspect.signature(getattr(Communicator, method)).parameters) == list(
                inspect.signature(getattr(BaseCommunicator, method)).parameters
            ), method
    operations = {method.removesuffix("_async") for method in protocol | base if not method.startswith("_")}
    assert operations - {"split", "local", "cross", "close", "traffic"} == set(names)
    assert set(algorithms.ALGORITHMS) == set(names)
    assert SparkdlCommunicator.capabilities.operations == frozenset(names)
    with Listener() as listener:
        with SparkdlCommunicator.connect(0, [listener.address], listener, b"s", shared_memory=False) as comm:
            assert isinstance(comm, Communicator)


def test_a_closed_communicator_refuses_operations():
    with Listener() as listener:
        comm = SparkdlCommunicator.connect(0, [listener.address], listener, b"s", shared_memory=False)
        comm.close()
        comm.close()
        with pytest.raises(CollectiveError, match="closed communicator"):
            comm.allreduce(np.ones(2))
