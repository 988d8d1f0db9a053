"""A worker's side of each step: its gradients fused (and narrowed) in the train step, pushed, the server's weights assigned.

The train step itself, in TensorFlow, casts each gradient to the push dtype (float32, or with
``compression`` the half-width dtype: narrowed once, on the way into the fused vector) and
concatenates them shard by shard (``ShardSpans.order``), so that each shard's part of the vector
is one span the client sends in place. Under compression a small function compiled by XLA narrows
and concatenates in one pass (TensorFlow's own cast to bfloat16 is a scalar loop, and its concat
then copies again: 10-11 ms of a core against 7.3 for 8.4M parameters); a float32 concat is as
fast without XLA (6.4 ms).

The numpy side (:class:`PushPull`) pushes the vector and pulls the server's float32 weights into
a buffer, whose spans the step assigns to the variables. Nothing is copied in numpy (each copy of
an 8.4M-parameter model's 32 MB costs 5-15 ms of a core, docs/performance.md), and TensorFlow
takes the buffer over as the variables' memory without copying it either, holding a reference to
it for as long as anything (a variable, a tensor read from one) uses that memory. So a pull never
writes a buffer TensorFlow still references: it reuses one TensorFlow has let go of, or takes a
fresh one (whose pages the kernel first faults in and zeroes: 5% of the step's CPU in a profile).

With ``push_every=k`` the step adds its float32 gradient to a sum kept in the graph instead,
and every k-th step pushes the mean (narrowed once, then); until then the model keeps the
weights it pulled, as the k steps must be taken at the same weights.

Each push names the worker's global step it belongs to (:class:`PushSteps`: the last of the steps
it sums), by which a shard that applied it already drops it (``sparkdl.ps.positions``); under
``mode="sync_ps"`` also the worker's rows in it, which weigh it in the server's mean of the step,
and the pull that follows returns once the server has applied that mean (``sparkdl.ps.rules.Rounds``).
A push may also ask for a step checkpoint of the state after it (``step_requests``).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np

from sparkdl.collective import compression as compressions
from sparkdl.keras import adopted, compiled_update
from sparkdl.modes.parameter_server.step_requests import StepRequests
from sparkdl.ps import wire
from sparkdl.ps.client import ParameterClient
from sparkdl.ps.sharding import ShardSpans

#: Pull buffers kept for reuse: one for the weights the variables hold now, more while TensorFlow lets go of others.
POOLED_BUFFERS = 3


@dataclasses.dataclass(frozen=True)
class PushSteps:
    """Which global steps a worker's pushes belong to: its attempt trains steps ``first..stop-1``, ``per_push`` to a
    push (``push_every``); under sync_ps ``rows`` are its training rows at each step of an epoch (0 at a filler step,
    ``sparkdl.schedule.step_sizes``), which weigh its push."""

    first: int
    stop: int
    per_push: int = 1
    rows: np.ndarray | None = None

    def at(self, push: int) -> tuple[int, int]:
        """The global step of the worker's ``push``-th push (from 0), the last it sums, and the rows behind it (0 but
        under sync_ps)."""
        step = min(self.first + (push + 1) * self.per_push, self.stop) - 1
        return step, 0 if self.rows is None else int(self.rows[step % len(self.rows)])


#: A push per step from step 0 on, not sync_ps's.
EVERY_STEP = PushSteps(0, sys.maxsize)


class PushPull:
    """The numpy side of a push: the fused gradient's spans pushed to their shards, then the server's weights."""

    def __init__(
        self,
        client: ParameterClient,
        spans: ShardSpans,
        compression: str | None,
        steps: PushSteps = EVERY_STEP,
        requests: StepRequests | None = None,
    ):
        self._client = client
        self._spans = spans
        self._compression = compression
        self._steps = steps  # each push's step (and rows, under sync_ps)
        self._requests = requests  # when a push asks for a step checkpoint
        self._buffers = adopted.BufferPool(spans.size, np.float32, keep=POOLED_BUFFERS)
        self.pushes = self.pulls = 0
        self.push_seconds = self.pull_seconds = 0.0  # waiting for the server: sending, applying, receiving

    def push(self, fused: np.ndarray, largest: np.ndarray) -> np.ndarray:
        """Pushes ``fused`` (shard by shard, in the push dtype; ``largest``: its float32 magnitude, checked against
        float16's range under ``compression="fp16"``), then returns the server's weights."""
        if self._compression == "fp16":
            compressions.check_fits_float16(largest)
        step, rows = self._steps.at(self.pushes)
        asking = self._requests if self._requests is not None and self._requests.due(step) else None
        started = time.perf_counter()
        if asking is not None and asking.holds:  # sync_ps: the rounds after this step wait for the driver's save
            self._client.hold(step)
        self._client.push([fused[start:stop] for start, stop in self._spans.bounds], step=step, rows=rows)
        self.push_seconds += time.perf_counter() - started
        self.pushes += 1
        weights = self.pull()  # (sync_ps: once the step is applied on every shard)
        if asking is not None:
            asking.ask(step)
        return weights

    def pull(self) -> np.ndarray:
        """The server's weights, shard by shard, in a buffer nothing else references (aligned: TensorFlow takes it
        over in place)."""
        out = self._buffers.take()
        started = time.perf_counter()
        self._client.pull([out[start:stop] for start, stop in self._spans.bounds])
        self.pull_seconds += time.perf_counter() - started
        self.pulls += 1
        return out


class StepHook:
    """The graph side: the ``intercept`` of ``keras.optimizer_hooks.intercept_apply`` for a parameter-server worker.

    Called while Keras traces the train step, with the step's gradients; ``flush`` pushes, after
    training, what a ``push_every`` larger than 1 summed since the last push.
    """

    def __init__(self, model, spans: ShardSpans, push_pull: PushPull, push_every: int, compression: str | None):
        import tensorflow as tf

        self._spans = spans
        self._push_pull = push_pull
        self._push_every = push_every
        self._iterations = model.optimizer.iterations
        self._dtype = tf.as_dtype(wire.push_dtype(compression))
        self._checks_range = compression == "fp16"
        self._fuse = compiled_update.compiled(self._fused) if compression else self._fused
        if push_every > 1:
            self._sum = tf.Variable(tf.zeros([spans.size]), trainable=False, name="sparkdl_gradient_sum")
            self._steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="sparkdl_summed_steps")

    def __call__(self, apply, grads: list, variables: list):
        import tensorflow as tf

        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]
        ordered = [tf.reshape(grads[i], [-1]) for i in self._spans.order]
        if self._push_every == 1:
            self.assign(variables, self._push(*self._fuse(ordered)))
        else:
            self._sum.assign_add(tf.concat([tf.cast(g, tf.float32) for g in ordered], 0))
            self._steps.assign_add(1)
            tf.cond(self._steps % self._push_every == 0, lambda: self._push_mean(variables), lambda: None)
        return self._iterations.assign_add(1)

    def flush(self) -> None:
        """Pushes the mean of the steps summed since the last push, if any (eagerly, after ``fit``)."""
        if self._push_every > 1 and int(self._steps.numpy()) % self._push_every:
            fused, largest = self._mean(int(self._steps.numpy()) % self._push_every)
            self._push_pull.push(fused.numpy(), np.asarray(largest))

    def assign(self, variables: list, weights) -> None:
        """Sets ``variables`` (model order) from the server's weights (shard by shard), in the graph or eagerly."""
        import tensorflow as tf

        weights = tf.ensure_shape(tf.convert_to_tensor(weights, tf.float32), [self._spans.size])
        position = 0
        for i in self._spans.order:
            variable = variables[i]
            size = int(np.prod(variable.shape))
            variable.assign(tf.cast(tf.reshape(weights[position : position + size], variable.shape), variable.dtype))
            position += size

    def _fused(self, ordered: list):
        """The gradients (flat, in shard order) cast to the push dtype end to end, and their float32 magnitude."""
        import tensorflow as tf

        largest = tf.reduce_max([tf.reduce_max(tf.abs(g)) for g in ordered]) if self._checks_range else 0.0
        return tf.concat([tf.cast(g, self._dtype) for g in ordered], 0), largest

    def _push(self, fused, largest):
        import tensorflow as tf

        return tf.numpy_function(
            self._push_pull.push, [fused, tf.cast(largest, tf.float32)], tf.float32, stateful=True, name="sparkdl_push"
        )

    def _push_mean(self, variables: list) -> None:
        import tensorflow as tf

        weights = self._push(*self._mean(self._push_every))
        self._sum.assign(tf.zeros_like(self._sum))
        self.assign(variables, weights)

    def _mean(self, steps: int):
        """The mean of the summed gradients over ``steps``, in the push dtype, and its float32 magnitude."""
        import tensorflow as tf

        mean = self._sum / steps
        largest = tf.reduce_max(tf.abs(mean)) if self._checks_range else 0.0
        return tf.cast(mean, self._dtype), largest
