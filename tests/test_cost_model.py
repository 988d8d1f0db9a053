"""The cost model of communication patterns (:mod:`sparkdl.collective.cost`): the textbook byte counts, a fit that
recovers known constants, predictions that move the way they must, and, for every pattern it prices, the bytes and
messages it predicts against what the pattern's implementation moves on loopback (threads as ranks, real sockets,
real parameter servers), as the communicator's links and the parameter-server clients and servers count them.
No namespaces, no Spark (benchmarks/network_patterns.py measures the times)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from collective_ranks import SentFrames, run_ranks

from sparkdl.collective import cost
from sparkdl.collective.algorithms import tree
from sparkdl.planner import mode_costs

K = 12 * 2**20  # divides by 2, 3, 4 and 6
#: Every pattern the model prices: the collectives' by (operation, algorithm), the modes' by name.
EVERY = [*sorted(cost.priced()), *sorted(mode_costs.PATTERNS)]
OPTIONS = {("allreduce", "hierarchical"): {"local": 2}}


def counts(pattern, n, nbytes, **options):
    """A pattern's counts: a collective's (an (operation, algorithm) pair) or a mode's (its name)."""
    if isinstance(pattern, tuple):
        return cost.collective(*pattern, n, nbytes, **options)
    return mode_costs.cost(pattern, n, nbytes, **options)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64, 1024])
def test_the_ring_moves_2_n_minus_1_over_n_k_per_rank_whatever_n(n):
    ring = cost.collective("allreduce", "ring", n, K)
    assert ring.rank_sent == ring.rank_received == pytest.approx(2 * (n - 1) * K / n)
    assert ring.link_bytes == pytest.approx(2 * (n - 1) * K / n)
    assert ring.link_bytes < 2 * K
    assert ring.steps == 2 * (n - 1)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64, 1024])
def test_the_naive_root_moves_2_n_minus_1_k(n):
    naive = cost.collective("allreduce", "naive", n, K)
    assert naive.rank_sent + naive.rank_received == 2 * (n - 1) * K
    assert naive.link_bytes == 2 * (n - 1) * K  # its gather and its broadcast, one after the other
    assert naive.steps == 2


def test_tree_zero_and_gossip_counts():
    assert cost.collective("allreduce", "tree", 8, K).steps == 6  # ceil(log2 8) rounds each way
    assert cost.collective("allreduce", "tree", 1, K).vector().tolist() == [0, 0, 0, 0]
    # sparkdl's tree queues a rank's sends at once: its children share its uplink on the critical path
    assert [tree.binomial_paths(n) for n in (2, 3, 4, 8, 16)] == [(1, 1), (2, 2), (2, 3), (3, 6), (4, 10)]
    assert cost.collective("allreduce", "tree", 4, K).link_bytes == 5 * K
    assert cost.collective("broadcast", "tree", 8, K).link_bytes == 6 * K
    for n in (2, 3, 4, 8):  # the network carries 2(N-1)K for every allreduce: what a shared fabric (or CPU) pays
        for algorithm in ("ring", "naive", "tree"):
            assert cost.collective("allreduce", algorithm, n, K).total_bytes == pytest.approx(2 * (n - 1) * K)
    for n in (2, 3, 16):
        ring, zero1 = cost.collective("allreduce", "ring", n, K), mode_costs.cost("zero1", n, K)
        assert (zero1.steps, zero1.link_bytes) == (ring.steps, pytest.approx(ring.link_bytes))
        zero3 = mode_costs.cost("zero3", n, K, units=10)
        assert zero3.link_bytes == pytest.approx((3 - 1 / 10) * (n - 1) * K / n)
        assert zero3.steps == 29 * (n - 1)
        assert 1.4 < zero3.link_bytes / ring.link_bytes < 1.5
    assert mode_costs.cost("gossip", 2, K).link_bytes == K
    assert {mode_costs.cost("gossip", n, K).link_bytes for n in (3, 16, 1024)} == {2 * K}
    assert cost.collective("reduce_scatter", "ring", 4, K).link_bytes == 3 * K / 4
    assert cost.collective("allgather", "ring", 4, K).memory_bytes == 0


