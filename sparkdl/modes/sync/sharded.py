"""Sharded data parallelism (ZeRO stage 1): each rank keeps and updates 1/N of the optimizer's state.

Sync mode replicates the optimizer: every rank holds every slot (Adam's two moments: twice the
weights) and applies the whole update, memory-bound work that one process would do once. In
``mode="sharded"`` the gradient buckets are reduce-scattered instead of allreduced (the ring's first
half, still overlapping backprop, ``reducer.GradientReducer``): each rank receives the sum of its
part of every bucket, updates only that part of the weights with an optimizer built over one flat
variable of that size (its "shard"), and the updated parts are all-gathered into every rank's
weights (the ring's second half). The bytes on the wire are those of one allreduce; each rank's
optimizer state and update are 1/N of the model's.

The flat shard is exact only for optimizers that treat every element alone (SGD, Adam and the
others of :data:`ELEMENTWISE`); :func:`check_model` refuses the rest on the driver. The checkpoints
and the result hold a normal optimizer: :class:`ShardedOptimizer` gathers the shards into one on
rank 0 (``consolidate``), and re-shards a saved optimizer's state when a fit resumes, onto any
number of ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from sparkdl import _compat
from sparkdl.collective.api import ReduceOp
from sparkdl.keras import adopted, compiled_update
from sparkdl.keras.optimizer_hooks import intercept_apply, standing_in
from sparkdl.modes.sync.reducer import GradientReducer

#: Keras optimizers whose update of an element depends on that element's gradient and slots only.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Lion", "Ftrl")
#: The shard's variable name; the optimizer names its slots ``sparkdl_shard_<slot>``.
SHARD = "sparkdl_shard"


def check_model(model) -> None:
    """Refuses, on the driver, a model whose optimizer's update cannot be split into independent shards."""
    import keras

    if _compat.keras_major() < 3:
        raise ValueError("mode='sharded' needs Keras 3.")
    optimizer = model.optimizer
    name = type(optimizer).__name__
    if type(optimizer) is not getattr(keras.optimizers, name, None) or name not in ELEMENTWISE:
        raise ValueError(
            f"mode='sharded' updates each rank's slice of the weights alone, so it needs an optimizer that "
            f"updates every weight from its own gradient only: one of keras.optimizers.{{{', '.join(ELEMENTWISE)}}}. "
            f"Received: {name} ({type(optimizer).__module__}). Use mode='sync' for it."
        )
    for setting in ("clipnorm", "global_clipnorm"):
        if getattr(optimizer, setting, None):
            raise ValueError(
                f"mode='sharded' cannot clip by norm: a norm spans every rank's shard. Received: "
                f"{setting}={getattr(optimizer, setting)!r}. Use clipvalue, or mode='sync'."
            )
    if optimizer.use_ema or optimizer.gradient_accumulation_steps:
        raise ValueError(
            "mode='sharded' supports neither use_ema nor gradient_accumulation_steps. Received: "
            f"use_ema={optimizer.use_ema}, gradient_accumulation_steps={optimizer.gradient_accumulation_steps}"
        )
    wide = [v.path for v in model.trainable_variables if _compat.numpy_dtype(v.dtype) != np.float32]
    if wide:
        raise ValueError(
            f"mode='sharded' keeps the weights' shards as float32. Received trainable variables of other dtypes: "
            f"{wide[:5]}. Use mode='sync' for mixed precision."
        )


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where each rank's shard lies in the gradient buckets: each bucket padded to a multiple of the ranks
    and cut in equal parts (the reduce-scatter's); a shard is this rank's part of every bucket, in order."""

    buckets: tuple[tuple[int, ...], ...]  # variable indices per bucket, as the reducer groups them
    sizes: tuple[int, ...]  # elements per variable, by index
    ranks: int

    def length(self, bucket: int) -> int:
        return sum(self.sizes[i] for i in self.buckets[bucket])

    def part(self, bucket: int) -> int:
        """Elements of each rank's part of ``bucket`` (padded)."""
        return -(-self.length(bucket) // self.ranks)

    def padded(self, bucket: int) -> int:
        """Elements of ``bucket`` padded to a multiple of the ranks."""
        return self.part(bucket) * self.ranks

    @property
    def shard_size(self) -> int:
        return sum(self.part(b) for b in range(len(self.buckets)))

    @property
    def order(self) -> list[int]:
        """The variables in the order of the gathered weights (bucket by bucket)."""
        return [i for bucket in self.buckets for i in bucket]

    def shard_of(self, values: Sequence[np.ndarray], rank: int) -> np.ndarray:
        """Rank ``rank``'s shard of the per-variable ``values`` (by variable index)."""
        parts = []
        for b, bucket in enumerate(self.buckets):
            padded = np.zeros(self.part(b) * self.ranks, np.float32)
            padded[: self.length(b)] = np.concatenate([np.ravel(values[i]) for i in bucket])
            parts.append(padded[rank * self.part(b) : (rank + 1) * self.part(b)])
        return np.concatenate(parts)

    def variables_of(self, shards: Sequence[np.ndarray]) -> Iterator[tuple[int, np.ndarray]]:
        """Each variable's flat values, by index in :attr:`order`, from every rank's shard (by rank): one bucket
        joined at a time, so that no more than a bucket is held beside the shards."""
        column = 0
        for b, bucket in enumerate(self.buckets):
            part, offset = self.part(b), 0
            joined = np.concatenate([shard[column : column + part] for shard in shards])
            for i in bucket:
                yield i, joined[offset : offset + self.sizes[i]]
                offset += self.sizes[i]
            column += part


class ShardedReducer(GradientReducer):
    """Reduce-scatters the gradient buckets, updates this rank's shard, all-gathers the weights."""

    OPERATION = "reduce_scatter"

    def __init__(self, comm, variables: Sequence, **options):
        super().__init__(comm, **options)
        sizes = tuple(int(np.prod(v.shape)) for v in variables)
        buckets = self._group(list(range(len(sizes))), dict(enumerate(sizes)))
        self.layout = ShardLayout(tuple(map(tuple, buckets)), sizes, comm.size)
        # the gathered weights: TensorFlow reads them in place, and the variables may keep their memory
        self._gathered = adopted.BufferPool(sum(self.layout.padded(b) for b in range(len(buckets))), np.float32)
        self.shard = None  # the flat variable of this rank's weights, set by ShardedOptimizer

    def release(self) -> None:
        """Drops the buffers the steps reuse (the gathered weights, the collectives' outputs): training is over.
        TensorFlow keeps what a variable adopted of them."""
        self._gathered = adopted.BufferPool(self._gathered.size, self._gathered.dtype)
        self._buffers.clear()

    def __call__(self, apply, grads: Sequence, variables: Sequence):
        missing = [v.path for v, g in zip(variables, grads) if g is None]
        if missing:
            raise ValueError(
                f"mode='sharded' needs a gradient for every trainable variable; these have none: {missing[:5]}. "
                "Make the layers that do not take part in the loss non-trainable."
            )
        return super().__call__(apply, grads, variables)

    def _padded(self, buffer):
        import tensorflow as tf

        return tf.pad(buffer, [[0, (-int(buffer.shape[0])) % self._comm.size]])

    def _result_shape(self, buffer) -> list[int]:
        return [int(buffer.shape[0]) // self._comm.size]

    def _collective(self, wire: np.ndarray, bucket: int, *, now: bool):
        operation = self._comm.reduce_scatter if now else self._comm.reduce_scatter_async
        return operation(wire, ReduceOp.SUM, out=self._buffer(bucket, (wire.size // self._comm.size,), wire.dtype))

    def _apply_reduced(self, apply, reduced: list, shapes: dict, count: int, variables: Sequence):
        import tensorflow as tf

        if [list(bucket) for bucket in self.layout.buckets] != self.buckets:
            raise RuntimeError(f"The gradients' buckets {self.buckets} differ from the shards' {self.layout.buckets}")
        shard = self.shard

        def average_and_apply(reduced):
            gradient = tf.concat([tf.cast(part, tf.float32) for part in reduced], 0) * (1.0 / self._comm.size)
            return apply([gradient], [shard])

        if self._compile_update:
            compiled_update.compiled(average_and_apply)(reduced)
        else:
            average_and_apply(reduced)
        layout, gathered_parts, targets = self.layout, [], []
        for b, bucket in enumerate(layout.buckets):  # each bucket's padding is split off and dropped
            gathered_parts += [layout.sizes[i] for i in bucket] + [layout.padded(b) - layout.length(b)]
            targets += list(bucket) + [None]
        weights = tf.numpy_function(
            self._allgather, [tf.convert_to_tensor(shard)], tf.float32, stateful=True, name="sparkdl_allgather"
        )
        parts = tf.split(tf.ensure_shape(weights, [sum(gathered_parts)]), gathered_parts)
        for i, part in zip(targets, parts):
            if i is not None:
                variables[i].assign(tf.reshape(part, shapes[i][0]))

    def _last_stamp(self):
        return self._profile.gathered

    def _allgather(self, shard: np.ndarray) -> np.ndarray:
        """Every rank's updated shard, as the padded buckets in order: each bucket's parts gathered in place."""
        if self._profile is not None:
            self._profile.applied()  # this rank's shard is updated
        out = self._gathered.take()
        start = column = 0
        for b in range(len(self.layout.buckets)):
            part, padded = self.layout.part(b), self.layout.padded(b)
            rows = out[start : start + padded].reshape(self._comm.size, part)
            self._comm.allgather(shard[column : column + part], out=rows)
            start, column = start + padded, column + part
        return out


class ShardedOptimizer:
    """This rank's optimizer over its shard, standing in for the model's optimizer while ``fit`` runs.

    Built from the model's optimizer's config over one flat variable, :attr:`shard`; a model whose
    optimizer holds state (a resumed fit) gives each rank its slice of every slot. ``consolidate``
    (collective) gathers the slots into a normal optimizer over the model's variables on rank 0
    (:meth:`full`), which a save records instead (``optimizer_hooks.saved_form``) and ``finish``
    leaves in the model.
    """

    def __init__(self, model, comm, reducer: ShardedReducer):
        import keras

        self._model, self._comm, self._reducer, self._layout = model, comm, reducer, reducer.layout
        user = model.optimizer
        self._class, variables = type(user), model.trainable_variables
        self.shard = reducer.shard = keras.Variable(
            self._layout.shard_of([v.numpy() for v in variables], comm.rank), name=SHARD
        )
        self.optimizer = self._class.from_config(user.get_config())
        self.optimizer.build([self.shard])
        self._slots = [v for v in self.optimizer.variables if v.name.startswith(SHARD + "_")]
        self._others = [v for v in self.optimizer.variables if not v.name.startswith(SHARD + "_")]
        if user.built and user.variables:
            self._load(user)
        self._full: Any = None  # rank 0's optimizer over the model's variables, from ``consolidate`` to its use
        model.optimizer = self.optimizer
        # Keras's compile config keeps the optimizer it was compiled with (a loaded model's: built, every slot
        # whole): it keeps an unbuilt one of the same config instead, so that the whole state is let go.
        _compiled_with(model, self._class.from_config(user.get_config()))

    def summary(self) -> dict:
        """Collective: the optimizer-state bytes every rank's process holds (:func:`held_optimizer_bytes`), beside
        what each would hold in sync mode."""
        held = self._comm.allgather(np.array([held_optimizer_bytes()], np.int64))[:, 0]
        return {"optimizer_state_bytes": held.tolist(), "replicated_optimizer_state_bytes": self.replicated_bytes()}

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer over its shard."""
        return sum(_nbytes(v) for v in self.optimizer.variables)

    def replicated_bytes(self) -> int:
        """Bytes of optimizer state each rank would hold in sync mode."""
        others = sum(_nbytes(v) for v in self._others)
        return others + 4 * len(self._slots) * sum(self._layout.sizes)

    def consolidate(self) -> None:
        """Collective: rank 0 builds a full optimizer holding every rank's slots (gathered one slot at a time) and
        this step's other variables, kept until :meth:`full` hands it over."""
        full = None
        if self._comm.rank == 0:
            full = self._class.from_config(self.optimizer.get_config())
            full.build(self._model.trainable_variables)
            slot_of, others = self._slot_variables(full)
            for ours, theirs in zip(self._others, others):
                theirs.assign(ours.numpy())
        for slot in self._slots:
            gathered = self._comm.gather(np.asarray(slot.numpy(), np.float32), root=0)
            if gathered is None:
                continue
            suffix = slot.name[len(SHARD) + 1 :]
            for i, values in self._layout.variables_of(gathered):
                target = slot_of[(i, suffix)]
                target.assign(values.reshape(tuple(target.shape)))
        self._full = full

    def full(self):
        """Rank 0's optimizer over the model's variables, as of the last ``consolidate``: handed over (a save
        records it, then lets it go), so that no rank holds the whole state while it trains."""
        if self._full is None:
            raise RuntimeError("The sharded optimizer's state was not gathered (consolidate) before a save")
        full, self._full = self._full, None
        return full

    def finish(self) -> None:
        """Collective, after training: rank 0's model keeps the full optimizer, as the fit's result; the steps'
        buffers are dropped first, so that rank 0 gathers it in their room."""
        self._reducer.release()
        self.consolidate()
        if self._full is not None:
            full = self.full()
            self._model.optimizer = full
            _compiled_with(self._model, full)

    @contextlib.contextmanager
    def consolidated(self) -> Iterator[None]:
        """Collective: the state gathered (``consolidate``) for a save inside the block, which takes it on rank 0."""
        self.consolidate()
        yield

    def consolidating_callback(self):
        """A Keras callback that gathers the state at every epoch's end (for rank 0's checkpoint after it)."""
        import keras

        state = self

        class ConsolidateShards(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                state.consolidate()

        return ConsolidateShards()

    def _load(self, user) -> None:
        """This rank's slice of every slot of ``user`` (an optimizer over the model's variables)."""
        slot_of, others = self._slot_variables(user)
        for ours, theirs in zip(self._others, others):
            ours.assign(theirs.numpy())
        for slot in self._slots:
            suffix = slot.name[len(SHARD) + 1 :]
            values = [slot_of[(i, suffix)].numpy() for i in range(len(self._layout.sizes))]
            slot.assign(self._layout.shard_of(values, self._comm.rank))

    def _slot_variables(self, optimizer) -> tuple[dict[tuple[int, str], Any], list]:
        """``optimizer``'s slots by (variable index, slot name), and its other variables in order."""
        by_name = {v.name: v for v in optimizer.variables}
        suffixes = [slot.name[len(SHARD) + 1 :] for slot in self._slots]
        slot_of: dict[tuple[int, str], Any] = {}
        for i, variable in enumerate(self._model.trainable_variables):
            for suffix in suffixes:
                name = f"{variable.path.replace('/', '_')}_{suffix}"
                if name not in by_name:
                    raise RuntimeError(f"{type(optimizer).__name__} has no slot {name!r} for {variable.path}")
                slot_of[(i, suffix)] = by_name[name]
        taken = {id(v) for v in slot_of.values()}
        others = [v for v in optimizer.variables if id(v) not in taken]
        if len(others) != len(self._others):
            raise RuntimeError(
                f"{type(optimizer).__name__}'s variables {[v.name for v in others]} do not match the shard's "
                f"{[v.name for v in self._others]}"
            )
        return slot_of, others


def _compiled_with(model, optimizer) -> None:
    """Keras's record of the optimizer ``model`` was compiled with (its ``compile_config``) names ``optimizer``."""
    compile_config = getattr(model, "_compile_config", None)
    if compile_config is not None and "optimizer" in compile_config.config:
        compile_config.config["optimizer"] = optimizer


#: The Keras optimizers this Python worker already held when its current task began (:func:`count_optimizers_from_now`):
#: a reused worker may still hold an earlier fit's, which are not this task's to count.
_EARLIER_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()


def count_optimizers_from_now() -> None:
    """At a task's start, before it loads a model: :func:`held_optimizer_bytes` leaves out the optimizers alive now."""
    _EARLIER_OPTIMIZERS.clear()
    _EARLIER_OPTIMIZERS.update(_live_optimizers())


def held_optimizer_bytes() -> int:
    """Bytes of the variables of every Keras optimizer alive in this process (after a garbage collection) that the
    current task made: what a rank's process holds of optimizer state, whichever object holds it."""
    return sum(
        _nbytes(v)
        for optimizer in _live_optimizers()
        if optimizer not in _EARLIER_OPTIMIZERS
        for v in optimizer.variables
    )


def _live_optimizers() -> list:
    import keras

    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, keras.optimizers.Optimizer)]


def _nbytes(variable) -> int:
    return int(np.prod(variable.shape)) * _compat.numpy_dtype(variable.dtype).itemsize


@contextlib.contextmanager
def sharded_optimizer(model, comm, **options) -> Iterator[ShardedOptimizer]:
    """While the block runs, the model's optimizer is this rank's :class:`ShardedOptimizer`'s, its gradients
    reduce-scattered (``options``: :class:`ShardedReducer`'s); a save records the gathered whole."""
    reducer = ShardedReducer(comm, model.trainable_variables, **options)
    state = ShardedOptimizer(model, comm, reducer)
    with intercept_apply(state.optimizer, reducer), standing_in(state.optimizer, state.full):
        yield state
