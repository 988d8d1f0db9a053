"""What a Keras model takes and gives: its inputs and outputs by name, each with its shape and dtype.

Works on the driver (to check the user's columns against the model before any job) and nowhere
else; the workers receive the resolved :class:`~sparkdl.data.fields.Fields` instead.
"""

from __future__ import annotations

import dataclasses
import math

STRING = "string"  # Keras's (and TensorFlow's) name of the string dtype, which numpy lacks


@dataclasses.dataclass(frozen=True)
class Port:
    """One input or output of the model: its name, one row's shape (``None`` for a free dimension) and dtype."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str  # numpy's name: "float32", "int64", ...; "string" for a string input (keras.Input(dtype="string"))

    @property
    def is_integer(self) -> bool:
        return not self.is_text and _kind(self.dtype) in "iub"

    @property
    def is_text(self) -> bool:
        return self.dtype == STRING

    def describe(self) -> str:
        return f"{self.name!r} (shape {(None, *self.shape)}, dtype {self.dtype})"


def inputs(model) -> list[Port]:
    """The model's inputs, named as Keras matches a dict of arrays to them: the keys of a model built on a
    dict of inputs, else the names given to ``keras.Input``."""
    tensors = _tensors(model, "inputs")
    structure = getattr(model, "_inputs_struct", None)
    if isinstance(structure, dict):
        return [Port(str(key), _shape(t), _dtype(t)) for key, t in structure.items()]
    return [Port(_producer(t), _shape(t), _dtype(t)) for t in tensors]


def outputs(model) -> list[Port]:
    """The model's outputs, named as Keras names them in loss and metric dicts (``model.output_names``)."""
    tensors = _tensors(model, "outputs")
    names = getattr(model, "output_names", None) or [_producer(t) for t in tensors]
    return [Port(name, _shape(t), _dtype(t)) for name, t in zip(names, tensors)]


def width(shape: tuple[int | None, ...]) -> int:
    """Values per row of a fully known shape."""
    return math.prod(d for d in shape if d is not None)


def _tensors(model, which: str) -> list:
    try:
        tensors = getattr(model, which)
    except (AttributeError, ValueError) as e:
        raise ValueError(
            "sparkdl needs a model with known inputs and outputs (a Sequential model starting with keras.Input, "
            f"or a functional model). Received: {type(model).__name__} ({e})"
        ) from None
    if not tensors:
        raise ValueError(f"sparkdl needs a built model with known {which}. Received: {type(model).__name__}")
    return list(tensors)


def _producer(tensor) -> str:
    history = getattr(tensor, "_keras_history", None)
    return str(getattr(getattr(history, "operation", None), "name", tensor.name))


def _shape(tensor) -> tuple[int | None, ...]:
    return tuple(None if d is None else int(d) for d in tensor.shape[1:])


def _dtype(tensor) -> str:
    import numpy as np

    dtype = tensor.dtype
    name = getattr(dtype, "name", dtype)
    return name if name in ("bfloat16", STRING) else np.dtype(name).name


def _kind(dtype: str) -> str:
    import numpy as np

    return "f" if dtype == "bfloat16" else np.dtype(dtype).kind
