"""Runs the gossip rounds inside Keras's own train step, so that ``fit`` (metrics, callbacks) stays Keras's.

The model's optimizer is hooked (``sparkdl.keras.optimizer_hooks.intercept_apply``), as sync mode's
is, but what the hook does after the optimizer's update is D-PSGD's (Lian et al., 2017): every rank's
step is computed at its own weights, and the weights that step started from are averaged with the
neighbours' weights from the same step: ``x_i <- sum_j W_ij x_j + update_i(x_i)``.

The round of exchange step ``e`` (every ``gossip_every``-th global step: ``(e + 1) % k == 0``)
*starts* at the end of step ``e - 1``: the hook takes the weights just updated (``x_e``, which step
``e``'s gradient will be computed at) and hands them to ``exchange.Gossip``, which sends them while
step ``e``'s forward and backward pass run. At the end of step ``e``, after the optimizer's update,
the hook *finishes* the round: it waits for the neighbours' ``x_e`` and adds ``sum_j W_ij (x_j - x_e)``
to the weights. So a step waits for its round only for what the transfer takes beyond one forward
and backward pass, and steps between rounds (``gossip_every > 1``) cost nothing (a ``tf.cond``
skips them). Rounds are numbered from the global step, so a resumed fit exchanges in the same steps,
with the same random pairings, as an uninterrupted one.

The weights cross into numpy once per exchanged step, as one fused float32 vector; what is handed
back to TensorFlow is never an array this rank still sends (TensorFlow may adopt a returned buffer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparkdl.modes.gossip.exchange import Gossip


class GossipHook:
    """The ``intercept`` for :func:`~sparkdl.keras.optimizer_hooks.intercept_apply`: rounds of ``gossip`` every
    ``every`` steps of global steps ``first_step..stop_step-1``. Call :meth:`begin` before ``fit`` and
    :meth:`end` after it."""

    def __init__(self, gossip: Gossip, *, every: int, first_step: int, stop_step: int):
        self.gossip, self.every = gossip, every
        self.first_step, self.stop_step = first_step, stop_step
        self._counter = None  # the global step, in the graph (a tf.Variable made by ``begin``)

    # -- which steps do what (the same rule in the graph and in Python) ----------------------------

    def finishes(self, step: int) -> bool:
        """Whether step ``step`` ends with a round (its exchange step)."""
        return (step + 1) % self.every == 0

    def starts(self, step: int) -> bool:
        """Whether the end of step ``step`` starts the round of step ``step + 1``."""
        return (step + 2) % self.every == 0 and step + 1 < self.stop_step

    def round_of(self, step: int) -> int:
        """The number of the round that exchange step ``step`` finishes."""
        return (step + 1) // self.every - 1

    # -- around fit --------------------------------------------------------------------------------

    def begin(self, variables: Sequence) -> None:
        """Before the first step: the step counter, and the first round when the first step finishes one (its
        weights are the ones training starts from)."""
        import tensorflow as tf

        self._counter = tf.Variable(self.first_step, dtype=tf.int64, trainable=False, name="sparkdl_gossip_step")
        if self.first_step < self.stop_step and self.finishes(self.first_step):
            self.gossip.start(_flat(variables), self.round_of(self.first_step))

    def end(self) -> None:
        """After the last step: completes a round started for a step that never ran (training stopped early)."""
        self.gossip.drain()

    # -- in the graph ------------------------------------------------------------------------------

    def __call__(self, apply, grads: Sequence, variables: Sequence):
        import tensorflow as tf

        if self._counter is None:
            raise RuntimeError("GossipHook.begin() must run before the first step")
        applied = apply(grads, variables)
        step = self._counter.read_value()
        k = tf.constant(self.every, tf.int64)
        finishing = tf.equal(tf.math.floormod(step + 1, k), 0)
        starting = tf.logical_and(tf.equal(tf.math.floormod(step + 2, k), 0), step + 1 < self.stop_step)
        sizes = [int(np.prod(v.shape)) for v in variables]

        def fused():
            return tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(v), tf.float32), [-1]) for v in variables], 0)

        def finish():  # and start the next round, where the next step is an exchange step too (gossip_every=1)
            flat = fused()
            mixed = tf.numpy_function(self._finish, [flat, step], tf.float32, stateful=True, name="sparkdl_gossip")
            mixed = tf.ensure_shape(mixed, flat.shape)
            for variable, part in zip(variables, tf.split(mixed, sizes)):
                variable.assign(tf.cast(tf.reshape(part, variable.shape), variable.dtype))
            return tf.constant(True)

        def start():
            started = tf.numpy_function(
                self._start, [fused(), step], tf.bool, stateful=True, name="sparkdl_gossip_start"
            )
            return tf.ensure_shape(started, [])

        def neither():
            return tf.constant(False)

        done = tf.cond(finishing, finish, lambda: tf.cond(starting, start, neither))
        with tf.control_dependencies([done]):
            self._counter.assign_add(1)
        return applied

    # -- in Python, on exchanged steps -------------------------------------------------------------

    def _finish(self, flat: np.ndarray, step) -> np.ndarray:
        mixed = flat + self.gossip.finish()  # a new array: TensorFlow may keep it
        if self.starts(int(step)):
            self.gossip.start(mixed.copy(), self.round_of(int(step) + 1))
        return mixed

    def _start(self, flat: np.ndarray, step) -> np.bool_:
        self.gossip.start(np.array(flat, np.float32, copy=True), self.round_of(int(step) + 1))  # flat is TF's memory
        return np.bool_(True)


def _flat(variables: Sequence) -> np.ndarray:
    """The variables' values as one float32 vector (a new array)."""
    if not variables:
        return np.empty(0, np.float32)
    return np.concatenate([np.asarray(v.numpy(), np.float32).reshape(-1) for v in variables])
