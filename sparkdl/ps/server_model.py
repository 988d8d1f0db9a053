"""The driver's copy of the model in parameter-server modes: one shard of variables per server.

Each shard applies pushed gradients with its own instance of the model's own
optimizer (Downpour-style), so a stale push is damped by the optimizer just
as a fresh one, and each shard's optimizer counts its own steps.

A push is one call of one TensorFlow function, whatever the number of variables: the
connection's receive buffer is read in place (``sparkdl.ps.wire``: aligned, handed over by
DLPack as unsigned integers, since DLPack has no bfloat16), reinterpreted as the push's dtype,
widened to float32 and cut into the variables' shapes inside the function. With ``compiled``
(async and ssp, whose shard lock serialises the updates anyway) the function is compiled by XLA,
which fuses the optimizer's element-wise update into one pass over the weights: for Adam on an
8.4M-parameter shard 23 ms instead of 48 ms on one core of this machine, and the tensor
conversions it replaced cost as much again (docs/performance.md). Hogwild's shards run
it unfused: an XLA launch holds the locks of all the variables it updates for the whole update,
which would serialise hogwild's concurrent updates. An optimizer XLA cannot compile falls back
to the unfused function at its first push. A pull copies nothing: it sends read-only views of
the variables' current buffers, a snapshot TensorFlow keeps intact (it copies a variable on
write while a view of it lives).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence

import numpy as np

from sparkdl import _compat
from sparkdl.keras import adopted
from sparkdl.ps.sharding import ShardSpans, assign_shards

logger = logging.getLogger(__name__)

# The unsigned integers DLPack carries a push's bits as, by its itemsize.
_BITS = {2: np.uint16, 4: np.uint32}


class OptimizerShard:
    """A :class:`sparkdl.ps.shard_server.Shard` over some of the model's variables."""

    def __init__(self, variables: list, optimizer_class, optimizer_config: dict, *, compiled: bool):
        import keras
        import tensorflow as tf

        self._variables = variables
        self._shapes = [tuple(v.shape) for v in variables]
        self._sizes = [int(np.prod(shape)) for shape in self._shapes]
        self._offsets = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)
        self.size = int(self._offsets[-1])
        self._optimizer = optimizer_class.from_config(optimizer_config)
        self._optimizer.build(variables)
        # Functions of this shard's own (of a shared method, TensorFlow would count each shard's trace as a retrace).
        self._unfused = tf.function(lambda bits, dtype: self._update(bits, dtype, copy=True))
        self._compiled = (
            tf.function(lambda bits, dtype: self._update(bits, dtype, copy=False), jit_compile=True)
            if compiled
            else None
        )
        self._compiled_once = False
        # Concurrent pushes (hogwild's) interleave their updates op by op. SGD's interleave safely (HOGWILD!'s
        # analysis); an optimizer that divides by a moment does not: one push's step read the first moment with
        # another push's gradient in it over the second moment without it (about zero at the first steps), and a
        # weight that 10 steps of Adam move by 0.1 reached 2353. Such an optimizer applies one push at a time.
        self._one_at_a_time = (
            contextlib.nullcontext() if type(self._optimizer) is keras.optimizers.SGD else threading.Lock()
        )

    def read(self) -> list[np.ndarray]:
        """The variables' values as they are now, one flat read-only view each, without copying them."""
        import tensorflow as tf

        return [np.asarray(memoryview(tf.convert_to_tensor(v)), np.float32).reshape(-1) for v in self._variables]

    @property
    def optimizer_variables(self) -> list:
        return _compat.optimizer_variables(self._optimizer)

    def state_layout(self) -> list[tuple[np.dtype, tuple[int, ...]]]:
        """The dtype and shape of each part of :meth:`state`: the shard's variables, then its optimizer's."""
        return [(np.dtype(v.dtype.name if hasattr(v.dtype, "name") else v.dtype), tuple(v.shape)) for v in self._state]

    @property
    def state_nbytes(self) -> int:
        """The bytes of :meth:`state` end to end: what a STATE answer carries (``sparkdl.ps.protocol``)."""
        return sum(dtype.itemsize * int(np.prod(shape)) for dtype, shape in self.state_layout())

    def state(self) -> list[np.ndarray]:
        """The shard's variables and its optimizer's, as copies of this moment (the caller holds the shard's lock)."""
        return [np.array(v.numpy(), copy=True) for v in self._state]

    def load_state(self, data) -> None:
        """Sets every variable from ``data``: :meth:`state`'s parts end to end, exactly :attr:`state_nbytes` bytes
        (of this shard's layout: the sender's is checked against it, never trusted)."""
        view = memoryview(data).cast("B")
        if len(view) != self.state_nbytes:
            raise ValueError(f"Expected {self.state_nbytes} bytes of shard state. Received: {len(view)} bytes")
        offset = 0
        for variable, (dtype, shape) in zip(self._state, self.state_layout()):
            size = dtype.itemsize * int(np.prod(shape))
            variable.assign(np.frombuffer(view[offset : offset + size], dtype).reshape(shape))
            offset += size

    @property
    def _state(self) -> list:
        return [*self._variables, *self.optimizer_variables]

    def apply(self, gradient: np.ndarray) -> None:
        import tensorflow as tf

        if not adopted.is_aligned(gradient):  # TensorFlow aborts the process on a misaligned in-place buffer
            aligned = adopted.aligned_empty(gradient.size, gradient.dtype)
            aligned[...] = gradient
            gradient = aligned
        bits = tf.experimental.dlpack.from_dlpack(gradient.view(_BITS[gradient.dtype.itemsize]).__dlpack__())
        dtype = tf.as_dtype(gradient.dtype).name
        with self._one_at_a_time:
            self._update_from(bits, dtype)

    def _update_from(self, bits, dtype: str) -> None:
        import tensorflow as tf

        if self._compiled is not None:
            try:
                self._compiled(bits, dtype)
                self._compiled_once = True
                return
            except tf.errors.OpError as exc:
                if self._compiled_once:
                    raise
                logger.warning(
                    "sparkdl: XLA cannot compile the update of %s (%s); the parameter server applies it unfused",
                    type(self._optimizer).__name__,
                    str(exc).splitlines()[0],
                )
                self._compiled = None
        self._unfused(bits, dtype)

    def _update(self, bits, dtype: str, copy: bool) -> None:
        """The optimizer's update from a push's bits: reinterpreted as ``dtype``, widened, cut into the variables.

        ``copy``: copy a float32 gradient first. The bits are the server's receive buffer, which the next push
        overwrites, and TensorFlow's unfused ops may adopt an input's memory as a variable's (an optimizer that
        keeps a gradient as it came); XLA's outputs never alias its inputs, and widening makes new memory too.
        """
        import tensorflow as tf

        gradient = tf.cast(tf.bitcast(bits, tf.as_dtype(dtype)), tf.float32)
        if copy and dtype == "float32":
            gradient = tf.raw_ops.DeepCopy(x=gradient)
        parts = tf.split(gradient, self._sizes)
        self._optimizer.apply(
            [
                tf.cast(tf.reshape(part, shape), variable.dtype)
                for part, shape, variable in zip(parts, self._shapes, self._variables)
            ],
            self._variables,
        )


