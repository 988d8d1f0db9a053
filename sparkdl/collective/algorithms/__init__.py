"""Which algorithms each operation has, and which one runs when the caller does not say.

``ring``: bandwidth-optimal, every rank moves 2(N-1)K/N (large arrays);
``tree``: binomial, log2(N) rounds (small arrays); ``naive``: through one
root or directly between ranks (the lectures' baseline, and the natural way
for gather, scatter and alltoall); ``hierarchical``: shared memory within a
host, a ring across hosts (allreduce, chosen whenever ranks share a host);
``shared_memory``: through the host's segment alone (reduce_scatter and allgather,
chosen when one host holds every rank).
"""

from __future__ import annotations

#: The algorithms of each operation; the first is its default where nothing else applies.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("ring", "tree", "naive", "hierarchical"),
    "broadcast": ("ring", "tree", "naive"),
    "reduce": ("tree", "naive"),
    "allgather": ("ring", "naive", "shared_memory"),
    "reduce_scatter": ("ring", "shared_memory"),
    "gather": ("naive",),
    "scatter": ("naive",),
    "allgather_v": ("naive",),
    "alltoall": ("naive",),
    "barrier": ("tree",),
    "send": ("naive",),
    "recv": ("naive",),
}
ALGORITHM_NAMES = frozenset(name for names in ALGORITHMS.values() for name in names)

#: Below this many bytes a tree's log2(N) rounds beat a ring's 2(N-1) steps.
SMALL_BYTES = 64 << 10


def choose(
    operation: str, requested: str | None, default: str | None, nbytes: int, shared_memory: bool, one_host: bool = False
) -> str:
    """The algorithm ``operation`` runs: the one requested for the call, else the communicator's, else by size.

    ``shared_memory``: the ranks share hosts in equal numbers, with a segment each; ``one_host``: one
    segment holds every rank.
    """
    available = ALGORITHMS[operation]
    if requested is not None:
        if requested not in available:
            raise ValueError(
                f"Expected `algorithm` to be one of {list(available)} for {operation}. Received: algorithm={requested!r}"
            )
        if requested == "hierarchical" and not shared_memory:
            raise ValueError(
                "algorithm='hierarchical' needs ranks that share hosts in equal numbers (shared memory on); "
                "this communicator has none"
            )
        if requested == "shared_memory" and not one_host:
            raise ValueError(
                f"algorithm='shared_memory' needs every rank on one host with shared memory on; {operation} "
                "runs on ranks of several hosts or without it here"
            )
        return requested
    usable = {"hierarchical": shared_memory, "shared_memory": one_host}
    if default is not None and default in available and usable.get(default, True):
        return default
    if operation == "allreduce" and shared_memory:
        return "hierarchical"
    if "shared_memory" in available and one_host:
        return "shared_memory"
    if operation in ("allreduce", "broadcast") and nbytes < SMALL_BYTES:
        return "tree"
    return available[0]
