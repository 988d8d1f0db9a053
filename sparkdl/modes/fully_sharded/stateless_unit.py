"""One unit of a fully sharded model as TensorFlow functions of weights it is given: the unit itself holds none.

The engine (``engine``) gathers a unit's weights, calls :attr:`Unit.forward` on them and drops them; for
the backward pass it gathers them again and :attr:`Unit.backward` runs the forward again under a tape
from the activation kept at the unit's entry. A unit whose weights the engine keeps from its forward to its
backward pass runs :meth:`Unit.forward_taped` instead, once: its backward (:meth:`Unit.backward_taped`) takes the
gradients from that pass's tape. The unit's Keras model is deferred (``sparkdl.keras.deferred``): its variables
hold no memory, and ``stateless_call`` runs it on the weights passed in, in the chain order of ``units``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from sparkdl.keras import random_state
from sparkdl.keras.deferred import initial_value, is_deferred
from sparkdl.modes.fully_sharded import units
from sparkdl.modes.pipeline.engine import batch_loss


@dataclasses.dataclass
class TapedPass:
    """A unit's forward pass recorded for its backward pass: the tape holds the activations (and the weights) the
    gradients need until :meth:`Unit.backward_taped` takes them."""

    tape: tf.GradientTape
    x: tf.Tensor
    weights: list
    outputs: tf.Tensor
    penalty: tf.Tensor | None
    loss: tf.Tensor | None


class Unit:
    """One unit: its deferred Keras model, run on given weights (chain order) and non-trainable values."""

    def __init__(self, model: keras.Model, loss: Any, *, last: bool, first: bool):
        self.model, self.last, self.first = model, last, first
        self._loss = keras.losses.get(loss) if isinstance(loss, str) else loss
        canonical = units.trainables(units.own_layers(model))
        position = {id(variable): k for k, variable in enumerate(canonical)}
        self._order = [position[id(variable)] for variable in model.trainable_variables]
        self.shapes = [tuple(int(d) for d in variable.shape) for variable in canonical]
        held = {id(variable): k for k, variable in enumerate(model.non_trainable_variables)}
        # where the non-trainable weights (chain order) sit among the values a call takes (seed states too)
        self.statistic_places = [held[id(v)] for v in units.statistics(units.own_layers(model))]
        # where the seed generators' states sit among them (Dropout's), in the model's order
        self.generator_places = [k for k, v in enumerate(model.non_trainable_variables) if random_state.is_generator(v)]
        undeferred = [variable.path for variable in model.variables if not is_deferred(variable)]
        if undeferred:
            raise RuntimeError(f"A fully sharded unit's variables must hold no memory; these do: {undeferred[:5]}")

        def forward(x, weights, statistics, y, training: bool):
            """The unit's outputs, its non-trainable values after the call, its penalties (training), the loss (last)."""
            return self._run(x, weights, statistics, y, training)

        # Functions of this unit's own (not one method's for all units: TensorFlow would take them for retraces)
        self.forward = tf.function(forward, reduce_retracing=True)
        self.backward = tf.function(functools.partial(Unit._backward, self), reduce_retracing=True)
        self._flat = tf.function(functools.partial(Unit._flatten, self), reduce_retracing=True)

    def forward_taped(self, x, weights: Sequence, statistics: Sequence, y) -> tuple[TapedPass, Sequence]:
        """A training forward pass (:attr:`forward`'s) under a tape kept for :meth:`backward_taped`; and the unit's
        non-trainable values after it."""
        weights = list(weights)
        with tf.GradientTape() as tape:
            tape.watch(weights)
            if not self.first:
                tape.watch(x)
            outputs, statistics, penalty, loss = self.forward(x, weights, statistics, y, True)
        return TapedPass(tape, x, weights, outputs, penalty, loss), statistics

    def backward_taped(self, taped: TapedPass, upstream, scale, padded: int):
        """:attr:`backward`'s results from the forward pass ``taped`` recorded: the forward is not run again."""
        targets = [term for term in (taped.loss, taped.penalty) if term is not None]
        seeds = [tf.ones_like(term) for term in targets]
        if upstream is not None:
            targets.append(taped.outputs)
            seeds.append(tf.cast(upstream, taped.outputs.dtype))
        sources = [*taped.weights] + ([] if self.first else [taped.x])
        gradients = taped.tape.gradient(
            targets, sources, output_gradients=seeds, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        flat = self._flat(gradients[: len(taped.weights)], scale, padded)
        return flat, (None if self.first else gradients[-1])

    def starting_statistics(self, weights: Sequence[np.ndarray]) -> list[tf.Tensor]:
        """The non-trainable values a call takes: the unit's non-trainable ``weights`` (chain order) where they go,
        a seed generator's state from its initializer until the replica seeds it (``start_random_state``)."""
        values = [tf.convert_to_tensor(initial_value(v)) for v in self.model.non_trainable_variables]
        if len(weights) != len(self.statistic_places):
            raise ValueError(f"Expected {len(self.statistic_places)} non-trainable weights. Received: {len(weights)}")
        for place, value in zip(self.statistic_places, weights):
            values[place] = tf.convert_to_tensor(value)
        return values

    def _run(self, x, weights: Sequence, statistics: Sequence, y, training: bool):
        outputs, statistics, losses = self.model.stateless_call(
            [weights[k] for k in self._order], list(statistics), x, training=training, return_losses=True
        )
        penalty = tf.add_n(losses) if training and losses else None
        loss = batch_loss(self._loss, y, outputs) if y is not None else None
        return outputs, statistics, penalty, loss

    def _backward(self, x, weights, statistics, upstream, y, scale, padded: int):
        """The gradient of the loss (the last unit's, plus the unit's penalties, plus ``upstream`` through its
        outputs) with respect to ``weights``, as one vector in the weights' order times ``scale``, zero-padded to
        ``padded`` values; and, but on the first unit (None), with respect to ``x``. The forward pass run again."""
        with tf.GradientTape() as tape:
            tape.watch(weights)
            if not self.first:
                tape.watch(x)
            outputs, _, penalty, loss = self._run(x, weights, statistics, y, True)
            terms = [term for term in (loss, penalty) if term is not None]
            if upstream is not None:
                terms.append(tf.reduce_sum(outputs * tf.cast(upstream, outputs.dtype)))
            total = tf.add_n(terms)
        sources = [*weights] + ([] if self.first else [x])
        gradients = tape.gradient(total, sources, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return self._flatten(gradients[: len(weights)], scale, padded), (None if self.first else gradients[-1])

    def _flatten(self, gradients: Sequence, scale, padded: int):
        """The weights' ``gradients`` as one float32 vector in the weights' order, times ``scale``, zero-padded to
        ``padded`` values."""
        parts = [tf.reshape(tf.cast(g, tf.float32), [-1]) for g in gradients]
        length = sum(int(np.prod(shape)) for shape in self.shapes)
        return tf.concat([*parts, tf.zeros([padded - length], tf.float32)], 0) * tf.cast(scale, tf.float32)
