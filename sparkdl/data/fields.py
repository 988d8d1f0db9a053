"""The resolved columns a worker reads: for every model input, target and the sample weight, its shape and dtype.

The driver resolves them once (``sparkdl.data.plan``) and ships a :class:`Fields` (small and
picklable). On the workers, ``Fields.arrays`` turns one Arrow record batch into numpy arrays of
exactly those shapes and dtypes, without Python objects per row (a string field's values stay
Arrow's bytes, ``sparkdl.data.texts``, until a batch is read back for Keras).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa

from sparkdl.data.model_io import STRING
from sparkdl.data.texts import TextValues, binary_parts

INPUT, TARGET, WEIGHT = "input", "target", "weight"


@dataclasses.dataclass(frozen=True)
class Field:
    """One array Keras receives: a model input, a target (label) or the sample weights."""

    role: str  # INPUT, TARGET or WEIGHT
    key: str  # the model input's or output's name (Keras matches dicts by it)
    column: str  # its column in the prepared frame: a flat list of values per row, or an image's bytes
    sources: tuple[str, ...]  # the user's columns it is read from, for messages
    shape: tuple[int, ...]  # one row's shape
    dtype: (
        str  # what Keras receives: the input's dtype ("string" too); int64 or float32 for targets; float32 for weights
    )
    image: bool = False  # the column holds an image's raw bytes (uint8, ``shape`` is (height, width, channels))

    @property
    def is_text(self) -> bool:
        return self.dtype == STRING

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype of its arrays (bfloat16, which numpy lacks, travels as float32: Keras casts it; strings are
        ``bytes`` objects)."""
        if self.is_text:
            return np.dtype(object)
        return np.dtype("float32") if self.dtype == "bfloat16" else np.dtype(self.dtype)

    def describe(self) -> str:
        columns = self.sources[0] if len(self.sources) == 1 else list(self.sources)
        return f"column {columns!r}"

    def values(self, column: pa.Array) -> np.ndarray | TextValues:
        """One record batch's values of this field: an array of shape ``(rows, *shape)``, or for a string field
        its :class:`~sparkdl.data.texts.TextValues` of that shape (Arrow's bytes, no Python object per value)."""
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        rows, width = len(column), math.prod(self.shape)
        if self.image:
            values = image_bytes(column)
        elif self.is_text:
            values = column.flatten()
        else:
            values = column.flatten().to_numpy(zero_copy_only=False)
        if len(values) != rows * width:  # the driver's checks make this unreachable unless the data changed since
            raise ValueError(
                f"{self.describe()} has rows with a number of values other than {width}: expected one row shape "
                f"{self.shape} for every row (it was checked before training; did the data change?)."
            )
        if self.is_text:
            return TextValues.from_arrow(values, (rows, *self.shape))
        return values.astype(self.numpy_dtype, copy=False).reshape((rows, *self.shape))


@dataclasses.dataclass(frozen=True)
class Fields:
    """Every field a fit reads, and how Keras receives them: one array, or a dict by input/output name."""

    inputs: tuple[Field, ...]
    targets: tuple[Field, ...]
    weight: Field | None = None
    named_inputs: bool = False  # a dict by input name (the model has several inputs)
    named_targets: bool = False  # a dict by output name (the model has several outputs)

    @property
    def all(self) -> tuple[Field, ...]:
        return self.inputs + self.targets + ((self.weight,) if self.weight is not None else ())

    def arrays(self, batch: pa.RecordBatch) -> dict[str, np.ndarray | TextValues]:
        """One record batch as arrays by frame column (string fields: their ``TextValues``)."""
        return {field.column: field.values(batch.column(field.column)) for field in self.all}

    def keras_batch(self, arrays: dict) -> tuple:
        """``(x, y)``, or ``(x, y, sample_weight)`` with a weight column, as ``model.fit`` takes them, from
        arrays (or tensors, in a ``tf.data`` pipeline) by field.

        A string field's array (``bytes`` objects) goes as a ``tf.string`` tensor: Keras's data adapters take no
        numpy object arrays.
        """
        x = _structure(self.inputs, arrays, self.named_inputs)
        y = _structure(self.targets, arrays, self.named_targets)
        if self.weight is None:
            return x, y
        return x, y, arrays[self.weight.column]


def _structure(fields: tuple[Field, ...], arrays: dict[str, np.ndarray], named: bool):
    values = [_for_keras(field, arrays[field.column]) for field in fields]
    if named:
        return {field.key: value for field, value in zip(fields, values)}
    return values[0]


def _for_keras(field: Field, array):
    if not field.is_text or not isinstance(array, np.ndarray):  # numbers, or a tensor already
        return array
    import tensorflow as tf

    return tf.constant(array, tf.string)


def image_bytes(column: pa.Array) -> np.ndarray:
    """A binary column's bytes, all rows back to back, without a copy."""
    return binary_parts(column)[1]
