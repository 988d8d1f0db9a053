"""What a communication pattern costs: the latency-bandwidth model, per pattern, and its fit on measured runs.

Every pattern is reduced to four counts (:class:`Cost`) for N ranks and K bytes (the array, or the
model's gradients or weights), and its time to the linear model of Hockney and of Thakur, Rabenseifner
and Gropp ("Optimization of Collective Communication Operations in MPICH", IJHPCA 19(1), 2005)::

    T = alpha * steps + beta * link_bytes + gamma * memory_bytes + delta * total_bytes

- ``steps``: the messages on the critical path, one after another (each pays the latency and the
  per-message software cost, ``alpha``);
- ``link_bytes``: the bytes the busiest link carries one after another on the critical path, in one
  direction (links are full duplex: a ring rank's sends and receives overlap; the naive root's gather
  and broadcast do not, as one follows the other); each pays ``beta``, one over the link's bandwidth;
- ``memory_bytes``: the bytes the busiest rank reduces or copies in memory (``gamma``: Thakur's
  per-byte computation cost, here also the copies of a broadcast's result or a shared-memory segment);
- ``total_bytes``: the bytes every rank sends, added up: the traffic the whole network carries. It costs
  nothing where each host has its own links and CPUs (``delta`` = 0, the default); it is what a shared
  resource charges: an oversubscribed fabric's core, or, when every "host" is a namespace of one
  machine (``benchmarks/network_patterns.py``), that machine's CPUs, which move every packet.

``rank_sent`` and ``rank_received`` are the bytes the busiest rank (the root, for a star) sends and
receives per call: what the interface counters of a measured run show. ``messages`` is what the busiest
rank sends per call (a ring sends its chunks in segments: :data:`SEGMENT_BYTES`).

:data:`PATTERNS` holds every pattern's counts, the communicator's algorithms (``ring_allreduce``,
``naive_allreduce``, ...) and the training patterns built on them (``sync``, ``zero1``, ``zero3``,
``parameter_server``, ``sharded_ps``, ``gossip``, ``pipeline``), each documented with its source.
:func:`fit` finds ``alpha``, ``beta``, ``gamma`` and ``delta`` from measured times by least squares on
the relative error (every size counts alike, 100 KB as much as 256 MB), none negative, any of them
pinned to a measured value; :func:`predict` is the model's time. Pure Python and numpy, no TensorFlow:
``benchmarks/network_patterns.py`` fits it on emulated networks, docs/patterns.md uses it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

#: The ring's pipelining granularity (``sparkdl.collective.algorithms.ring.SEGMENT_BYTES``), for message counts.
SEGMENT_BYTES = 2 << 20

#: The names of the model's parameters, in the order of :meth:`Params.vector`.
TERMS = ("alpha", "beta", "gamma", "delta")


@dataclasses.dataclass(frozen=True)
class Cost:
    """One call's (or one training step's) counts: see the module's docstring."""

    steps: float
    link_bytes: float
    memory_bytes: float = 0.0
    messages: float = 0.0
    rank_sent: float = 0.0
    rank_received: float = 0.0
    total_bytes: float = 0.0

    def vector(self) -> np.ndarray:
        """``(steps, link_bytes, memory_bytes, total_bytes)``: what ``alpha``, ``beta``, ``gamma``, ``delta`` multiply."""
        return np.array([self.steps, self.link_bytes, self.memory_bytes, self.total_bytes], dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class Params:
    """The model's constants: seconds per serial step, per byte on a link, per byte reduced or copied."""

    alpha: float
    beta: float
    gamma: float = 0.0
    delta: float = 0.0

    def vector(self) -> np.ndarray:
        return np.array([self.alpha, self.beta, self.gamma, self.delta], dtype=np.float64)

    def without(self, *terms: str) -> Params:
        """These parameters with ``terms`` set to 0 (``without("delta")``: hosts that share nothing)."""
        return dataclasses.replace(self, **{term: 0.0 for term in terms})

    @property
    def bandwidth(self) -> float:
        """Bytes per second of one link (``1 / beta``); infinite when ``beta`` is 0."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def __str__(self) -> str:
        return (
            f"alpha {self.alpha * 1e6:.1f} us, beta {self.beta * 1e9:.3f} ns/B ({self.bandwidth / 1e6:.0f} MB/s), "
            f"gamma {self.gamma * 1e9:.3f} ns/B, delta {self.delta * 1e9:.3f} ns/B"
        )


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured time: ``pattern`` over ``n`` ranks on ``nbytes``, with the pattern's options."""

    pattern: str
    n: int
    nbytes: float
    seconds: float
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def cost(self) -> Cost:
        return cost(self.pattern, self.n, self.nbytes, **self.options)


def _log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def _segments(nbytes: float) -> float:
    return max(1.0, math.ceil(nbytes / SEGMENT_BYTES))


def _binomial_children(n: int) -> dict[int, list[int]]:
    """The binomial tree over ranks 0..n-1 rooted at 0 (``algorithms/tree.py``): v's children are v + 2^j for the
    rounds 2^j after the one v received in, in the order v serves them."""
    children: dict[int, list[int]] = {v: [] for v in range(n)}
    mask = 1
    while mask < n:
        for v in range(mask):
            if v + mask < n:
                children[v].append(v + mask)
        mask <<= 1
    return children


def binomial_paths(n: int) -> tuple[float, float]:
    """(reduce, broadcast): the arrays of K bytes one after another on the critical path of sparkdl's binomial tree.

    sparkdl queues a rank's sends at once (each link has its own sender), so a broadcasting rank's children
    share its uplink and all finish c·K after it got the array (c children); a reducing rank takes its
    children's arrays one at a time on its downlink as they come. The textbook's tree, whose sends
    go one after another, largest subtree first, needs ceil(log2 N) arrays either way; here the
    broadcast needs 2, 3, 6, 10 arrays at N = 3, 4, 8, 16.
    """
    children = _binomial_children(n)
    ready: dict[int, float] = {}

    def reduced(v: int) -> float:
        if v not in ready:
            t = 0.0
            for child in sorted(children[v], key=reduced):
                t = max(t, reduced(child)) + 1
            ready[v] = t
        return ready[v]

    def broadcast_ends(v: int, t: float) -> float:
        done = t + len(children[v])
        return max([t, *(broadcast_ends(child, done) for child in children[v])])

    return reduced(0), broadcast_ends(0, 0.0)


# -- the communicator's algorithms ----------------------------------------------------------------------


def ring_allreduce(n: int, k: float) -> Cost:
    """Ring allreduce: a reduce-scatter then an allgather, N-1 steps each, every rank sending K/N per step.

    Every rank sends and receives 2(N-1)K/N bytes, whatever N is: the bandwidth-optimal allreduce
    (Patarasuk and Yuan, J. Parallel Distrib. Comput. 69(2), 2009; Thakur et al. 2005, section 4.5):
    T = 2(N-1) alpha + 2(N-1)/N K beta + (N-1)/N K gamma; the network carries 2(N-1)K in all.
    """
    if n < 2:
        return Cost(0, 0)
    per_rank = 2 * (n - 1) * k / n
    return Cost(
        steps=2 * (n - 1),
        link_bytes=per_rank,
        memory_bytes=(n - 1) * k / n,
        messages=2 * (n - 1) * _segments(k / n),
        rank_sent=per_rank,
        rank_received=per_rank,
        total_bytes=n * per_rank,
    )


def naive_allreduce(n: int, k: float) -> Cost:
    """Naive allreduce: every rank's array to one root, reduced there, the result sent back to each.

    The lectures' baseline (Thakur et al. 2005, the "reduce followed by broadcast" with a linear
    reduce and broadcast): the root receives (N-1)K and then sends (N-1)K, one after the other, so its
    link carries 2(N-1)K on the critical path while each other rank moves 2K:
    T = 2 alpha + 2(N-1) K beta + (N-1) K gamma. The root's traffic grows with N; a ring rank's does not.
    """
    if n < 2:
        return Cost(0, 0)
    return Cost(
        steps=2,
        link_bytes=2 * (n - 1) * k,
        memory_bytes=(n - 1) * k,
        messages=n - 1,
        rank_sent=(n - 1) * k,
        rank_received=(n - 1) * k,
        total_bytes=2 * (n - 1) * k,
    )


def tree_allreduce(n: int, k: float) -> Cost:
    """Binomial-tree allreduce: a binomial reduce to rank 0 then a binomial broadcast, ceil(log2 N) rounds each.

    Thakur et al. 2005, sections 4.1 and 4.2: 2 ceil(log2 N) steps, the root receiving and then sending K
    in each round, ceil(log2 N) K reduced on the root. On the critical path, sparkdl's tree carries the
    arrays of :func:`binomial_paths` (its broadcast's sends share a rank's uplink): 2 K at N=2, 4 K at
    N=3, 5 K at N=4, 9 K at N=8, against the textbook's 2 ceil(log2 N) K. Few steps: the small-array choice.
    """
    rounds = _log2(n)
    reduce_path, broadcast_path = binomial_paths(n)
    return Cost(
        steps=2 * rounds,
        link_bytes=(reduce_path + broadcast_path) * k,
        memory_bytes=rounds * k,
        messages=rounds,
        rank_sent=rounds * k,
        rank_received=rounds * k,
        total_bytes=2 * (n - 1) * k,
    )


def hierarchical_allreduce(n: int, k: float, local: int = 1) -> Cost:
    """Hierarchical allreduce (Horovod's): shared memory within each of H = N/L hosts, a ring across hosts.

    The L ranks of a host reduce K through their segment; local rank l then ring-allreduces slice l
    (K/L) with local rank l of the other hosts, so the host's link carries L rings of K/L, 2(H-1)/H K in
    all, in 2(H-1) steps; each rank then copies the finished slices out of the segment. With L = 1 it is
    the ring. T = (2(H-1) + 2) alpha + 2(H-1)/H K beta + (K + (H-1)/H K/L) gamma (Sergeev and Del
    Balso, "Horovod", 2018; the two shared-memory phases counted as steps, their copies as memory bytes).
    """
    if local < 1 or n % local:
        raise ValueError(f"Expected `local` to divide n={n}. Received: local={local}")
    hosts = n // local
    if local == 1:
        return ring_allreduce(n, k)
    cross = 2 * (hosts - 1) * k / hosts
    return Cost(
        steps=2 * (hosts - 1) + 2,
        link_bytes=cross,
        memory_bytes=k + (hosts - 1) * k / hosts / local,
        messages=2 * (hosts - 1) * _segments(k / local / hosts) * local,
        rank_sent=cross / local,
        rank_received=cross / local,
        total_bytes=hosts * cross,
    )


def ring_reduce_scatter(n: int, k: float) -> Cost:
    """Ring reduce-scatter of K bytes: N-1 steps of K/N; each rank ends with its K/N of the sum.

    The first half of the ring allreduce (Thakur et al. 2005, section 4.5):
    T = (N-1) alpha + (N-1)/N K beta + (N-1)/N K gamma. ZeRO's gradient step. sparkdl's reduce_scatter
    also copies its whole input into a fresh array first (the allreduce writes into ``out``): K more
    bytes of memory, new pages included, which on a fast link cost as much as the transfer.
    """
    if n < 2:
        return Cost(0, 0)
    per_rank = (n - 1) * k / n
    return Cost(n - 1, per_rank, per_rank + k, (n - 1) * _segments(k / n), per_rank, per_rank, n * per_rank)


def ring_allgather(n: int, k: float) -> Cost:
    """Ring allgather of K bytes in all (K/N from each rank): N-1 steps, each rank passing K/N on per step.

    Thakur et al. 2005, section 4.3 (ring allgather): T = (N-1) alpha + (N-1)/N K beta. ZeRO's weight step.
    """
    if n < 2:
        return Cost(0, 0)
    per_rank = (n - 1) * k / n
    return Cost(n - 1, per_rank, 0.0, (n - 1) * _segments(k / n), per_rank, per_rank, n * per_rank)


def naive_allgather(n: int, k: float) -> Cost:
    """Direct allgather of K bytes in all: each rank sends its K/N to every other rank itself.

    The same bytes as the ring, sent as N-1 messages by each rank (Thakur et al. 2005: a direct
    algorithm pays (N-1) alpha): T = (N-1) alpha + (N-1)/N K beta.
    """
    if n < 2:
        return Cost(0, 0)
    per_rank = (n - 1) * k / n
    return Cost(n - 1, per_rank, 0.0, n - 1, per_rank, per_rank, n * per_rank)


def ring_broadcast(n: int, k: float) -> Cost:
    """Pipelined ring broadcast: K in segments of :data:`SEGMENT_BYTES` from the root around the ring.

    Each rank receives K and passes it on; the pipeline fills in N-2 segment times
    (Thakur et al. 2005, section 4.1, the pipelined variant): T = (N-1) alpha + (K + (N-2) s) beta
    + K gamma with s = min(K, segment) (the result is a copy of the root's array: K of memory).
    """
    if n < 2:
        return Cost(0, 0)
    segment = min(k, SEGMENT_BYTES)
    return Cost(n - 1, k + (n - 2) * segment, k, _segments(k), k, k, (n - 1) * k)


def tree_broadcast(n: int, k: float) -> Cost:
    """Binomial broadcast: ceil(log2 N) rounds (Thakur et al. 2005, section 4.1), the root sending K to each of
    its ceil(log2 N) children; on the critical path the arrays of :func:`binomial_paths` (a rank's children
    share its uplink), plus K of memory for the result's copy."""
    rounds = _log2(n)
    return Cost(rounds, binomial_paths(n)[1] * k, k, rounds, rounds * k, k, (n - 1) * k)


def naive_broadcast(n: int, k: float) -> Cost:
    """Linear broadcast: the root sends K to each of the N-1 others: T = (N-1)(alpha + K beta) + K gamma."""
    if n < 2:
        return Cost(0, 0)
    return Cost(n - 1, (n - 1) * k, k, n - 1, (n - 1) * k, k, (n - 1) * k)


# -- sparkdl's training patterns, per step (K: the model's gradient or weight bytes) -----------------------


def sync(n: int, k: float, local: int = 1) -> Cost:
    """``mode="sync"``: one allreduce of the gradients per step; the ring across hosts (hierarchical with
    ``local`` ranks per host). Buckets split K but not its bytes. Data parallelism (Sergeev and Del Balso 2018)."""
    return hierarchical_allreduce(n, k, local) if local > 1 else ring_allreduce(n, k)


def zero1(n: int, k: float) -> Cost:
    """``mode="sharded"`` (ZeRO stage 1, Rajbhandari et al., SC'20): the gradients reduce-scattered, each rank
    updating its K/N shard, the weights all-gathered: the ring allreduce's bytes and steps exactly, split in two
    (the ZeRO paper's point: stages 1 and 2 cost data parallelism's communication, 2(N-1)K/N a rank)."""
    scatter, gather = ring_reduce_scatter(n, k), ring_allgather(n, k)
    return _sum(scatter, gather)


def zero3(n: int, k: float, units: int = 1) -> Cost:
    """``mode="sharded", shard_weights=True`` (ZeRO stage 3) on a model cut into ``units`` units.

    Per step each unit's weights (K/U) are all-gathered before its forward and again before its
    backward, except the last unit, which keeps them; each unit's gradient is reduce-scattered:
    (2U-1) allgathers and U reduce-scatters of K/U, (3 - 1/U)(N-1)K/N bytes a rank (about 1.5x the
    allreduce's, Rajbhandari et al. 2020, section 7.2.3) in (3U-1)(N-1) steps: latency-bound for many
    small units.
    """
    if units < 1:
        raise ValueError(f"Expected `units` of at least 1. Received: units={units}")
    part = k / units
    gathers, scatters = ring_allgather(n, part), ring_reduce_scatter(n, part)
    return _sum(*([gathers] * (2 * units - 1) + [scatters] * units))


def parameter_server(n: int, k: float, servers: int = 1, server_hosts: int = 1) -> Cost:
    """``mode="async"`` and its variants: each of N workers pushes K of gradients and pulls K of weights a step.

    The servers (``servers`` shards of K/S, sparkdl's on the driver: ``server_hosts=1``) receive N·K and
    send N·K per step of every worker; the server host's link carries both, pushes of some workers
    overlapping pulls of others (full duplex, asynchronous workers): N·K/H per direction per round of N
    steps, H = ``server_hosts`` (Li et al., "Scaling distributed machine learning with the parameter
    server", OSDI'14). Each push and pull is one message per shard (2S a step), the update N·K/S on each
    shard. Sharding on one host splits the server's CPU work, not its link. (A lock-step round, every push
    before any pull, would put 2N·K on the link.)
    """
    if servers < 1 or server_hosts < 1 or server_hosts > servers:
        raise ValueError(
            f"Expected 1 <= server_hosts <= servers. Received: servers={servers}, server_hosts={server_hosts}"
        )
    link = n * k / server_hosts
    return Cost(
        steps=2,
        link_bytes=link,
        memory_bytes=n * k / servers,
        messages=2 * servers,
        rank_sent=link,
        rank_received=link,
        total_bytes=2 * n * k,
    )


def sharded_ps(n: int, k: float, servers: int = 4, server_hosts: int = 1) -> Cost:
    """The parameter server with ``servers`` shards (``ps_shards``), by default all on the driver's one link."""
    return parameter_server(n, k, servers, server_hosts)


def gossip(n: int, k: float) -> Cost:
    """``mode="gossip"`` with ring peers (D-PSGD, Lian et al., NeurIPS'17): each rank sends its K of weights to
    its two ring neighbours and receives theirs, concurrently, every round: 2K on each rank's link
    (K with two ranks), one step, whatever N is; averaging reads both (2K of memory)."""
    if n < 2:
        return Cost(0, 0)
    peers = 1 if n == 2 else 2
    return Cost(1, peers * k, peers * k, peers, peers * k, peers * k, n * peers * k)


def pipeline(n: int, k: float, micro_batches: int = 1) -> Cost:
    """``mode="pipeline"`` on N stages, K the bytes of one micro-batch's activations at a cut (GPipe, Huang et al.,
    NeurIPS'19). Each boundary carries M·K forward and M·K of gradients back per step (opposite directions of a
    full-duplex link); what the step cannot hide behind compute is the fill and the drain: 2(N-1) transfers of K,
    one after another. ``link_bytes`` counts those; ``rank_sent`` the M·K a stage's link carries, which must
    stay under a stage's compute time for the transfers of the other micro-batches to hide."""
    if n < 2:
        return Cost(0, 0)
    m = micro_batches
    return Cost(2 * (n - 1), 2 * (n - 1) * k, 0.0, 2 * m, m * k, m * k, 2 * (n - 1) * m * k)


def _sum(*costs: Cost) -> Cost:
    return Cost(*(sum(getattr(c, f.name) for c in costs) for f in dataclasses.fields(Cost)))


#: Every pattern: ``name -> function(n, nbytes, **options) -> Cost``.
PATTERNS: dict[str, Callable[..., Cost]] = {
    "ring_allreduce": ring_allreduce,
    "naive_allreduce": naive_allreduce,
    "tree_allreduce": tree_allreduce,
    "hierarchical_allreduce": hierarchical_allreduce,
    "ring_reduce_scatter": ring_reduce_scatter,
    "ring_allgather": ring_allgather,
    "naive_allgather": naive_allgather,
    "ring_broadcast": ring_broadcast,
    "tree_broadcast": tree_broadcast,
    "naive_broadcast": naive_broadcast,
    "sync": sync,
    "zero1": zero1,
    "zero3": zero3,
    "parameter_server": parameter_server,
    "sharded_ps": sharded_ps,
    "gossip": gossip,
    "pipeline": pipeline,
}


def cost(pattern: str, n: int, nbytes: float, **options: Any) -> Cost:
    """The counts of ``pattern`` over ``n`` ranks on ``nbytes`` (see :data:`PATTERNS` for the options)."""
    if pattern not in PATTERNS:
        raise ValueError(f"Expected `pattern` to be one of {sorted(PATTERNS)}. Received: pattern={pattern!r}")
    if n < 1 or nbytes < 0:
        raise ValueError(f"Expected n >= 1 and nbytes >= 0. Received: n={n}, nbytes={nbytes}")
    return PATTERNS[pattern](n, float(nbytes), **options)


def predict(pattern: str, n: int, nbytes: float, params: Params, **options: Any) -> float:
    """Seconds ``pattern`` takes over ``n`` ranks on ``nbytes`` by the model: alpha·steps + beta·bytes + gamma·memory."""
    return float(cost(pattern, n, nbytes, **options).vector() @ params.vector())


def fit(
    measurements: Iterable[Measurement], terms: Sequence[str] = TERMS, fixed: Mapping[str, float] | None = None
) -> Params:
    """The ``alpha``, ``beta``, ``gamma`` and ``delta`` that fit ``measurements`` best, none negative.

    Least squares on the relative error, sum(((predicted - measured) / measured)^2), so that a 100 KB
    call weighs as much as a 256 MB one; non-negative by trying every subset of the free terms (four at
    most: the exact non-negative least squares of so small a problem). ``fixed`` pins terms to known
    values (``{"beta": 1 / measured_bandwidth}``); the other terms not in ``terms`` are 0. Where two
    counts are proportional over the measurements (a ring's link and memory bytes), the fit cannot tell
    them apart and puts the time on one of them.
    """
    rows = list(measurements)
    fixed = dict(fixed or {})
    unknown = (set(terms) | set(fixed)) - set(TERMS)
    if unknown or not (terms or fixed):
        raise ValueError(f"Expected `terms` and `fixed` among {TERMS}. Received: {list(terms)}, {sorted(fixed)}")
    if not rows:
        raise ValueError("Expected at least one measurement to fit")
    if any(m.seconds <= 0 for m in rows):
        raise ValueError("Expected every measurement's seconds to be positive")
    design = np.array([m.cost().vector() for m in rows])
    weights = 1.0 / np.array([m.seconds for m in rows])
    known = np.zeros(len(TERMS))
    for term, value in fixed.items():
        known[TERMS.index(term)] = value
    a, b = design * weights[:, None], 1.0 - (design @ known) * weights
    columns = [TERMS.index(t) for t in terms if t not in fixed]
    best = (float(np.sum(b**2)), known.copy())  # the free terms all 0
    for size in range(1, len(columns) + 1):
        for subset in itertools.combinations(columns, size):
            chosen = list(subset)
            if not np.any(a[:, chosen]):
                continue
            solution, *_ = np.linalg.lstsq(a[:, chosen], b, rcond=None)
            if np.any(solution < 0):
                continue
            full = known.copy()
            full[chosen] = solution
            residual = float(np.sum((a @ (full - known) - b) ** 2))
            if residual < best[0] - 1e-15:
                best = (residual, full)
    if not np.any(best[1]):
        raise ValueError("No non-negative fit: every count of the measurements is zero")
    return Params(*(float(v) for v in best[1]))


def relative_error(measurement: Measurement, params: Params) -> float:
    """(predicted - measured) / measured for one measurement."""
    predicted = predict(measurement.pattern, measurement.n, measurement.nbytes, params, **measurement.options)
    return (predicted - measurement.seconds) / measurement.seconds


def efficiency(step_seconds: float, compute_seconds: float) -> float:
    """Weak-scaling efficiency of a step that computes for ``compute_seconds`` and then communicates for
    ``step_seconds`` without overlap: compute / (compute + communication); 1 with nothing to communicate."""
    total = compute_seconds + step_seconds
    return 1.0 if total == 0 else compute_seconds / total
