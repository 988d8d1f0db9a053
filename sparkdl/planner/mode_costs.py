"""The training modes' communication counted per step, for the planner: sync, ZeRO, the parameter servers, gossip
and the pipeline.

Built on the collectives' counts (``sparkdl.collective.cost.collective``, each algorithm's own) where a mode's
step is made of collectives; the parameter servers', gossip's and the pipeline's from their own traffic. Each
function is ``(n, nbytes, **options) -> Cost`` (K: the model's gradient or weight bytes, or a cut's
activations for the pipeline); :data:`PATTERNS` names them for benchmarks and tests, and the planner's
modes (:mod:`.planned`) carry theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparkdl.collective.cost import Cost, collective
from sparkdl.collective.cost.model import total


def sync(n: int, k: float, local: int = 1) -> Cost:
    """``mode="sync"``: one allreduce of the gradients per step; the ring across hosts (hierarchical with
    ``local`` ranks per host). Buckets split K but not its bytes. Data parallelism (Sergeev and Del Balso 2018)."""
    if local > 1:
        return collective("allreduce", "hierarchical", n, k, local=local)
    return collective("allreduce", "ring", n, k)


def zero1(n: int, k: float) -> Cost:
    """``mode="sharded"`` (ZeRO stage 1, Rajbhandari et al., SC'20): the gradients reduce-scattered, each rank
    updating its K/N shard, the weights all-gathered: the ring allreduce's bytes and steps exactly, split in two
    (the ZeRO paper's point: stages 1 and 2 cost data parallelism's communication, 2(N-1)K/N a rank)."""
    scatter, gather = collective("reduce_scatter", "ring", n, k), collective("allgather", "ring", n, k)
    return total(scatter, gather)


def zero3(n: int, k: float, units: int = 1, reshard_after_forward: bool = True) -> Cost:
    """``mode="sharded", shard_weights=True`` (ZeRO stage 3) on a model cut into ``units`` units.

    Per step each unit's weights (K/U) are all-gathered before its forward and again before its
    backward, except the last unit, which keeps them; each unit's gradient is reduce-scattered:
    (2U-1) allgathers and U reduce-scatters of K/U, (3 - 1/U)(N-1)K/N bytes a rank (about 1.5x the
    allreduce's, Rajbhandari et al. 2020, section 7.2.3) in (3U-1)(N-1) steps: latency-bound for many
    small units. Without ``reshard_after_forward`` every unit keeps its weights to its backward pass:
    U allgathers, an allreduce's bytes.
    """
    if units < 1:
        raise ValueError(f"Expected `units` of at least 1. Received: units={units}")
    part = k / units
    gathers, scatters = collective("allgather", "ring", n, part), collective("reduce_scatter", "ring", n, part)
    gathered = 2 * units - 1 if reshard_after_forward else units
    return total(*([gathers] * gathered + [scatters] * units))


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
    _check_servers(servers, server_hosts)
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


def _check_servers(servers: int, server_hosts: int) -> None:
    if servers < 1 or server_hosts < 1 or server_hosts > servers:
        raise ValueError(
            f"Expected 1 <= server_hosts <= servers. Received: servers={servers}, server_hosts={server_hosts}"
        )


def sharded_ps(n: int, k: float, servers: int = 4, server_hosts: int = 1) -> Cost:
    """The parameter server with ``servers`` shards (``ps_shards``), by default all on the driver's one link."""
    return parameter_server(n, k, servers, server_hosts)


def sync_ps(n: int, k: float, servers: int = 1, server_hosts: int = 1) -> Cost:
    """``mode="sync_ps"`` (the lectures' centralized synchronous pattern): every worker pushes K, the servers apply
    the mean once, then every worker pulls K. The pulls wait for the last push, so the server host's link carries
    the round's N·K/H in, then N·K/H out, one after the other: twice :func:`parameter_server`'s bytes on the
    critical path. The sums of the N pushes: N·K/S of memory on each shard."""
    _check_servers(servers, server_hosts)
    link = n * k / server_hosts
    return Cost(2, 2 * link, n * k / servers, 2 * servers, link, link, 2 * n * k)


def spread_ps(n: int, k: float) -> Cost:
    """``server_placement="executors"`` with one shard per worker's host (``ps_shards`` = N): each host's link
    carries its worker's pushes and pulls to the N-1 other hosts' shards ((N-1)K/N each way) and its own shard's
    answers to the other N-1 workers ((N-1)K/N each way): 2(N-1)K/N in each direction, the ring allreduce's
    bytes, whatever N is, where the driver-hosted server's link carries N·K. A round is every worker's one step;
    each shard applies N pushes of K/N."""
    link = 2 * (n - 1) * k / n
    return Cost(2, link, k, 2 * n, link, link, n * link)


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
    one after another. ``link_bytes`` counts those; ``rank_sent`` what the busiest stage sends a step (M·K to one
    neighbour with two stages, M·K to each of two from a middle stage), which must stay under a stage's compute
    time for the transfers of the other micro-batches to hide."""
    if n < 2:
        return Cost(0, 0)
    m, neighbours = micro_batches, 1 if n == 2 else 2
    return Cost(
        2 * (n - 1), 2 * (n - 1) * k, 0.0, neighbours * m, neighbours * m * k, neighbours * m * k, 2 * (n - 1) * m * k
    )


#: Every mode's pattern by name: ``name -> function(n, nbytes, **options) -> Cost``.
PATTERNS: dict[str, Callable[..., Cost]] = {
    "sync": sync,
    "zero1": zero1,
    "zero3": zero3,
    "parameter_server": parameter_server,
    "sharded_ps": sharded_ps,
    "sync_ps": sync_ps,
    "spread_ps": spread_ps,
    "gossip": gossip,
    "pipeline": pipeline,
}


def cost(pattern: str, n: int, nbytes: float, **options: Any) -> Cost:
    """The counts of a step of ``pattern`` over ``n`` ranks on ``nbytes`` (see :data:`PATTERNS` for the options)."""
    if pattern not in PATTERNS:
        raise ValueError(f"Expected `pattern` to be one of {sorted(PATTERNS)}. Received: pattern={pattern!r}")
    if n < 1 or nbytes < 0:
        raise ValueError(f"Expected n >= 1 and nbytes >= 0. Received: n={n}, nbytes={nbytes}")
    return PATTERNS[pattern](n, float(nbytes), **options)