def test_the_parameter_server_link_carries_n_pushes_and_pulls():
    ps = mode_costs.cost("parameter_server", 8, K)
    assert ps.rank_received == ps.rank_sent == 8 * K  # the server's link, each way
    sharded = mode_costs.cost("sharded_ps", 8, K, servers=4)
    assert sharded.link_bytes == ps.link_bytes  # four shards on the driver: the same one link
    assert sharded.memory_bytes == ps.memory_bytes / 4 and sharded.messages == 8
    assert mode_costs.cost("sharded_ps", 8, K, servers=4, server_hosts=4).link_bytes == 2 * K
    with pytest.raises(ValueError, match="server_hosts"):
        mode_costs.cost("parameter_server", 8, K, servers=2, server_hosts=3)


def test_the_synchronous_server_pushes_then_pulls_and_spread_servers_carry_the_rings_bytes():
    sync_ps = mode_costs.cost("sync_ps", 8, K)
    ps = mode_costs.cost("parameter_server", 8, K)
    assert sync_ps.link_bytes == 2 * ps.link_bytes  # the pulls wait for the last push: no full duplex
    assert sync_ps.rank_sent == sync_ps.rank_received == 8 * K and sync_ps.steps == 2
    with pytest.raises(ValueError, match="server_hosts"):
        mode_costs.cost("sync_ps", 8, K, servers=1, server_hosts=2)
    for n in (2, 4, 1024):  # a shard on every worker's host: each link 2(N-1)K/N each way, as the ring's
        spread = mode_costs.cost("spread_ps", n, K)
        assert spread.link_bytes == pytest.approx(cost.collective("allreduce", "ring", n, K).rank_sent)
        assert spread.messages == 2 * n and spread.memory_bytes == K
    assert mode_costs.cost("spread_ps", 1, K).link_bytes == 0


def test_hierarchical_crosses_hosts_with_2_h_minus_1_over_h_k():
    hierarchical = cost.collective("allreduce", "hierarchical", 16, K, local=8)
    assert hierarchical.link_bytes == pytest.approx(K)  # two hosts: 2(2-1)/2 K on each host's link
    assert cost.collective("allreduce", "hierarchical", 4, K, local=1) == cost.collective("allreduce", "ring", 4, K)
    assert mode_costs.cost("sync", 16, K, local=8) == hierarchical
    with pytest.raises(ValueError, match="local"):
        cost.collective("allreduce", "hierarchical", 6, K, local=4)


def test_unknown_patterns_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="pattern"):
        mode_costs.cost("butterfly", 4, K)
    with pytest.raises(ValueError, match="n >= 1"):
        cost.collective("allreduce", "ring", 0, K)
    with pytest.raises(ValueError, match="terms"):
        cost.fit([cost.Measurement(cost.collective("allreduce", "ring", 2, K), 1.0)], terms=("epsilon",))
    with pytest.raises(ValueError, match="at least one"):
        cost.fit([])
    with pytest.raises(ValueError, match="positive"):
        cost.fit([cost.Measurement(cost.collective("allreduce", "ring", 2, K), 0.0)])


def synthetic(params: cost.Params, noise: float = 0.0, seed: int = 0) -> list[cost.Measurement]:
    rng = np.random.default_rng(seed)
    rows = []
    patterns = [("allreduce", "ring"), ("allreduce", "naive"), ("allreduce", "tree"), ("allgather", "ring")]
    for pattern in [*patterns, ("broadcast", "naive")]:
        for n in (2, 3, 4, 8):
            for nbytes in (100e3, 1e6, 16e6, 256e6):
                counted = cost.collective(*pattern, n, nbytes)
                seconds = cost.predict(counted, params) * (1 + noise * rng.standard_normal())
                rows.append(cost.Measurement(counted, seconds))
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
    times = [cost.predict(counts(pattern, 8, nbytes, **options), PARAMS) for nbytes in (0, 1e3, 1e5, 1e7, 1e9)]
    assert all(b > a for a, b in zip(times, times[1:]))


