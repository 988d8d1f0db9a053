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
model's is touched), and keeps the update op by op, with a warning, where that fails. The verdict is
kept for the process's later fits of the same optimizer (class and config) on variables of the same
ranks and dtypes: a Python worker that Spark reuses pays the trial (0.4-0.6 s) once. The 64 verdicts
used last are kept.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sparkdl import _compat

logger = logging.getLogger(__name__)

#: Trainable parameters from which the update is compiled (4 MB of float32 weights).
MIN_PARAMETERS = 1 << 20

#: What the trial compile found, by what it depends on (see _trial_key), the most recently used last.
_verdicts: collections.OrderedDict[tuple, bool] = collections.OrderedDict()
_KEPT_VERDICTS = 64  # a tuning run tries many learning rates: each is an entry, the oldest dropped first


def pays(optimizer, variables: Sequence) -> bool:
    """Whether ``optimizer``'s update of ``variables`` should run compiled: large enough, and XLA compiles it."""
    if _compat.keras_major() < 3 or sum(int(np.prod(v.shape)) for v in variables) < MIN_PARAMETERS:
        return False
    config = optimizer.get_config()
    key = _trial_key(optimizer, config, variables)
    if key in _verdicts:
        _verdicts.move_to_end(key)
    else:
        _verdicts[key] = _compiles(optimizer, config, variables)
        if len(_verdicts) > _KEPT_VERDICTS:
            _verdicts.popitem(last=False)
    return _verdicts[key]


def _compiles(optimizer, config: dict, variables: Sequence) -> bool:
    try:
        _compile_on_stand_ins(optimizer, config, variables)
    except Exception as exc:  # any failure of the trial keeps the update as Keras runs it
        logger.warning(
            "sparkdl: XLA cannot compile the update of %s (%s); it runs op by op",
            type(optimizer).__name__,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return False
    return True


def _trial_key(optimizer, config: dict, variables: Sequence) -> tuple:
    """What the trial's outcome depends on: the optimizer's class (the class itself, so that one redefined under
    the same name is tried anew) and configuration but its name (Keras numbers each new optimizer's), and the
    variables' ranks and dtypes (not their sizes: the stand-ins have one element each)."""
    unnamed = {key: value for key, value in config.items() if key != "name"}
    ranks_and_dtypes = tuple((len(v.shape), str(v.dtype)) for v in variables)
    return (_optimizer_class(optimizer), json.dumps(unnamed, sort_keys=True, default=repr), ranks_and_dtypes)


def _optimizer_class(optimizer) -> Any:
    return getattr(type(optimizer), "hooked_from", type(optimizer))


def compiled(fn: Callable) -> Callable:
    """``fn`` as an XLA-compiled TensorFlow function of its own (an update must take the variables it updates
    from its closure: Keras's variables cannot be a TensorFlow function's arguments). TensorFlow counts the
    traces of every function made from the same code together, and warns of retracing after five (five fits
    in one Python worker would); a ``functools.partial`` has no code of its own, so it counts alone."""
    import tensorflow as tf

    return tf.function(functools.partial(fn), jit_compile=True)


def _compile_on_stand_ins(optimizer, config: dict, variables: Sequence) -> None:
    import keras
    import tensorflow as tf

    with tf.init_scope():  # eager, even when called while a function is traced
        stand_ins = [
            keras.Variable(np.zeros([1] * len(v.shape)), dtype=v.dtype, name=v.name.split("/")[-1]) for v in variables
        ]
        trial = _optimizer_class(optimizer).from_config(config)
        trial.build(stand_ins)
        compiled(lambda grads: trial.apply(grads, stand_ins))([tf.zeros_like(v) for v in stand_ins])