class ServerModel:
    """The model whose trainable variables the server shards hold; ``compiled``: see the module's doc.

    ``hosted``: the shards this process serves (default: all). A server task of ``server_placement="executors"``
    hosts one; its ``shards`` then hold that one only, and ``optimizer_arrays``/``restore_optimizers`` name the
    shards by their index in the whole layout all the same.
    """

    def __init__(self, model, num_servers: int, *, compiled: bool, hosted: Sequence[int] | None = None):
        variables = list(model.trainable_variables)
        shapes = [tuple(v.shape) for v in variables]
        self.model = model
        self.spans = ShardSpans(shapes, assign_shards([int(np.prod(s)) for s in shapes], num_servers))
        self.hosted = list(range(num_servers)) if hosted is None else list(hosted)
        optimizer = model.optimizer
        self.shards = [
            OptimizerShard(
                [variables[i] for i in self.spans.shards[index]],
                type(optimizer),
                optimizer.get_config(),
                compiled=compiled,
            )
            for index in self.hosted
        ]

    def optimizer_arrays(self) -> dict[str, np.ndarray]:
        """Every hosted shard's optimizer state (moments, step counts), for a checkpoint."""
        return {
            f"shard{i}/{j}": np.array(v.numpy(), copy=True)
            for i, shard in zip(self.hosted, self.shards)
            for j, v in enumerate(shard.optimizer_variables)
        }

    def restore_optimizers(self, arrays: dict[str, np.ndarray]) -> bool:
        """Sets the hosted shards' optimizer state from ``optimizer_arrays`` of a server of the same layout.

        Returns False, changing nothing, when ``arrays`` do not fit (another number of shards, a
        checkpoint of sync or average mode, whose optimizer state is in the model itself). Where this
        process hosts some shards only, the arrays of the others are left out of the comparison, as are arrays
        of no shard (the workers' positions, ``sparkdl.ps.positions``).
        """
        variables = {
            f"shard{i}/{j}": v
            for i, shard in zip(self.hosted, self.shards)
            for j, v in enumerate(shard.optimizer_variables)
        }
        arrays = {k: a for k, a in arrays.items() if k.startswith("shard")}
        if len(self.hosted) < len(self.spans.shards):
            arrays = {k: a for k, a in arrays.items() if k.split("/", 1)[0] in {f"shard{i}" for i in self.hosted}}
        if set(arrays) != set(variables) or any(arrays[k].shape != tuple(v.shape) for k, v in variables.items()):
            return False
        for name, variable in variables.items():
            variable.assign(arrays[name])
        return True
