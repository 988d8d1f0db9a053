"""Runs an optimizer's update as one XLA-compiled function where the model is large enough for it to pay.

On a machine without an accelerator Keras runs the optimizer op by op (its ``jit_compile="auto"``
turns XLA on only where it finds a GPU or TPU): Adam's update of an 8.4M-parameter model takes
65-80 ms of a core that way and 12-18 ms as one XLA function, which fuses the update's dozen
element-wise passes over the weights into one (docs/sync-step.md). Sync mode's train step cannot
be compiled whole (its allreduce is a ``tf.numpy_function``), but the update after the allreduce
can. For a small model the compile (0.3-0.5 s) is not won back: XLA saves a few microseconds a
step, so the update is compiled from :data:`MIN_PARAMETERS` up.

Keras's optimizers are written to compile (Keras compiles the whole train step on a GPU), but a
custom optimizer or schedule may use an op XLA lacks. :func:`pays` first compiles the same
optimizer's update on stand-in variables of one element each (so that no weight or slot of the
model's is touched), and keeps the update op by op, with a warning, where that fails.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np

from sparkdl import _compat

logger = logging.getLogger(__name__)

#: Trainable parameters from which the update is compiled (4 MB of float32 weights).
MIN_PARAMETERS = 1 << 20


def pays(optimizer, variables: Sequence) -> bool:
    """Whether ``optimizer``'s update of ``variables`` should run compiled: large enough, and XLA compiles it."""
    if _compat.keras_major() < 3 or sum(int(np.prod(v.shape)) for v in variables) < MIN_PARAMETERS:
        return False
    try:
        _compile_on_stand_ins(optimizer, variables)
    except Exception as exc:  # any failure of the trial keeps the update as Keras runs it
        logger.warning(
            "sparkdl: XLA cannot compile the update of %s (%s); it runs op by op",
            type(optimizer).__name__,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return False
    return True


def compiled(fn: Callable) -> Callable:
    """``fn`` as an XLA-compiled TensorFlow function of its own (an update must take the variables it updates
    from its closure: Keras's variables cannot be a TensorFlow function's arguments). TensorFlow counts the
    traces of every function made from the same code together, and warns of retracing after five (five fits
    in one Python worker would); a ``functools.partial`` has no code of its own, so it counts alone."""
    import tensorflow as tf

    return tf.function(functools.partial(fn), jit_compile=True)


def _compile_on_stand_ins(optimizer, variables: Sequence) -> None:
    import keras
    import tensorflow as tf

    with tf.init_scope():  # eager, even when called while a function is traced
        stand_ins = [
            keras.Variable(np.zeros([1] * len(v.shape)), dtype=v.dtype, name=v.name.split("/")[-1]) for v in variables
        ]
        trial = getattr(type(optimizer), "hooked_from", type(optimizer)).from_config(optimizer.get_config())
        trial.build(stand_ins)
        compiled(lambda grads: trial.apply(grads, stand_ins))([tf.zeros_like(v) for v in stand_ins])
