"""The cost model of communication patterns (:mod:`sparkdl.collective.cost`): the textbook byte counts, a fit that
recovers known constants, predictions that move the way they must, and the communicator's own byte counters on
loopback against the formulas. Fast: no namespaces, no Spark (benchmarks/network_patterns.py measures the rest)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from collective_ranks import run_ranks

from sparkdl.collective import cost

K = 12 * 2**20  # divides by 2, 3, 4 and 6
EVERY = sorted(cost.PATTERNS)
OPTIONS = {"hierarchical_allreduce": {"local": 2}}


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64, 1024])
def test_the_ring_moves_2_n_minus_1_over_n_k_per_rank_whatever_n(n):
    ring = cost.cost("ring_allreduce", n, K)
    assert ring.rank_sent == ring.rank_received == pytest.approx(2 * (n - 1) * K / n)
    assert ring.link_bytes == pytest.approx(2 * (n - 1) * K / n)
    assert ring.link_bytes < 2 * K
    assert ring.steps == 2 * (n - 1)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64, 1024])
def test_the_naive_root_moves_2_n_minus_1_k(n):
    naive = cost.cost("naive_allreduce", n, K)
    assert naive.rank_sent + naive.rank_received == 2 * (n - 1) * K
    assert naive.link_bytes == 2 * (n - 1) * K  # its gather and its broadcast, one after the other
    assert naive.steps == 2


def test_tree_zero_and_gossip_counts():
    assert cost.cost("tree_allreduce", 8, K).steps == 6  # ceil(log2 8) rounds each way
    assert cost.cost("tree_allreduce", 1, K).vector().tolist() == [0, 0, 0, 0]
    # sparkdl's tree queues a rank's sends at once: its children share its uplink on the critical path
    assert [cost.binomial_paths(n) for n in (2, 3, 4, 8, 16)] == [(1, 1), (2, 2), (2, 3), (3, 6), (4, 10)]
    assert cost.cost("tree_allreduce", 4, K).link_bytes == 5 * K
    assert cost.cost("tree_broadcast", 8, K).link_bytes == 6 * K
    for n in (2, 3, 4, 8):  # the network carries 2(N-1)K for every allreduce: what a shared fabric (or CPU) pays
        for algorithm in ("ring", "naive", "tree"):
            assert cost.cost(f"{algorithm}_allreduce", n, K).total_bytes == pytest.approx(2 * (n - 1) * K)
    for n in (2, 3, 16):
        ring, zero1 = cost.cost("ring_allreduce", n, K), cost.cost("zero1", n, K)
        assert (zero1.steps, zero1.link_bytes) == (ring.steps, pytest.approx(ring.link_bytes))
        zero3 = cost.cost("zero3", n, K, units=10)
        assert zero3.link_bytes == pytest.approx((3 - 1 / 10) * (n - 1) * K / n)
        assert zero3.steps == 29 * (n - 1)
        assert 1.4 < zero3.link_bytes / ring.link_bytes < 1.5
    assert cost.cost("gossip", 2, K).link_bytes == K
    assert {cost.cost("gossip", n, K).link_bytes for n in (3, 16, 1024)} == {2 * K}
    assert cost.cost("ring_reduce_scatter", 4, K).link_bytes == 3 * K / 4
    assert cost.cost("ring_allgather", 4, K).memory_bytes == 0


def test_the_parameter_server_link_carries_n_pushes_and_pulls():
    ps = cost.cost("parameter_server", 8, K)
    assert ps.rank_received == ps.rank_sent == 8 * K  # the server's link, each way
    sharded = cost.cost("sharded_ps", 8, K, servers=4)
    assert sharded.link_bytes == ps.link_bytes  # four shards on the driver: the same one link
    assert sharded.memory_bytes == ps.memory_bytes / 4 and sharded.messages == 8
    assert cost.cost("sharded_ps", 8, K, servers=4, server_hosts=4).link_bytes == 2 * K
    with pytest.raises(ValueError, match="server_hosts"):
        cost.cost("parameter_server", 8, K, servers=2, server_hosts=3)


def test_the_synchronous_server_pushes_then_pulls_and_spread_servers_carry_the_rings_bytes():
    sync_ps = cost.cost("sync_ps", 8, K)
    ps = cost.cost("parameter_server", 8, K)
    assert sync_ps.link_bytes == 2 * ps.link_bytes  # the pulls wait for the last push: no full duplex
    assert sync_ps.rank_sent == sync_ps.rank_received == 8 * K and sync_ps.steps == 2
    with pytest.raises(ValueError, match="server_hosts"):
        cost.cost("sync_ps", 8, K, servers=1, server_hosts=2)
    for n in (2, 4, 1024):  # a shard on every worker's host: each link 2(N-1)K/N each way, as the ring's
        spread = cost.cost("spread_ps", n, K)
        assert spread.link_bytes == pytest.approx(cost.cost("ring_allreduce", n, K).rank_sent)
        assert spread.messages == 2 * n and spread.memory_bytes == K
    assert cost.cost("spread_ps", 1, K).link_bytes == 0


def test_hierarchical_crosses_hosts_with_2_h_minus_1_over_h_k():
    hierarchical = cost.cost("hierarchical_allreduce", 16, K, local=8)
    assert hierarchical.link_bytes == pytest.approx(K)  # two hosts: 2(2-1)/2 K on each host's link
    assert cost.cost("hierarchical_allreduce", 4, K, local=1) == cost.cost("ring_allreduce", 4, K)
    assert cost.cost("sync", 16, K, local=8) == hierarchical
    with pytest.raises(ValueError, match="local"):
        cost.cost("hierarchical_allreduce", 6, K, local=4)


def test_unknown_patterns_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="pattern"):
        cost.cost("butterfly", 4, K)
    with pytest.raises(ValueError, match="n >= 1"):
        cost.cost("ring_allreduce", 0, K)
    with pytest.raises(ValueError, match="terms"):
        cost.fit([cost.Measurement("ring_allreduce", 2, K, 1.0)], terms=("epsilon",))
    with pytest.raises(ValueError, match="at least one"):
        cost.fit([])
    with pytest.raises(ValueError, match="positive"):
        cost.fit([cost.Measurement("ring_allreduce", 2, K, 0.0)])


def synthetic(params: cost.Params, noise: float = 0.0, seed: int = 0) -> list[cost.Measurement]:
    rng = np.random.default_rng(seed)
    rows = []
    for pattern in ("ring_allreduce", "naive_allreduce", "tree_allreduce", "ring_allgather", "naive_broadcast"):
        for n in (2, 3, 4, 8):
            for nbytes in (100e3, 1e6, 16e6, 256e6):
                seconds = cost.predict(pattern, n, nbytes, params) * (1 + noise * rng.standard_normal())
                rows.append(cost.Measurement(pattern, n, nbytes, seconds))
    return rows


def test_the_fit_recovers_known_constants():
    truth = cost.Params(alpha=250e-6, beta=1 / 117e6, gamma=0.4e-9)
    fitted = cost.fit(synthetic(truth))
    assert fitted.vector() == pytest.approx(truth.vector(), rel=1e-6, abs=1e-15)
    shared = cost.Params(alpha=250e-6, beta=1 / 117e6, gamma=0.4e-9, delta=2e-9)  # one CPU moves every packet
    assert cost.fit(synthetic(shared)).vector() == pytest.approx(shared.vector(), rel=1e-6)
    assert shared.without("delta") == truth
    noisy = cost.fit(synthetic(truth, noise=0.05, seed=3))
    assert noisy.alpha == pytest.approx(truth.alpha, rel=0.25)
    assert noisy.beta == pytest.approx(truth.beta, rel=0.05)
    assert all(abs(cost.relative_error(m, noisy)) < 0.25 for m in synthetic(truth, noise=0.05, seed=3))


def test_the_fit_never_goes_negative_and_can_leave_terms_out():
    truth = cost.Params(alpha=0.0, beta=1e-8)
    rows = synthetic(truth, noise=0.02, seed=1)
    fitted = cost.fit(rows)
    assert min(fitted.vector()) >= 0
    only_beta = cost.fit(rows, terms=("beta",))
    assert only_beta.alpha == only_beta.gamma == 0 and only_beta.beta == pytest.approx(1e-8, rel=0.05)


PARAMS = cost.Params(alpha=200e-6, beta=1 / 1.25e9, gamma=0.2e-9)


@pytest.mark.parametrize("pattern", EVERY)
def test_predictions_grow_with_the_bytes(pattern):
    options = OPTIONS.get(pattern, {})
    times = [cost.predict(pattern, 8, nbytes, PARAMS, **options) for nbytes in (0, 1e3, 1e5, 1e7, 1e9)]
    assert all(b > a for a, b in zip(times, times[1:]))


def test_predictions_scale_with_n_as_the_lectures_say():
    ranks = [2, 4, 16, 64, 256, 1024]
    ring = [cost.predict("ring_allreduce", n, 4e8, PARAMS) for n in ranks]
    bandwidth_only = cost.Params(alpha=0.0, beta=PARAMS.beta)
    ring_bytes = [cost.predict("ring_allreduce", n, 4e8, bandwidth_only) for n in ranks]
    naive = [cost.predict("naive_allreduce", n, 4e8, PARAMS) for n in ranks]
    assert all(b > a for a, b in zip(naive, naive[1:]))  # the root's link carries more with every rank
    assert naive[-1] / naive[0] > 500
    assert ring_bytes[-1] / ring_bytes[0] < 2  # the ring's bytes stay under 2K: only its latency term grows
    assert ring[-1] / ring[0] < 5  # 2046 latencies against 2
    assert all(r < v for r, v in zip(ring[1:], naive[1:]))
    # few steps win for small arrays on many ranks: the tree beats the ring there, not for large ones
    assert cost.predict("tree_allreduce", 1024, 4e3, PARAMS) < cost.predict("ring_allreduce", 1024, 4e3, PARAMS)
    assert cost.predict("tree_allreduce", 1024, 4e8, PARAMS) > cost.predict("ring_allreduce", 1024, 4e8, PARAMS)
    gossip = {cost.predict("gossip", n, 4e8, PARAMS) for n in ranks[1:]}
    assert len(gossip) == 1


def test_efficiency():
    assert cost.efficiency(0.0, 1.0) == 1.0
    assert cost.efficiency(1.0, 3.0) == 0.75
    assert cost.efficiency(0.0, 0.0) == 1.0
    assert math.isinf(cost.Params(1e-4, 0.0).bandwidth)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["ring", "naive", "tree"])
def test_the_communicators_byte_counters_match_the_formulas(n, algorithm):
    """One allreduce of K bytes on loopback threads: the payload each rank sent and received, as counted by its
    links, is what the pattern's formula says (the root's for naive and tree, every rank's for the ring)."""
    nbytes = 6 * 2**16 * 4  # float32 elements divisible by 2, 3 and 4
    pattern = f"{algorithm}_allreduce"

    def body(comm):
        data = np.ones(nbytes // 4, np.float32)
        comm.allreduce(data, algorithm=algorithm)  # opens the links this algorithm uses
        before = comm.traffic()
        comm.allreduce(data, algorithm=algorithm)
        after = comm.traffic()
        sent = sum(after[p][0] - before.get(p, (0, 0))[0] for p in after)
        received = sum(after[p][1] - before.get(p, (0, 0))[1] for p in after)
        return sent, received

    counted = run_ranks(n, body, timeout=30.0)
    formula = cost.cost(pattern, n, nbytes)
    if algorithm == "ring":
        assert set(counted) == {(formula.rank_sent, formula.rank_received)}
    else:
        busiest = max(counted, key=sum)
        assert busiest == counted[0]  # the root
        assert busiest == (formula.rank_sent, formula.rank_received)
    if algorithm == "naive":
        assert all(c == (nbytes, nbytes) for c in counted[1:])  # each other rank: K up, K down


def test_a_term_can_be_pinned_to_a_measured_value():
    truth = cost.Params(alpha=250e-6, beta=1 / 117e6, delta=2e-9)
    fitted = cost.fit(synthetic(truth), fixed={"beta": truth.beta})
    assert fitted.beta == truth.beta
    assert fitted.vector() == pytest.approx(truth.vector(), rel=1e-6, abs=1e-15)
    with pytest.raises(ValueError, match="fixed"):
        cost.fit(synthetic(truth), fixed={"bandwidth": 1.0})
