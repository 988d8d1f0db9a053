"""An allreduce algorithm registered from outside sparkdl (recursive doubling, ``tests/recursive_doubling.py``) runs on a real
communicator of several ranks over real sockets, asked for per call or as the communicator's default, gives the
ring's results, moves the bytes its own cost says, and is priced by the cost model; once unregistered, it is
gone from all of them. No edit inside ``sparkdl/`` makes it so."""

from __future__ import annotations

import numpy as np
import pytest
from collective_ranks import SentFrames, rank_data, run_ranks
from recursive_doubling import NAME, RecursiveDoubling, recursive_doubling_edges

from sparkdl.collective import Algorithm, ReduceOp, SparkdlCommunicator, cost, register_algorithm, unregister_algorithm
from sparkdl.collective.algorithms import ALGORITHMS
from sparkdl.collective.api import OP_CODES


@pytest.fixture
def registered():
    algorithm = RecursiveDoubling()
    register_algorithm(algorithm)
    try:
        yield algorithm
    finally:
        unregister_algorithm(NAME)


@pytest.mark.parametrize("size", [3, 4])
def test_a_registered_allreduce_runs_on_real_ranks_and_gives_the_rings_results(monkeypatch, registered, size):
    frames = SentFrames(monkeypatch)
    k = 6 * 2**12 * 4  # float32s, exact in any order of summation

    def body(comm):
        x = rank_data(comm.rank, (k // 4,), np.float32, seed=1)
        wanted = {op: comm.allreduce(x, op, algorithm="ring") for op in ReduceOp}
        comm.barrier()
        counts = comm.bytes_sent()["tcp"].get("allreduce", {}).get("float32", 0)
        got = {op: comm.allreduce(x, op, algorithm=NAME) for op in ReduceOp}
        sent = comm.bytes_sent()["tcp"]["allreduce"]["float32"] - counts
        seq = comm._seq - 1  # the last allreduce's call number
        integers = comm.allreduce(np.arange(5, dtype=np.int64) * (comm.rank + 1), algorithm=NAME)
        return wanted, got, sent, seq, integers

    results = run_ranks(size, body)
    for wanted, got, _, _, integers in results:
        for op in ReduceOp:
            np.testing.assert_array_equal(got[op], wanted[op])
        np.testing.assert_array_equal(integers, np.arange(5) * sum(range(1, size + 1)))
    assert registered.calls == len(ReduceOp) * size + size  # every rank ran it for each of its calls
    # the bytes each rank's links sent for its allreduces are what its cost says, once per ReduceOp
    counted = cost.collective("allreduce", NAME, size, k)
    assert max(sent for _, _, sent, _, _ in results) == len(ReduceOp) * counted.rank_sent
    assert sum(sent for _, _, sent, _, _ in results) == len(ReduceOp) * counted.total_bytes
    # and its frames travel its own edges: pairs that differ in one bit, not a ring's neighbours
    seqs = {seq for _, _, _, seq, _ in results}
    assert len(seqs) == 1
    assert frames.edges(OP_CODES["allreduce"], seqs.pop()) == recursive_doubling_edges(size)


def test_it_is_the_communicators_default_when_connected_with_its_name(monkeypatch, registered):
    frames = SentFrames(monkeypatch)

    def body(comm):
        comm.barrier()
        seq = comm._seq
        reduced = comm.allreduce(np.full(3, comm.rank + 1.0))  # no algorithm named: the communicator's default
        comm.reduce(np.ones(2), root=0)  # an operation it does not have: that operation's own default
        return seq, reduced

    results = run_ranks(4, body, algorithm=NAME)
    for _, reduced in results:
        np.testing.assert_array_equal(reduced, np.full(3, 10.0))
    assert frames.edges(OP_CODES["allreduce"], results[0][0]) == recursive_doubling_edges(4)
    assert registered.calls == 4


def test_it_appears_in_the_registry_the_capabilities_and_the_cost_model_until_unregistered():
    algorithm = RecursiveDoubling()
    register_algorithm(algorithm)
    try:
        assert NAME in ALGORITHMS["allreduce"] and NAME not in ALGORITHMS["broadcast"]
        assert NAME in SparkdlCommunicator.capabilities.algorithms
        assert ("allreduce", NAME) in cost.priced()
        ring = cost.predict(cost.collective("allreduce", "ring", 1024, 4e3), cost.Params(1e-4, 1e-9))
        doubling = cost.predict(cost.collective("allreduce", NAME, 1024, 4e3), cost.Params(1e-4, 1e-9))
        assert doubling < ring  # 10 rounds against the ring's 2046 steps, for a small array
        with pytest.raises(ValueError, match="taken"):
            register_algorithm(RecursiveDoubling())
    finally:
        unregister_algorithm(NAME)
    assert NAME not in ALGORITHMS["allreduce"] and NAME not in SparkdlCommunicator.capabilities.algorithms
    assert ("allreduce", NAME) not in cost.priced()
    with pytest.raises(ValueError, match="recursive_doubling"):
        cost.collective("allreduce", NAME, 4, 1e3)
    with pytest.raises(ValueError, match="Expected `algorithm` to be one of"):
        run_ranks(2, lambda comm: comm.allreduce(np.ones(2), algorithm=NAME))


def test_an_algorithm_that_does_not_implement_what_it_declares_is_refused():
    class Declared(Algorithm):
        name = "declared"
        operations = frozenset({"allreduce", "broadcast"})

        def allreduce(self, comm, flat, out, op):
            out[...] = flat

    with pytest.raises(ValueError, match=r"no method for \['broadcast'\]"):
        register_algorithm(Declared())
    assert "declared" not in ALGORITHMS["allreduce"]