def test_predictions_scale_with_n_as_the_lectures_say():
    ranks = [2, 4, 16, 64, 256, 1024]
    ring = [cost.predict(cost.collective("allreduce", "ring", n, 4e8), PARAMS) for n in ranks]
    bandwidth_only = cost.Params(alpha=0.0, beta=PARAMS.beta)
    ring_bytes = [cost.predict(cost.collective("allreduce", "ring", n, 4e8), bandwidth_only) for n in ranks]
    naive = [cost.predict(cost.collective("allreduce", "naive", n, 4e8), PARAMS) for n in ranks]
    assert all(b > a for a, b in zip(naive, naive[1:]))  # the root's link carries more with every rank
    assert naive[-1] / naive[0] > 500
    assert ring_bytes[-1] / ring_bytes[0] < 2  # the ring's bytes stay under 2K: only its latency term grows
    assert ring[-1] / ring[0] < 5  # 2046 latencies against 2
    assert all(r < v for r, v in zip(ring[1:], naive[1:]))
    # few steps win for small arrays on many ranks: the tree beats the ring there, not for large ones
    assert cost.predict(cost.collective("allreduce", "tree", 1024, 4e3), PARAMS) < cost.predict(
        cost.collective("allreduce", "ring", 1024, 4e3), PARAMS
    )
    assert cost.predict(cost.collective("allreduce", "tree", 1024, 4e8), PARAMS) > cost.predict(
        cost.collective("allreduce", "ring", 1024, 4e8), PARAMS
    )
    gossip = {cost.predict(mode_costs.cost("gossip", n, 4e8), PARAMS) for n in ranks[1:]}
    assert len(gossip) == 1


def test_efficiency():
    assert cost.efficiency(0.0, 1.0) == 1.0
    assert cost.efficiency(1.0, 3.0) == 0.75
    assert cost.efficiency(0.0, 0.0) == 1.0
    assert math.isinf(cost.Params(1e-4, 0.0).bandwidth)


# -- every pattern against what its implementation moves -----------------------------------------------------------


class Moved:
    """Per rank of a run, what it moved in the measured call: payload bytes sent and received (its links'
    counters) and the frames it sent (``SentFrames``)."""

    def __init__(self, sent, received, messages):
        self.sent, self.received, self.messages = list(sent), list(received), list(messages)

    def busiest(self):
        """(most sent, most received, most messages): what the model's ``rank_*`` and ``messages`` count."""
        return max(self.sent), max(self.received), max(self.messages)


def _on_ranks(n, frames, prepare, call, **connect):
    """Runs ``prepare(comm)`` (its state, links opened) then ``call(comm, state)`` on ``n`` loopback ranks: the
    bytes and frames each rank moved in ``call`` alone."""

    def body(comm):
        state = prepare(comm)
        call(comm, state)  # every link the call uses is open, every buffer allocated
        comm.barrier()
        before, sent_before = comm.traffic(), _frames_of(frames, comm.rank)
        call(comm, state)
        after, sent_after = comm.traffic(), _frames_of(frames, comm.rank)
        comm.barrier()
        sent = sum(after[p][0] - before.get(p, (0, 0))[0] for p in after)
        received = sum(after[p][1] - before.get(p, (0, 0))[1] for p in after)
        return sent, received, sent_after - sent_before

    counted = run_ranks(n, body, timeout=30.0, **connect)
    return Moved(*zip(*counted))


def _frames_of(frames, rank):
    with frames._lock:
        return sum(1 for sender, _, _ in frames.frames if sender == rank)


