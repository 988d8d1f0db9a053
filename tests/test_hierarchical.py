"""The hierarchical allreduce crosses hosts as its design says: ranks of two (named) hosts as threads over real
loopback sockets, each host's ranks sharing a real shared-memory segment, their links' byte counters split into
the bytes that stay on a host and those that cross to the other.

The design (``sparkdl/collective/algorithms/hierarchical.py``, Horovod's): a host's ranks reduce through their
segment; local rank l then ring-allreduces slice l (K/L) with local rank l of every other host, and shares the
result through the segment again. So no byte goes over TCP within a host, and each rank crosses hosts with its
slice only, to the rank of its own local rank on the other host: per host and slice, exactly one rank crosses.
"""

import numpy as np
import pytest
from collective_ranks import rank_data, run_ranks

from sparkdl.collective import cost

LOCAL = 2  # ranks per host
HOSTS = ("host-a", "host-b")
NBYTES = 6 * 2**16 * 4  # float32 elements divisible by the ranks and the slices


def _host(rank):
    return HOSTS[rank // LOCAL]


def _moved_by_peer(algorithm):
    """Every rank's payload bytes (sent, received) to each peer in one allreduce of NBYTES (global ranks), and the
    sums it computed."""

    def body(comm):
        data = rank_data(comm.rank, (NBYTES // 4,), np.float32)
        comm.allreduce(data, algorithm=algorithm)  # its links opened
        comm.barrier()
        before = comm.traffic()
        result = comm.allreduce(data, algorithm=algorithm)
        after = comm.traffic()
        comm.barrier()
        moved = {p: (s - before.get(p, (0, 0))[0], r - before.get(p, (0, 0))[1]) for p, (s, r) in after.items()}
        return {p: m for p, m in moved.items() if m != (0, 0)}, result

    size = LOCAL * len(HOSTS)
    return run_ranks(size, body, timeout=30.0, shared_memory=True, hosts=[_host(r) for r in range(size)])


def test_each_rank_crosses_hosts_with_its_slice_only_and_nothing_travels_tcp_within_a_host():
    results = _moved_by_peer("hierarchical")
    size = LOCAL * len(HOSTS)
    expected_sum = sum(rank_data(r, (NBYTES // 4,), np.float32) for r in range(size))
    formula = cost.collective("allreduce", "hierarchical", size, NBYTES, local=LOCAL)
    crossing = {host: [] for host in HOSTS}
    for rank, (moved, result) in enumerate(results):
        np.testing.assert_array_equal(result, expected_sum)
        assert all(_host(peer) != _host(rank) for peer in moved), (rank, moved)  # within a host: shared memory only
        counterpart = (rank + LOCAL) % size  # the same local rank on the other host
        if moved:
            crossing[_host(rank)].append(rank)
            assert set(moved) == {counterpart}
            assert moved[counterpart] == (formula.rank_sent, formula.rank_received)
    # per host, one rank for each of its LOCAL slices: every local rank, each carrying K/L of the crossing
    assert crossing == {host: [r for r in range(size) if _host(r) == host] for host in HOSTS}
    for host in HOSTS:  # the host's link carries the cost model's hierarchical figure, each way
        sent = sum(sum(s for s, _ in results[r][0].values()) for r in crossing[host])
        received = sum(sum(v for _, v in results[r][0].values()) for r in crossing[host])
        assert sent == received == formula.link_bytes == pytest.approx(NBYTES)  # two hosts: 2(2-1)/2 K


def test_a_flat_ring_on_the_same_ranks_crosses_hosts_at_the_ring_boundaries_with_more_bytes():
    """The contrast that makes the hierarchical figure worth having: the ring over all four ranks (ordered host by
    host) sends within a host over TCP, and each boundary rank crosses with the ring's 2(N-1)K/N, more than a
    hierarchical rank's 2(H-1)K/(H L)."""
    results = _moved_by_peer("ring")
    size = LOCAL * len(HOSTS)
    within = sum(s for rank, (moved, _) in enumerate(results) for p, (s, _) in moved.items() if _host(p) == _host(rank))
    crossing = {
        rank: sum(s for p, (s, _) in moved.items() if _host(p) != _host(rank))
        for rank, (moved, _) in enumerate(results)
    }
    assert within > 0
    assert sorted(crossing.values()) == [0, 0, 2 * (size - 1) * NBYTES // size, 2 * (size - 1) * NBYTES // size]
    hierarchical = cost.collective("allreduce", "hierarchical", size, NBYTES, local=LOCAL)
    assert max(crossing.values()) > hierarchical.rank_sent
