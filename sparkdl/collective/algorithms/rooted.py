"""What the algorithms through a root share: an allreduce is a reduce to rank 0, then a broadcast from it.

The tree's and naive's allreduce, reduce and broadcast differ only in how a
reduce and a broadcast move the arrays; a :class:`Rooted` algorithm gives
those two over one transfer, and the three operations follow.
"""

from __future__ import annotations

import numpy as np

from sparkdl.collective.algorithms.base import COMBINE, Algorithm
from sparkdl.collective.api import ReduceOp
from sparkdl.collective.transport.transfer import Transfer


def allreduce_through_root(
    tx: Transfer, algorithm: Rooted, flat: np.ndarray, out: np.ndarray, combine, scratch
) -> None:
    algorithm.reduce_over(tx, flat, out, 0, combine, scratch)
    tx.flush()  # a partial sum still being sent must not be overwritten by the broadcast
    algorithm.broadcast_over(tx, out, 0)


class Rooted(Algorithm):
    """An algorithm whose allreduce goes through rank 0: a subclass gives :meth:`reduce_over` and
    :meth:`broadcast_over`."""

    def reduce_over(self, tx: Transfer, flat: np.ndarray, out: np.ndarray, root: int, combine, scratch) -> None:
        """``out`` on ``root`` gets every rank's ``flat`` combined; ``scratch`` holds at least ``flat``'s bytes."""
        raise NotImplementedError

    def broadcast_over(self, tx: Transfer, out: np.ndarray, root: int) -> None:
        raise NotImplementedError

    def allreduce(self, comm, flat: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        with comm.transfer("allreduce") as tx:
            allreduce_through_root(tx, self, flat, out, COMBINE[op], comm.scratch(flat.nbytes))

    def reduce(self, comm, flat: np.ndarray, out: np.ndarray, root: int, op: ReduceOp) -> None:
        with comm.transfer("reduce") as tx:
            self.reduce_over(tx, flat, out, root, COMBINE[op], comm.scratch(flat.nbytes))

    def broadcast(self, comm, out: np.ndarray, root: int) -> None:
        with comm.transfer("broadcast") as tx:
            self.broadcast_over(tx, out, root)