def _floats(nbytes):
    return np.ones(nbytes // 4, np.float32)


def _collective(operation, algorithm, per_rank_bytes=lambda n, k: k):
    """A collective's call on K bytes (``per_rank_bytes``: what each rank passes in, e.g. K/N for an allgather)."""

    def measure(frames, n, k):
        def call(comm, data):
            getattr(comm, operation)(data, algorithm=algorithm)

        return _on_ranks(n, frames, lambda comm: _floats(int(per_rank_bytes(n, k))), call)

    return measure


def _sync(frames, n, k):
    """Sync mode's reducer (``modes/sync/reducer.py``) on one step's gradients, run eagerly."""
    import tensorflow as tf

    from sparkdl.modes.sync.reducer import GradientReducer

    def prepare(comm):
        return GradientReducer(comm, timeout=30.0), [tf.constant(_floats(k))]

    def call(comm, state):
        reducer, gradients = state
        reducer(lambda grads, variables: None, gradients, [None])

    return _on_ranks(n, frames, prepare, call)


def _dense_chain(width, layers, optimizer="sgd"):
    """A chain of ``layers`` Dense layers of ``width`` on ``width`` inputs: (width + 1) * width floats each."""
    import keras

    model = keras.Sequential([keras.Input((width,)), *(keras.layers.Dense(width) for _ in range(layers))])
    model.compile(optimizer, "mse")
    return model


def _zero1(frames, n, k):
    """Sharded mode's optimizer (``modes/sync/sharded.py``, ZeRO-1) applying one step's gradients, run eagerly: the
    gradients reduce-scattered, the shards all-gathered."""
    import contextlib

    from sparkdl.modes.sync.sharded import sharded_optimizer

    width = 11  # one Dense(11) on 11 inputs: 132 floats, a multiple of 2, 3 and 4 (no padding)
    assert k == (width + 1) * width * 4

    def prepare(comm):
        model = _dense_chain(width, 1)
        stack = contextlib.ExitStack()
        state = stack.enter_context(sharded_optimizer(model, comm, timeout=30.0))
        gradients = [np.ones(v.shape, np.float32) for v in model.trainable_variables]
        return stack, state, model, gradients

    def call(comm, prepared):
        _, state, model, gradients = prepared
        state.optimizer.apply(gradients, model.trainable_variables)

    return _on_ranks(n, frames, prepare, call)


def _zero3(frames, n, k, units, reshard_after_forward=True):
    """Fully sharded mode's engine (``modes/fully_sharded/engine.py``, ZeRO-3): one training step of a model of
    ``units`` equal units."""
    from sparkdl.modes.fully_sharded import state
    from sparkdl.modes.fully_sharded import units as unit_plans
    from sparkdl.modes.fully_sharded.engine import FullyShardedReplica

    width = 5  # Dense(5) on 5 inputs: 30 floats a unit, a multiple of 2 and 3 (no padding)
    assert k == units * (width + 1) * width * 4
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, width)).astype(np.float32), rng.standard_normal((4, width)).astype(np.float32)

    def prepare(comm):
        model = _dense_chain(width, units)
        plan = unit_plans.plan_units(model)
        layout = unit_plans.shard_layout(model, plan, comm.size)
        part = state.read_part(state.rank_part(model, plan, layout, comm.rank))
        return FullyShardedReplica.from_part(
            plan,
            layout,
            comm,
            part,
            model.get_compile_config(),
            timeout=30,
            kept_gathered=1 if reshard_after_forward else units,
        )

    return _on_ranks(n, frames, prepare, lambda comm, replica: replica.train_step(x, y))


def _gossip(frames, n, k):
    """Gossip mode's round (``modes/gossip/exchange.py``) with ring peers."""
    from sparkdl.modes.gossip.exchange import Gossip

    def call(comm, gossip):
        gossip.start(_floats(k), gossip.rounds)
        gossip.finish()

    return _on_ranks(n, frames, lambda comm: Gossip(comm, "ring", seed=0, timeout=30.0), call)


