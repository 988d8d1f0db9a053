"""A loaded model's predict step, traced once per Python worker for batches of any number of rows.

``keras.Model.predict_on_batch`` goes through Keras's generic predict function (a distribution
strategy's ``run`` and the concatenation of its replicas' outputs) and TensorFlow's dispatch, which
binds and converts every argument again on each call; it traces the function for the first batch's
row count and again once a second count shows up. Profiled in a Spark worker (docs/performance.md),
that Python costs about as much as the model itself for the digits-sized MLP. ``BatchCall`` traces
the model's own ``predict_step`` (so a model that overrides it scores as ``predict_on_batch`` does)
with a free first dimension, once per input signature, and calls the concrete function directly.
A model compiled with ``run_eagerly=True`` keeps ``predict_on_batch``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparkdl.data.model_io import Port


class BatchCall:
    """``call(x)``: the model's outputs (a tensor, or a list or dict of them) for ``x``, one array or a dict by name."""

    def __init__(self, model):
        self.model = model
        self._functions: dict[tuple, Any] = {}  # input signature -> traced concrete function

    def __call__(self, x, ports: tuple[Port, ...]):
        if getattr(self.model, "run_eagerly", False):
            return self.model.predict_on_batch(x)
        import tensorflow as tf

        arrays = x if isinstance(x, dict) else {ports[0].name: x}
        specs = {port.name: _spec(arrays[port.name], port) for port in ports}
        key = tuple((name, tuple(spec.shape.as_list()), spec.dtype.name) for name, spec in specs.items())
        function = self._functions.get(key)
        if function is None:
            signature = specs if isinstance(x, dict) else specs[ports[0].name]
            function = tf.function(
                self._predict_step,
                input_signature=[signature],
                jit_compile=getattr(self.model, "jit_compile", False) is True,
            ).get_concrete_function()
            self._functions[key] = function
        return function(x)

    def _predict_step(self, x):
        return self.model.predict_step((x,))


def _spec(array: np.ndarray, port: Port):
    """The batch's TensorSpec: any number of rows, and a free dimension wherever the model's input has one."""
    import tensorflow as tf

    inner = array.shape[1:]
    if len(inner) == len(port.shape):
        inner = tuple(None if free is None else size for size, free in zip(inner, port.shape))
    dtype = tf.string if array.dtype.kind in "OSU" else tf.as_dtype(array.dtype)
    return tf.TensorSpec((None, *inner), dtype)
