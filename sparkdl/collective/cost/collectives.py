"""The communicator's algorithms counted: ring, naive, binomial tree and hierarchical collectives over N ranks."""

from __future__ import annotations

import math

from sparkdl.collective.cost.model import Cost

#: The ring's pipelining granularity (``sparkdl.collective.algorithms.ring.SEGMENT_BYTES``), for message counts.
SEGMENT_BYTES = 2 << 20


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
        messages=2 * (hosts - 1) * _segments(k / local / hosts),
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