def _pipeline(frames, n, k, micro_batches):
    """Pipeline mode's stages (``modes/pipeline/engine.py``): one GPipe step of a chain cut into ``n`` stages, each
    cut carrying micro-batches of ``k`` bytes of activations (gradients back)."""
    import keras

    from sparkdl.modes.pipeline.cut import build_stage, plan_stages, stage_weights
    from sparkdl.modes.pipeline.engine import PipelineStage

    width = 4
    rows = k // 4 // width * micro_batches
    model = _dense_chain(width, n)
    plan = plan_stages(model, n)
    weights = [stage_weights(model, plan, s) for s in range(n)]
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((rows, width)).astype(np.float32), rng.standard_normal((rows, width)).astype(np.float32)

    def prepare(comm):
        stage = build_stage(plan, comm.rank, weights[comm.rank])
        return PipelineStage(stage, comm, micro_batches, "mse", keras.optimizers.SGD(0.1), timeout=30.0)

    def call(comm, engine):
        engine.train_step(x if comm.rank == 0 else None, y if comm.rank == n - 1 else None, rows=len(x))

    return _on_ranks(n, frames, prepare, call)


def _hierarchical(frames, n, k, local):
    """The hierarchical allreduce on ``n`` ranks, ``local`` to a host (fake host names, one real segment each)."""
    hosts = [f"host{rank // local}" for rank in range(n)]

    def call(comm, data):
        comm.allreduce(data, algorithm="hierarchical")

    return _on_ranks(n, frames, lambda comm: _floats(k), call, shared_memory=True, hosts=hosts)


COLLECTIVE_MEASURES = {
    ("allreduce", "ring"): _collective("allreduce", "ring"),
    ("allreduce", "naive"): _collective("allreduce", "naive"),
    ("allreduce", "tree"): _collective("allreduce", "tree"),
    ("allreduce", "hierarchical"): _hierarchical,
    ("reduce_scatter", "ring"): _collective("reduce_scatter", "ring"),
    ("allgather", "ring"): _collective("allgather", "ring", lambda n, k: k / n),
    ("allgather", "naive"): _collective("allgather", "naive", lambda n, k: k / n),
    ("broadcast", "ring"): _collective("broadcast", "ring"),
    ("broadcast", "tree"): _collective("broadcast", "tree"),
    ("broadcast", "naive"): _collective("broadcast", "naive"),
    "sync": _sync,
    "zero1": _zero1,
    "zero3": _zero3,
    "gossip": _gossip,
    "pipeline": _pipeline,
}
#: Each collective pattern's measured case: ranks, bytes and the pattern's options. Sizes are exact multiples of
#: the ranks (no padding) and, for the ring, span several segments of ``SEGMENT_BYTES`` where that is cheap.
COLLECTIVE_CASES = {
    ("allreduce", "ring"): [(2, 6 * 2**16 * 4, {}), (3, 6 * 2**20 + 3 * 2**16 * 4, {}), (4, 6 * 2**16 * 4, {})],
    ("allreduce", "naive"): [(3, 6 * 2**16 * 4, {}), (4, 6 * 2**16 * 4, {})],
    ("allreduce", "tree"): [(3, 6 * 2**16 * 4, {}), (4, 6 * 2**16 * 4, {})],
    ("allreduce", "hierarchical"): [(4, 6 * 2**16 * 4, {"local": 2})],
    ("reduce_scatter", "ring"): [(3, 6 * 2**16 * 4, {})],
    ("allgather", "ring"): [(3, 6 * 2**16 * 4, {})],
    ("allgather", "naive"): [(3, 6 * 2**16 * 4, {})],
    ("broadcast", "ring"): [(3, 2 * 2**20 + 4096, {})],  # two segments
    ("broadcast", "tree"): [(4, 6 * 2**16 * 4, {})],
    ("broadcast", "naive"): [(3, 6 * 2**16 * 4, {})],
    "sync": [(3, 6 * 2**16 * 4, {})],
    "zero1": [(3, 12 * 11 * 4, {})],
    "zero3": [(3, 3 * 30 * 4, {"units": 3}), (3, 3 * 30 * 4, {"units": 3, "reshard_after_forward": False})],
    "gossip": [(2, 6 * 2**10 * 4, {}), (3, 6 * 2**10 * 4, {})],
    "pipeline": [(2, 2 * 4 * 4, {"micro_batches": 2}), (3, 2 * 4 * 4, {"micro_batches": 3})],
}
#: Point-to-point messages (gossip's weights, the pipeline's activations) go as ``send_array``: a frame of the
#: array's shape (8 bytes a dimension, plus one for the count) before the array's own. The model counts arrays.
SHAPE_FRAMES = {"gossip": 2 * 8, "pipeline": 3 * 8}

