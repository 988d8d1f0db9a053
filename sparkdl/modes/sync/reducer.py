"""Averages sync mode's gradients over the ranks in buckets that start moving while backprop is still running.

As PyTorch DDP's reducer and Horovod's tensor fusion: the step's gradients are grouped, from the
model's last variables to its first (the order backprop produces them), into buckets of about
``bucket_bytes``; each bucket is fused into one buffer and handed to the communicator's
asynchronous allreduce by its own ``tf.numpy_function`` as soon as its gradients exist, while
TensorFlow goes on computing the earlier layers' gradients; one last call waits for every bucket
before the optimizer applies the averages. The launches are stateful ops, which TensorFlow runs
in program order, so every rank starts the same buckets in the same order. A model whose
gradients fit one bucket (or ``overlap=False``) makes one blocking call per step instead.

With ``compile_update`` the averages' widening and division, and the optimizer's update, run as
one XLA function (``sparkdl.keras.compiled_update``).

With ``compression`` the buffers are narrowed to bfloat16 or float16 in the graph (TensorFlow's
cast, on every core), travel and are summed at that width (each addition in float32, rounded
once per hop, as NCCL does), and are widened back to float32 before the division by the ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from sparkdl.collective import compression as compressions
from sparkdl.collective.api import ReduceOp
from sparkdl.keras import compiled_update
from sparkdl.schedule import StepScales

#: Gradient bytes per bucket (on the wire): large enough that a bucket's fixed cost (two Python
#: calls, one collective's latency) is small beside its transfer, small enough that several
#: buckets of a model of tens of MB overlap its backward pass (DDP's default is 25 MB on GPUs).
BUCKET_BYTES = 4 << 20


class GradientReducer:
    """The ``intercept`` for :func:`sparkdl.keras.optimizer_hooks.intercept_apply` that averages over ``comm``.

    ``scales`` (per step from the fit's first, ``schedule.StepScales``) weigh this rank's gradient
    by its rows when the ranks' batches differ in size. ``timeout``
    bounds the wait for the buckets. ``profile`` (a :class:`~sparkdl.modes.sync.step_profile.StepProfile`)
    records when the gradients were ready and how long the exchange took.
    """

    def __init__(
        self,
        comm,
        *,
        timeout: float,
        scales: StepScales | None = None,
        compression: str | None = None,
        overlap: bool = True,
        bucket_bytes: int = BUCKET_BYTES,
        compile_update: bool = False,
        profile=None,
    ):
        self._comm, self._timeout, self._scales = comm, timeout, scales
        self._steps = itertools.count()
        self._compression = compression
        self._wire = np.dtype(np.float32) if compression is None else compressions.wire_dtype(compression)
        self._bucket_bytes = bucket_bytes if overlap else None
        self._compile_update = compile_update
        self._profile = profile
        self._pending: dict[int, tuple[Any, np.ndarray]] = {}  # bucket -> its work, and its input kept alive
        self._buffers: dict[tuple[int, int], np.ndarray] = {}  # (bucket, step parity) -> the collective's output
        self._parity = 0
        self.buckets: list[list[int]] = []  # the variables (by index) of each bucket, as last traced

    # -- in the graph ------------------------------------------------------------------------------

    def __call__(self, apply, grads: Sequence, variables: Sequence):
        import tensorflow as tf

        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return apply(grads, variables)
        dense = {i: tf.convert_to_tensor(grads[i]) for i in present}  # densifies IndexedSlices
        if self._scales is not None:
            scale = tf.ensure_shape(tf.numpy_function(self._next_scale, [], tf.float32, stateful=True), [])
            dense = {i: g * tf.cast(scale, g.dtype) for i, g in dense.items()}
        self.buckets = self._group(present, {i: int(np.prod(dense[i].shape)) for i in present})
        fused = [
            self._padded(tf.concat([tf.reshape(tf.cast(dense[i], tf.float32), [-1]) for i in bucket], 0))
            for bucket in self.buckets
        ]
        wire = [self._narrow(buffer) for buffer in fused]
        wire_dtype = tf.as_dtype(self._wire)
        if len(wire) == 1:
            reduced = [
                tf.numpy_function(
                    self._reduce_now, wire[0], wire_dtype, stateful=True, name=f"sparkdl_{self.OPERATION}"
                )
            ]
        else:
            started = [
                tf.numpy_function(
                    self._starter(b), inputs, tf.int32, stateful=True, name=f"sparkdl_{self.OPERATION}_start_{b}"
                )
                for b, inputs in enumerate(wire)
            ]
            reduced = tf.numpy_function(
                self._finish, started, [wire_dtype] * len(wire), stateful=True, name=f"sparkdl_{self.OPERATION}_wait"
            )
        reduced = [tf.ensure_shape(result, self._result_shape(buffer)) for result, buffer in zip(reduced, fused)]
        shapes = {i: (dense[i].shape, dense[i].dtype) for i in present}
        applied = self._apply_reduced(apply, reduced, shapes, len(grads), variables)
        if self._profile is not None:  # stateful, so it runs after the optimizer's updates (program order)
            tf.numpy_function(self._last_stamp(), [], tf.int32, stateful=True, name="sparkdl_profile_applied")
        return applied

    # -- what a subclass with another collective changes -------------------------------------------

    #: The communicator's operation each bucket goes through (its name in the graph's op names too).
    OPERATION = "allreduce"

    def _last_stamp(self):
        """The profile's stamp once the step's update is in the weights."""
        return self._profile.applied

    def _padded(self, buffer):
        """The fused bucket as it goes to the collective (a subclass may pad it)."""
        return buffer

    def _result_shape(self, buffer) -> list[int]:
        """The shape of the collective's result for the (padded) fused bucket ``buffer``."""
        return buffer.shape

    def _collective(self, wire: np.ndarray, bucket: int, *, now: bool):
        """Starts bucket ``bucket``'s collective on ``wire`` (``now``: runs it and returns its result)."""
        operation = self._comm.allreduce if now else self._comm.allreduce_async
        return operation(wire, ReduceOp.SUM, out=self._buffer(bucket, wire.shape, wire.dtype))

    def _apply_reduced(self, apply, reduced: list, shapes: dict, count: int, variables: Sequence):
        """Applies the step's update from the buckets' results: here, the ranks' sums averaged."""
        import tensorflow as tf

        def average_and_apply(reduced):
            out: list = [None] * count
            for bucket, result in zip(self.buckets, reduced):
                mean = tf.cast(result, tf.float32) * (1.0 / self._comm.size)
                for i, part in zip(bucket, tf.split(mean, [int(np.prod(shapes[i][0])) for i in bucket])):
                    out[i] = tf.cast(tf.reshape(part, shapes[i][0]), shapes[i][1])
            return apply(out, variables)

        if self._compile_update:  # the widening, the mean and the update: one XLA function
            return compiled_update.compiled(average_and_apply)(reduced)
        return average_and_apply(reduced)

    def _group(self, present: list[int], sizes: dict[int, int]) -> list[list[int]]:
        """The variables of each bucket (``sizes``: their elements): the last ones first, as backprop
        produces their gradients."""
        if self._bucket_bytes is None:
            return [present]
        buckets, current, size = [], [], 0
        for i in reversed(present):
            current.append(i)
            size += sizes[i] * self._wire.itemsize
            if size >= self._bucket_bytes:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        return buckets

    def _narrow(self, buffer) -> list:
        """The buffer as it goes to the wire (and, for float16, its largest magnitude, checked before it goes)."""
        import tensorflow as tf

        if self._compression is None:
            return [buffer]
        narrowed = tf.cast(buffer, tf.as_dtype(self._wire))
        if self._compression == "fp16":
            return [narrowed, tf.reduce_max(tf.abs(buffer))]
        return [narrowed]

    # -- in Python, once per step ------------------------------------------------------------------

    def _next_scale(self) -> np.float32:
        assert self._scales is not None  # called only when there are scales
        return np.float32(self._scales.at(next(self._steps)))

    def _reduce_now(self, wire: np.ndarray, largest=None) -> np.ndarray:
        self._check(largest)
        if self._profile is not None:
            self._profile.gradients_ready(done=[False], nbytes=wire.nbytes)
            self._profile.peers_ready(self._comm)
        result = self._collective(wire, 0, now=True)
        self._parity ^= 1
        if self._profile is not None:
            self._profile.exchange_done()
        return result

    def _starter(self, bucket: int):
        def start(wire: np.ndarray, largest=None) -> np.int32:
            self._check(largest)
            # the input is TensorFlow's memory, alive until this step ends: the buffer is kept with the work
            self._pending[bucket] = (self._collective(wire, bucket, now=False), wire)
            return np.int32(bucket)

        return start

    def _finish(self, *started: np.int32) -> list[np.ndarray]:
        pending = [self._pending.pop(int(bucket)) for bucket in started]
        works = [work for work, _ in pending]
        if self._profile is not None:  # backprop is over: which buckets have already crossed? (no wait for peers)
            nbytes = sum(wire.nbytes for _, wire in pending)
            self._profile.gradients_ready(done=[work.done() for work in works], nbytes=nbytes)
        results = [work.wait(self._timeout) for work in works]
        self._parity ^= 1
        if self._profile is not None:
            self._profile.exchange_done()
        return results

    def _buffer(self, bucket: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The bucket's output buffer, allocated once; two per bucket, alternating steps, so that a step's
        result is never overwritten while TensorFlow may still read it."""
        key = (bucket, self._parity)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tuple(shape) or buffer.dtype != dtype:
            buffer = self._buffers[key] = np.empty(shape, dtype)
        return buffer

    def _check(self, largest) -> None:
        if largest is not None:
            compressions.check_fits_float16(np.asarray(largest))
