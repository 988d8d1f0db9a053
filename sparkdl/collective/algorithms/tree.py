"""Binomial-tree algorithms: log2(N) rounds, for small arrays where a ring's N-1 latencies dominate.

Ranks are numbered relative to the root (v = (rank - root) mod N); in the
round of ``mask`` a rank below ``mask`` sends to v + mask (broadcast), or a
rank with that bit set sends its partial result to v - mask (reduce).
"""

from __future__ import annotations

import numpy as np

from sparkdl.collective.exchange import Exchange


def broadcast(ex: Exchange, out: np.ndarray, root: int) -> None:
    size, v = ex.size, (ex.rank - root) % ex.size
    mask = 1
    while mask < size:
        if v < mask:
            if v + mask < size:
                ex.send((v + mask + root) % size, out)
        elif v < 2 * mask:
            ex.recv((v - mask + root) % size, out)
        mask <<= 1


def reduce(ex: Exchange, flat: np.ndarray, out: np.ndarray, root: int, combine, scratch: np.ndarray) -> None:
    """``out`` on ``root`` gets the reduction; on the other ranks it holds a partial one, sent on."""
    size, v = ex.size, (ex.rank - root) % ex.size
    out[...] = flat
    received = scratch[: flat.nbytes].view(flat.dtype)
    mask = 1
    while mask < size:
        if v & mask:
            ex.send((v - mask + root) % size, out)
            return
        if v + mask < size:
            combine(out, ex.recv((v + mask + root) % size, received), out=out)
        mask <<= 1


def allreduce(ex: Exchange, flat: np.ndarray, out: np.ndarray, combine, scratch: np.ndarray) -> None:
    reduce(ex, flat, out, 0, combine, scratch)
    ex.flush()  # a partial sum still being sent must not be overwritten by the broadcast
    broadcast(ex, out, 0)
