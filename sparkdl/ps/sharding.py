"""Splitting a model's trainable variables into parameter-server shards, balanced by size.

Driver and workers compute the same assignment, so a worker can fuse its gradients into one
vector whose spans are the per-shard pieces that each server shard expects.
"""

from __future__ import annotations

import numpy as np


def holds_whole_variables(num_servers: int, num_variables: int) -> bool:
    """Whether ``num_servers`` shards can each hold at least one of ``num_variables`` whole variables."""
    return num_servers <= num_variables


def assign_shards(sizes: list[int], num_servers: int) -> list[list[int]]:
    """Variable indices per shard: the largest variables first, each onto the lightest shard so far."""
    loads = [0] * num_servers
    shards: list[list[int]] = [[] for _ in range(num_servers)]
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lightest = loads.index(min(loads))
        shards[lightest].append(index)
        loads[lightest] += sizes[index]
    return [sorted(shard) for shard in shards]


class ShardSpans:
    """Where each variable's values sit in the flat vector a worker exchanges: the shards' vectors end to end.

    A shard's vector is its variables' values in model order. A worker fuses its gradients variable by
    variable in ``order`` (shard by shard), so each shard's part is one span of the flat vector
    (``bounds``), sent and received in place, without cutting or joining copies.
    """

    def __init__(self, shapes: list[tuple[int, ...]], shards: list[list[int]]):
        self.shapes = shapes
        self.shards = shards
        sizes = [int(np.prod(shape)) for shape in shapes]
        self.shard_sizes = [sum(sizes[i] for i in shard) for shard in shards]
        self.order = [i for shard in shards for i in shard]  # variable indices, shard by shard
        ends = [int(end) for end in np.cumsum(self.shard_sizes)]
        self.bounds = list(zip([0, *ends[:-1]], ends))  # each shard's span of the flat vector
        self.size = sum(sizes)
