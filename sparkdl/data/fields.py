"""The resolved columns a worker reads: for every model input, target and the sample weight, its shape and dtype.

The driver resolves them once (``sparkdl.data.plan``) and ships a :class:`Layout` (small and
picklable). On the workers, ``Layout.arrays`` turns one Arrow record batch into numpy arrays of
exactly those shapes and dtypes, without Python objects per row.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa

INPUT, TARGET, WEIGHT = "input", "target", "weight"


@dataclasses.dataclass(frozen=True)
class Field:
    """One array Keras receives: a model input, a target (label) or the sample weights."""

    role: str  # INPUT, TARGET or WEIGHT
    key: str  # the model input's or output's name (Keras matches dicts by it)
    column: str  # its column in the prepared frame: a flat list of values per row, or an image's bytes
    sources: tuple[str, ...]  # the user's columns it is read from, for messages
    shape: tuple[int, ...]  # one row's shape
    dtype: str  # what Keras receives: the input's dtype; int64 or float32 for targets; float32 for weights
    image: bool = False  # the column holds an image's raw bytes (uint8, ``shape`` is (height, width, channels))

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype of its arrays (bfloat16, which numpy lacks, travels as float32: Keras casts it)."""
        return np.dtype("float32") if self.dtype == "bfloat16" else np.dtype(self.dtype)

    def describe(self) -> str:
        columns = self.sources[0] if len(self.sources) == 1 else list(self.sources)
        return f"column {columns!r}"

    def to_numpy(self, column: pa.Array) -> np.ndarray:
        """One record batch's values of this field, as an array of shape ``(rows, *shape)``."""
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        rows, width = len(column), math.prod(self.shape)
        values = image_bytes(column) if self.image else column.flatten().to_numpy(zero_copy_only=False)
        if values.size != rows * width:  # the driver's checks make this unreachable unless the data changed since
            raise ValueError(
                f"{self.describe()} has rows with a number of values other than {width}: expected one row shape "
                f"{self.shape} for every row (it was checked before training; did the data change?)."
            )
        return values.astype(self.numpy_dtype, copy=False).reshape((rows, *self.shape))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every field a fit reads, and how Keras receives them: one array, or a dict by input/output name."""

    inputs: tuple[Field, ...]
    targets: tuple[Field, ...]
    weight: Field | None = None
    named_inputs: bool = False  # a dict by input name (the model has several inputs)
    named_targets: bool = False  # a dict by output name (the model has several outputs)

    @property
    def fields(self) -> tuple[Field, ...]:
        return self.inputs + self.targets + ((self.weight,) if self.weight is not None else ())

    def arrays(self, batch: pa.RecordBatch) -> dict[str, np.ndarray]:
        """One record batch as arrays by frame column."""
        return {field.column: field.to_numpy(batch.column(field.column)) for field in self.fields}

    def keras_batch(self, arrays: dict[str, np.ndarray]) -> tuple:
        """``(x, y)``, or ``(x, y, sample_weight)`` with a weight column, as ``model.fit`` takes them."""
        x = _structure(self.inputs, arrays, self.named_inputs)
        y = _structure(self.targets, arrays, self.named_targets)
        if self.weight is None:
            return x, y
        return x, y, arrays[self.weight.column]


def _structure(fields: tuple[Field, ...], arrays: dict[str, np.ndarray], named: bool):
    if named:
        return {field.key: arrays[field.column] for field in fields}
    return arrays[fields[0].column]


def image_bytes(column: pa.Array) -> np.ndarray:
    """A binary column's bytes, all rows back to back, without a copy."""
    offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    offsets = np.frombuffer(column.buffers()[1], offset_type)[column.offset : column.offset + len(column) + 1]
    data = column.buffers()[2]
    if data is None or len(offsets) == 0:
        return np.empty(0, np.uint8)
    return np.frombuffer(data, np.uint8)[offsets[0] : offsets[-1]]
