"""Splitting a model's trainable variables into parameter-server shards, balanced by size.

Driver and workers compute the same assignment, so a worker can cut one fused
gradient into the per-shard pieces that each server shard expects.
"""

from __future__ import annotations

import numpy as np


def assign_shards(sizes: list[int], num_servers: int) -> list[list[int]]:
    """Variable indices per shard: the largest variables first, each onto the lightest shard so far."""
    loads = [0] * num_servers
    shards: list[list[int]] = [[] for _ in range(num_servers)]
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lightest = loads.index(min(loads))
        shards[lightest].append(index)
        loads[lightest] += sizes[index]
    return [sorted(shard) for shard in shards]


class ShardLayout:
    """Where each variable's values sit in a flat vector (model order) and in its shard's vector."""

    def __init__(self, shapes: list[tuple[int, ...]], shards: list[list[int]]):
        self.shapes = shapes
        self.shards = shards
        sizes = [int(np.prod(shape)) for shape in shapes]
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.shard_sizes = [sum(sizes[i] for i in shard) for shard in shards]

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """A model-ordered flat vector → one contiguous float32 vector per shard."""
        return [
            np.concatenate([flat[self._offsets[i] : self._offsets[i + 1]] for i in shard]).astype(
                np.float32, copy=False
            )
            for shard in self.shards
        ]

    def join(self, parts: list[np.ndarray]) -> np.ndarray:
        """Per-shard vectors → one model-ordered flat float32 vector."""
        flat = np.empty(self._offsets[-1], np.float32)
        for shard, part in zip(self.shards, parts):
            position = 0
            for i in shard:
                size = self._offsets[i + 1] - self._offsets[i]
                flat[self._offsets[i] : self._offsets[i + 1]] = part[position : position + size]
                position += size
        return flat
