"""Who averages with whom in each gossip round: a pure function of the ranks, the seed and the round number.

Every rank computes the same schedule with no message: ``ring`` gives each rank its two ring
neighbours in every round (weight 1/3 each, 1/3 for itself; with two ranks the neighbours are one
rank, weight 1/2); ``random`` pairs the ranks anew each round by a seeded permutation (consecutive
ranks of the permutation average their weights, 1/2 each; with an odd number of ranks the last
one of the permutation sits the round out). Either way the round's mixing matrix is symmetric and
doubly stochastic, so a round keeps the replicas' mean where it was.

The permutation is the ranks sorted by a BLAKE2b hash of ``(seed, round, rank)``: the same bytes in
every Python and numpy version, unlike a random generator's stream.

Each edge also gets a *colour* such that no rank has two edges of one colour: the messages of one
colour and direction travel on a stream of their own (``exchange.Streams``), so a rank's sends and
receives never queue behind one another.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

RING, RANDOM = "ring", "random"
PEERS = (RING, RANDOM)


@dataclasses.dataclass(frozen=True)
class Neighbour:
    """A rank this rank averages with in a round: its weight in the average, and its edge's colour."""

    rank: int
    weight: float
    colour: int


def neighbours(peers: str, rank: int, size: int, *, seed: int, round: int) -> tuple[Neighbour, ...]:
    """Rank ``rank``'s neighbours in round ``round`` (its own weight is one minus theirs)."""
    if peers == RING:
        return ring(rank, size)
    if peers == RANDOM:
        partner = matching(size, seed=seed, round=round)[rank]
        return () if partner is None else (Neighbour(partner, 0.5, 0),)
    raise ValueError(f"Expected `peers` to be one of {list(PEERS)}. Received: peers={peers!r}")


def ring(rank: int, size: int) -> tuple[Neighbour, ...]:
    """The ring neighbours of ``rank`` (the same every round)."""
    if size == 1:
        return ()
    if size == 2:
        return (Neighbour(1 - rank, 0.5, 0),)
    left, right = (rank - 1) % size, (rank + 1) % size
    return (Neighbour(left, 1 / 3, _ring_colour(left, size)), Neighbour(right, 1 / 3, _ring_colour(rank, size)))


def _ring_colour(first: int, size: int) -> int:
    """The colour of the ring edge from ``first`` to ``first + 1``: alternating 0, 1 around the ring, and 2 for the
    edge that closes a ring of odd length (whose two ends have edges of colours 0 and 1 already)."""
    if size % 2 and first == size - 1:
        return 2
    return first % 2


def colours(peers: str, size: int) -> int:
    """How many edge colours the schedule uses (each colour: two streams, one per direction)."""
    if size == 1:
        return 0
    if peers == RING and size > 2:
        return 3 if size % 2 else 2
    return 1


def permutation(size: int, *, seed: int, round: int) -> list[int]:
    """The ranks in round ``round``'s seeded order: the same list on every rank, in every Python."""

    def key(rank: int) -> bytes:
        return hashlib.blake2b(f"sparkdl gossip {seed} {round} {rank}".encode(), digest_size=16).digest()

    return sorted(range(size), key=key)


def matching(size: int, *, seed: int, round: int) -> list[int | None]:
    """Each rank's partner in round ``round`` (None: the rank left over when ``size`` is odd)."""
    order = permutation(size, seed=seed, round=round)
    partner: list[int | None] = [None] * size
    for a, b in zip(order[0::2], order[1::2]):
        partner[a], partner[b] = b, a
    return partner


def mixing_matrix(peers: str, size: int, *, seed: int, round: int) -> np.ndarray:
    """Round ``round``'s mixing matrix W: after the round, rank i holds ``sum_j W[i, j] * x_j`` (plus its own step)."""
    matrix = np.zeros((size, size))
    for rank in range(size):
        for neighbour in neighbours(peers, rank, size, seed=seed, round=round):
            matrix[rank, neighbour.rank] += neighbour.weight
        matrix[rank, rank] = 1.0 - matrix[rank].sum()
    return matrix