PS_PATTERNS = ("parameter_server", "sharded_ps", "sync_ps", "spread_ps")


def test_every_pattern_the_cost_model_prices_is_measured_on_its_implementation():
    """A pattern added to the cost model (an algorithm's cost, a mode's) fails here until a test measures it against
    what its implementation moves."""
    assert set(COLLECTIVE_MEASURES) | set(PS_PATTERNS) == set(EVERY)
    assert set(COLLECTIVE_CASES) == set(COLLECTIVE_MEASURES)


@pytest.mark.parametrize(
    "pattern, n, nbytes, options",
    [(pattern, *case) for pattern in COLLECTIVE_CASES for case in COLLECTIVE_CASES[pattern]],
)
def test_the_bytes_and_messages_a_pattern_predicts_are_what_its_implementation_moves(
    monkeypatch, pattern, n, nbytes, options
):
    """One call (or training step) of the pattern's implementation on loopback ranks (threads): the busiest rank's
    payload bytes sent and received (its links' counters) and frames sent, and the bytes all ranks sent, are the
    model's ``rank_sent``, ``rank_received``, ``messages`` and ``total_bytes``."""
    frames = SentFrames(monkeypatch)
    moved = COLLECTIVE_MEASURES[pattern](frames, n, nbytes, **options)
    formula = counts(pattern, n, nbytes, **options)
    shape = SHAPE_FRAMES.get(pattern, 0)
    per_message = 1 if not shape else 2  # a shape frame with every array
    expected = (
        formula.rank_sent + formula.messages * shape,
        formula.rank_received + formula.messages * shape,
        formula.messages * per_message,
    )
    assert moved.busiest() == expected, (pattern, moved.sent, moved.received, moved.messages)
    messages_in_all = sum(moved.messages) // per_message
    assert sum(moved.sent) == formula.total_bytes + messages_in_all * shape


