"""The one place where the two supported stacks differ.

Default stack: Keras 3 on PySpark 4.1+. Horovod stack (conf/horovod/): tf.keras 2.12
on PySpark 3.5, the newest Horovod 0.28.1 builds against. Everything else in sparkdl
is written once for both.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pyarrow as pa


def collect_arrow(frame) -> pa.Table:
    """``frame.toArrow()`` (PySpark 4); PySpark 3.5 has only the private batch collector."""
    if hasattr(frame, "toArrow"):
        return frame.toArrow()
    from pyspark.sql.pandas.types import to_arrow_schema

    batches = frame._collect_as_arrow()
    return pa.Table.from_batches(batches) if batches else to_arrow_schema(frame.schema).empty_table()


def keras_major() -> int:
    import keras

    return int(keras.__version__.split(".")[0])


def hooked_optimizer_class(original: type[Any], intercept) -> type:
    """A subclass of the optimizer class ``original`` whose gradient application calls ``intercept``.

    ``intercept(apply, grads, variables)`` gets the original application as
    ``apply(grads, variables)``. Keras 3 applies through ``apply(grads, variables)``;
    Keras 2.12's optimizer through ``apply_gradients(grads_and_vars)``. The class
    remembers ``original`` as ``hooked_from``.
    """
    if keras_major() >= 3:

        def apply(self, grads, trainable_variables=None):
            return intercept(functools.partial(original.apply, self), list(grads), trainable_variables)

        return type(original.__name__, (original,), {"apply": apply, "hooked_from": original})

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads, variables = zip(*list(grads_and_vars))

        def apply_original(new_grads, new_variables):
            return original.apply_gradients(self, zip(new_grads, new_variables), *args, **kwargs)

        return intercept(apply_original, list(grads), list(variables))

    return type(original.__name__, (original,), {"apply_gradients": apply_gradients, "hooked_from": original})


def numpy_dtype(dtype) -> np.dtype:
    """A variable's dtype as numpy's: Keras 3 gives a name ("float32"), tf.keras 2 a ``tf.DType``."""
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))


def is_compiled(model) -> bool:
    return bool(model.compiled if keras_major() >= 3 else getattr(model, "_is_compiled", False))


def build_optimizer(optimizer, variables) -> None:
    """Creates the optimizer's slot variables now, if it has not yet.

    Keras 2.12 marks a built optimizer with ``_built`` rather than ``built``.
    """
    if not (optimizer.built if keras_major() >= 3 else getattr(optimizer, "_built", False)):
        optimizer.build(variables)


def optimizer_variables(optimizer) -> list:
    """Keras 3: a property; Keras 2.12: a method."""
    return list(optimizer.variables if keras_major() >= 3 else optimizer.variables())


def save_model(model, path: str) -> None:
    """Writes the ``.keras`` archive. Keras 2.12 writes HDF5 unless asked for its v3 format, and HDF5
    loses string metrics such as ``"accuracy"`` (they come back as exact-match accuracy)."""
    if keras_major() >= 3:
        model.save(path)
    else:
        model.save(path, save_format="keras_v3")


def check_model_supported(model) -> None:
    """Keras 2's legacy optimizers cannot be written in the ``.keras`` format sparkdl ships models in."""
    if keras_major() < 3 and not hasattr(model.optimizer, "build"):
        raise ValueError(
            f"Expected a tf.keras.optimizers optimizer on Keras {__import__('keras').__version__}. Received: "
            f"{type(model.optimizer).__module__}.{type(model.optimizer).__name__} (a legacy optimizer, which the "
            ".keras format cannot save). Compile with e.g. tf.keras.optimizers.Adam()."
        )
