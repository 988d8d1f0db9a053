"""Why a subgroup on one host is as fast as its parent: its operations go through a shared-memory segment of its own.

Ranks are threads of this process over real sockets (:func:`collective_ranks.run_ranks`), all on one host. What
moved where is read from the communicator's counters (``bytes_sent``): the bytes written into a segment for the
peers, and the payload bytes of the frames that left the TCP links.
"""

import glob
import os

import numpy as np
from collective_ranks import rank_data, run_ranks

from sparkdl.collective import ReduceOp
from sparkdl.collective.shm.group import PIECE_BYTES

SIZE = 3
STEP_OPERATIONS = ("allreduce", "allgather", "reduce_scatter")
BIG = PIECE_BYTES // 4 + 1001  # float32: two pieces of an allgather and a reduce-scatter, in a segment grown for them


def _sent(comm, transport):
    """This rank's bytes of the step operations over ``transport`` so far, any dtype."""
    by_operation = comm.bytes_sent()[transport]
    return {op: sum(by_operation.get(op, {}).values()) for op in STEP_OPERATIONS}


def _our_memfds():
    """This process's open descriptors of sparkdl's segments (every rank's: the ranks are its threads)."""
    links = []
    for fd in glob.glob("/proc/self/fd/*"):
        try:
            links.append(os.readlink(fd))
        except OSError:  # glob's own descriptor, closed by now
            continue
    return [link for link in links if link.startswith("/memfd:sparkdl-")]


def test_a_split_on_one_host_moves_its_step_operations_through_shared_memory():
    """split([2, 0, 1]) on one host: allreduce, allgather and reduce_scatter give numpy's results and write their
    bytes into the subgroup's segment, a ring's bytes each (allreduce 2(N-1)/N K, reduce_scatter (N-1)/N K, allgather
    its K to N-1 peers); none over TCP."""
    inputs = [rank_data(r, (SIZE * 5, 7), np.float32) for r in range(SIZE)]
    k = inputs[0].nbytes

    def body(comm):
        before = _sent(comm, "shm")
        sub = comm.split([2, 0, 1])
        mine = inputs[sub.rank]
        results = (sub.allreduce(mine), sub.allgather(mine), sub.reduce_scatter(mine, ReduceOp.SUM))
        after = _sent(comm, "shm")
        return sub.rank, results, {op: after[op] - before[op] for op in STEP_OPERATIONS}, _sent(comm, "tcp")

    for rank, (summed, gathered, scattered), shared, over_tcp in run_ranks(SIZE, body, shared_memory=True):
        np.testing.assert_array_equal(summed, np.sum(inputs, axis=0))
        np.testing.assert_array_equal(gathered, np.stack(inputs))
        np.testing.assert_array_equal(scattered, np.sum(inputs, axis=0)[5 * rank : 5 * (rank + 1)])
        ring = k * (SIZE - 1) // SIZE
        assert shared == {"allreduce": 2 * ring, "allgather": (SIZE - 1) * k, "reduce_scatter": ring}
        assert over_tcp == dict.fromkeys(STEP_OPERATIONS, 0)


def test_two_subgroups_of_the_same_ranks_run_side_by_side_each_through_its_own_segment():
    """As ZeRO-3's two streams: one subgroup all-gathers while the other reduce-scatters, both in flight at once and
    then alternately, in two pieces each; every result is numpy's, nothing goes over TCP, and closing the job
    leaves no segment open."""
    inputs = [[rank_data(r, (BIG,), np.float32, seed=seed) for r in range(SIZE)] for seed in range(2)]
    starts = np.cumsum([0, *(len(chunk) for chunk in np.array_split(np.arange(BIG), SIZE))])

    def body(comm):
        gathers, scatters = comm.split(range(SIZE)), comm.split(range(SIZE))
        first, second = (data[comm.rank] for data in inputs)
        at_once = [gathers.allgather_async(first), scatters.reduce_scatter_async(second)]
        results = [[work.wait(timeout=60) for work in at_once]]
        results.append([gathers.allgather(second), scatters.reduce_scatter(first)])
        return results, _sent(comm, "tcp"), _sent(comm, "shm")

    for rank, (results, over_tcp, shared) in enumerate(run_ranks(SIZE, body, shared_memory=True)):
        for (gathered, scattered), (g, s) in zip(results, [(0, 1), (1, 0)]):
            np.testing.assert_array_equal(gathered, np.stack(inputs[g]))
            np.testing.assert_array_equal(scattered, np.sum(inputs[s], axis=0)[starts[rank] : starts[rank + 1]])
        assert over_tcp == dict.fromkeys(STEP_OPERATIONS, 0)
        assert shared["allgather"] > 0 and shared["reduce_scatter"] > 0
    assert _our_memfds() == []


def test_subgroups_across_hosts_share_memory_within_each_host():
    """Hosts a, a, b, b: split([3, 2, 1, 0]) allreduces hierarchically, through a segment of its own per host and
    over TCP only each local rank's half between the hosts (a 2-rank ring: K/2 sent); ``local()`` all-gathers
    through its own segment, nothing over TCP."""
    inputs = [rank_data(r, (8, 5), np.float32) for r in range(4)]
    k = inputs[0].nbytes

    def body(comm):
        before = {transport: _sent(comm, transport) for transport in ("shm", "tcp")}
        sub, local = comm.split([3, 2, 1, 0]), comm.local()
        summed, gathered = sub.allreduce(inputs[comm.rank]), local.allgather(inputs[comm.rank])
        since = [{op: _sent(comm, t)[op] - before[t][op] for op in STEP_OPERATIONS} for t in ("shm", "tcp")]
        return summed, gathered, since

    for rank, (summed, gathered, (shared, over_tcp)) in enumerate(
        run_ranks(4, body, shared_memory=True, hosts=["a", "a", "b", "b"])
    ):
        np.testing.assert_array_equal(summed, np.sum(inputs, axis=0))
        np.testing.assert_array_equal(gathered, np.stack(inputs[rank // 2 * 2 : rank // 2 * 2 + 2]))
        assert shared["allreduce"] > 0 and shared["allgather"] == k
        assert over_tcp == {"allreduce": k // 2, "allgather": 0, "reduce_scatter": 0}
