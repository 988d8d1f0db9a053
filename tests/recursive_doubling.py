"""An allreduce algorithm that sparkdl does not build in, registered by tests as another package would register one:
recursive doubling (Thakur, Rabenseifner and Gropp 2005, section 4.4), with its cost for the cost model."""

from __future__ import annotations

import threading

import numpy as np

from sparkdl.collective import Algorithm, ReduceOp
from sparkdl.collective.algorithms.base import COMBINE
from sparkdl.collective.cost import Cost

NAME = "recursive_doubling"


def _rounds(n: int) -> int:
    return (n.bit_length() - 1) if n > 1 else 0


def recursive_doubling_cost(n: int, k: float) -> Cost:
    """Each of log2(N) rounds swaps the whole array with the rank that differs in one bit (N a power of two; the
    others fold their extra ranks in before and out after: two more steps)."""
    power = 1 << _rounds(n)
    rounds, folds = _rounds(n), 0 if power == n else 2
    sent = (rounds + (folds and 1)) * k  # a folded rank sends its array in; its partner sends the result back
    return Cost(
        steps=rounds + folds,
        link_bytes=(rounds + folds) * k,
        memory_bytes=(rounds + (folds and 1)) * k,
        messages=rounds + (folds and 1),
        rank_sent=sent,
        rank_received=sent,
        total_bytes=n * rounds * k if not folds else (power * rounds + 2 * (n - power)) * k,
    )


class RecursiveDoubling(Algorithm):
    """Allreduce by recursive doubling (Thakur et al. 2005, section 4.4): in round j every rank swaps its partial
    result with rank XOR 2^j and combines the two. Ranks beyond the largest power of two first hand their array
    to a partner below it and get the result back at the end."""

    name = NAME
    operations = frozenset({"allreduce"})
    costs = {"allreduce": recursive_doubling_cost}

    def __init__(self) -> None:
        self.calls = 0  # by every rank of this process (the ranks are threads)
        self._lock = threading.Lock()

    def allreduce(self, comm, flat: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        with self._lock:
            self.calls += 1
        combine, rank, size = COMBINE[op], comm.rank, comm.size
        power = 1 << _rounds(size)
        out[...] = flat
        received = comm.scratch(flat.nbytes)[: flat.nbytes].view(flat.dtype)
        with comm.transfer("allreduce") as tx:
            if rank >= power:  # folded in: hand over the array, then wait for the result
                tx.send(rank - power, out)
                tx.flush()
                tx.recv(rank - power, out)
                return
            if rank + power < size:
                combine(out, tx.recv(rank + power, received), out=out)
            mask = 1
            while mask < power:
                tx.send(rank ^ mask, out)
                tx.recv(rank ^ mask, received)
                tx.flush()  # ``out`` was being sent: combine into it only once it is gone
                combine(out, received, out=out)
                mask <<= 1
            if rank + power < size:
                tx.send(rank + power, out)


def recursive_doubling_edges(n: int) -> set[tuple[int, int]]:
    """The (sender, receiver) pairs of its frames on ``n`` ranks."""
    power = 1 << _rounds(n)
    edges = {(r, r ^ mask) for r in range(power) for mask in (1 << j for j in range(_rounds(n)))}
    folded = {(r, r - power) for r in range(power, n)} | {(r - power, r) for r in range(power, n)}
    return edges | folded
