"""The driver's copy of the model in parameter-server modes: one shard of variables per server.

Each shard applies pushed gradients with its own instance of the model's own
optimizer (Downpour-style), so a stale push is damped by the optimizer just
as a fresh one, and each shard's optimizer counts its own steps.
"""

from __future__ import annotations

import numpy as np

from sparkdl import _compat
from sparkdl.ps.sharding import ShardLayout, assign_shards


class OptimizerShard:
    """A :class:`sparkdl.ps.server.Shard` over some of the model's variables."""

    def __init__(self, variables: list, optimizer_class, optimizer_config: dict):
        import tensorflow as tf

        self._variables = variables
        self._shapes = [tuple(v.shape) for v in variables]
        self.size = int(sum(np.prod(shape) for shape in self._shapes))
        self._optimizer = optimizer_class.from_config(optimizer_config)
        self._optimizer.build(variables)
        self._apply = tf.function(lambda grads: self._optimizer.apply(grads, self._variables))

    def read(self) -> np.ndarray:
        return np.concatenate([np.ravel(v.numpy()) for v in self._variables]).astype(np.float32, copy=False)

    @property
    def optimizer_variables(self) -> list:
        return _compat.optimizer_variables(self._optimizer)

    def apply(self, gradient: np.ndarray) -> None:
        parts = np.split(gradient, np.cumsum([int(np.prod(s)) for s in self._shapes])[:-1])
        self._apply([part.reshape(shape) for part, shape in zip(parts, self._shapes)])


class ServerModel:
    """The model whose trainable variables the server shards hold."""

    def __init__(self, model, num_servers: int):
        variables = list(model.trainable_variables)
        shapes = [tuple(v.shape) for v in variables]
        self.model = model
        self.layout = ShardLayout(shapes, assign_shards([int(np.prod(s)) for s in shapes], num_servers))
        optimizer = model.optimizer
        self.shards = [
            OptimizerShard([variables[i] for i in shard], type(optimizer), optimizer.get_config())
            for shard in self.layout.shards
        ]

    def optimizer_arrays(self) -> dict[str, np.ndarray]:
        """Every shard's optimizer state (moments, step counts), for a checkpoint."""
        return {
            f"shard{i}/{j}": np.array(v.numpy(), copy=True)
            for i, shard in enumerate(self.shards)
            for j, v in enumerate(shard.optimizer_variables)
        }

    def restore_optimizers(self, arrays: dict[str, np.ndarray]) -> bool:
        """Sets the shards' optimizer state from ``optimizer_arrays`` of a server of the same layout.

        Returns False, changing nothing, when ``arrays`` do not fit (another number of shards, a
        checkpoint of sync or average mode, whose optimizer state is in the model itself).
        """
        variables = {
            f"shard{i}/{j}": v for i, shard in enumerate(self.shards) for j, v in enumerate(shard.optimizer_variables)
        }
        if set(arrays) != set(variables) or any(arrays[k].shape != tuple(v.shape) for k, v in variables.items()):
            return False
        for name, variable in variables.items():
            variable.assign(arrays[name])
        return True