def _ps_step(pattern, n, k, options):
    """One step of every one of ``n`` workers through the parameter-server mode's exchange
    (``modes/parameter_server/push_pull.py``: a push of the shards' gradients, then a pull of their weights), on
    real servers on loopback: each worker's bytes and requests to each shard (its client's counters) and each
    server's counters (``ParameterServer.stats``)."""
    from ps_servers import client, server
    from shards import make_shards

    from sparkdl.modes.parameter_server.push_pull import PushPull, PushSteps
    from sparkdl.net.frames import HEADER
    from sparkdl.ps.rules import Immediate, SyncRounds
    from sparkdl.ps.sharding import ShardSpans, assign_shards

    servers = n if pattern == "spread_ps" else options.get("servers", 1)
    rule = SyncRounds() if pattern == "sync_ps" else Immediate()
    sizes = [k // 4 // servers] * servers
    layout = ShardSpans([(size,) for size in sizes], assign_shards(sizes, servers))
    apart = pattern == "spread_ps"  # a server of one shard beside each worker, as server tasks run them
    running = (
        [server([shard], rule=rule, num_workers=n, first_shard=k) for k, shard in enumerate(make_shards(sizes))]
        if apart
        else [server(make_shards(sizes), rule=rule, num_workers=n)]
    )
    for one in running:
        one.start()
    try:
        clients = [client(running if apart else running[0], w, sizes) for w in range(n)]
        steps = PushSteps(0, 1, rows=np.array([8]) if rule.synchronous else None)
        exchanges = [PushPull(c, layout, None, steps) for c in clients]
        gradient = np.ones(layout.size, np.float32)
        with ThreadPoolExecutor(n) as pool:
            if rule.synchronous:
                list(pool.map(lambda c: c.join(8, n), clients))
            before = [c.traffic() for c in clients]
            list(pool.map(lambda e: e.push(gradient, np.float32(1.0)), exchanges))  # a round: every worker once
        per_shard = [
            [tuple(a - b for a, b in zip(now, then)) for now, then in zip(c.traffic(), was)]
            for c, was in zip(clients, before)
        ]
        totals = [c.traffic() for c in clients]
        for c in clients:
            c.close()
    finally:
        for one in running:
            one.stop()  # its connections' threads joined: every response counted
    for s, one in enumerate(running):  # the servers' own counters (headers included) agree with the clients'
        shards = [s] if apart else range(servers)
        requests = sum(totals[w][i][2] for w in range(n) for i in shards)
        stats = one.stats()
        assert stats["bytes_in"] == sum(totals[w][i][0] for w in range(n) for i in shards) + requests * HEADER.size
        assert stats["bytes_out"] == sum(totals[w][i][1] for w in range(n) for i in shards) + requests * HEADER.size
    return per_shard


@pytest.mark.parametrize(
    "pattern, n, options",
    [
        ("parameter_server", 3, {}),
        ("sharded_ps", 3, {"servers": 4}),
        ("sync_ps", 3, {}),
        ("spread_ps", 3, {}),
        ("spread_ps", 4, {}),
    ],
)
def test_the_parameter_servers_links_carry_what_the_model_says(pattern, n, options):
    """A round (every worker's one step) through real servers and clients: the bytes on the busiest host's link each
    way, the requests of a worker's step and the bytes all of them sent, as the model counts them. The driver's
    servers share one host: its link carries every worker's traffic; spread servers' host h carries its worker's
    traffic to the other hosts' shards and its shard's to the other hosts' workers."""
    k = 4 * 4 * 3 * 5 * 2**8  # shards of equal size for 1, 3 and 4 servers
    per_shard = _ps_step(pattern, n, k, options)
    formula = counts(pattern, n, k, **options)
    if pattern == "spread_ps":  # worker w and shard w share host w
        # sent by host h: its worker's pushes to the others' shards and its shard's answers to the others' workers
        out_of_host = [
            sum(per_shard[h][i][0] for i in range(n) if i != h) + sum(per_shard[w][h][1] for w in range(n) if w != h)
            for h in range(n)
        ]
        into_host = [
            sum(per_shard[h][i][1] for i in range(n) if i != h) + sum(per_shard[w][h][0] for w in range(n) if w != h)
            for h in range(n)
        ]
        assert max(out_of_host) == pytest.approx(formula.rank_sent)
        assert max(into_host) == pytest.approx(formula.rank_received)
        assert sum(out_of_host) == pytest.approx(formula.total_bytes)
    else:  # every shard on the server's one host
        into_server = sum(sent for worker in per_shard for sent, _, _ in worker)
        out_of_server = sum(received for worker in per_shard for _, received, _ in worker)
        assert (out_of_server, into_server) == (formula.rank_sent, formula.rank_received)
        assert into_server + out_of_server == formula.total_bytes
    assert {sum(requests for _, _, requests in worker) for worker in per_shard} == {formula.messages}


def test_a_term_can_be_pinned_to_a_measured_value():
    truth = cost.Params(alpha=250e-6, beta=1 / 117e6, delta=2e-9)
    fitted = cost.fit(synthetic(truth), fixed={"beta": truth.beta})
    assert fitted.beta == truth.beta
    assert fitted.vector() == pytest.approx(truth.vector(), rel=1e-6, abs=1e-15)
    with pytest.raises(ValueError, match="fixed"):
        cost.fit(synthetic(truth), fixed={"bandwidth": 1.0})
