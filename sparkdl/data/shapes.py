"""The one rule that fits a column's rows to a model input, in training and in ``transform``.

A column's rows are reshaped to the input's shape when they hold the same number of values:
flat rows (a number, a Vector, an array, a list of number columns) of exactly the input's size,
or nested arrays (or images) of the input's shape, where dimensions of size one may be left out
(``(8, 8)`` rows feed an ``(8, 8, 1)`` input). A free dimension (``None``) of the input takes its
size from the data. Values are never rounded: integers reach integer inputs as integers, and reach
float inputs only where the float type holds them exactly.
"""

from __future__ import annotations

import math

import numpy as np

from sparkdl.data.model_io import Port

# The largest integer up to which every integer is exact in each float type (2^(mantissa bits + 1)).
EXACT_INTEGERS = {"float16": 2**11, "bfloat16": 2**8, "float32": 2**24, "float64": 2**53}


def fit_shape(what: str, column_shape: tuple[int, ...], port: Port, *, nested: bool) -> tuple[int, ...]:
    """The shape each row of ``what`` (``column 'x' (`features_col`)``) takes as input ``port``; raises if none fits."""
    shape = _flat_fit(column_shape, port.shape) if not nested else _nested_fit(column_shape, port.shape)
    if shape is None:
        values = math.prod(column_shape)
        held = f"rows of shape {column_shape} ({values} values)" if nested else f"rows of {values} values"
        raise ValueError(
            f"{what} holds {held}; the model's input {port.describe()} takes {_takes(port.shape)}. "
            "Reshape the column, or give the model an input of the column's shape."
        )
    return shape


def check_range(what: str, low: int, high: int, port: Port) -> None:
    """Refuses integers that ``port``'s dtype cannot hold exactly."""
    if port.is_integer:
        info = np.iinfo(port.dtype)
        if low < info.min or high > info.max:
            raise ValueError(
                f"{what} holds integers from {low} to {high}, outside what the model's input {port.describe()} "
                f"holds ({info.min} to {info.max}). Declare the input with a wider integer dtype "
                "(keras.Input(..., dtype='int64'))."
            )
        return
    limit = EXACT_INTEGERS.get(port.dtype)
    if limit is not None and max(abs(low), abs(high)) > limit:
        raise ValueError(
            f"{what} holds integers up to {max(abs(low), abs(high))} in magnitude, but the model's input "
            f"{port.describe()} holds integers exactly only up to {limit} (2^{limit.bit_length() - 1}): they "
            "would be rounded. Declare the input as integers (keras.Input(..., dtype='int64')), e.g. for ids "
            "that go into an Embedding."
        )


def _takes(shape: tuple[int | None, ...]) -> str:
    known = math.prod(d for d in shape if d is not None)
    if None not in shape:
        return f"{known} values per row (flat), or nested arrays of shape {shape}"
    if shape.count(None) == 1:
        return f"a multiple of {known} values per row (flat), or nested arrays of shape {shape}"
    return f"nested arrays of shape {shape}"


def _flat_fit(column_shape: tuple[int, ...], shape: tuple[int | None, ...]) -> tuple[int, ...] | None:
    values = math.prod(column_shape)
    known = math.prod(d for d in shape if d is not None)
    free = shape.count(None)
    if free == 0:
        return tuple(d for d in shape if d is not None) if values == known else None
    if free == 1 and known and values % known == 0:
        return tuple(values // known if d is None else d for d in shape)
    if free > 1 and len(column_shape) == 1:
        return None
    return _nested_fit(column_shape, shape) if free > 1 else None


def _nested_fit(column_shape: tuple[int, ...], shape: tuple[int | None, ...]) -> tuple[int, ...] | None:
    given = [d for d in column_shape if d != 1]
    wanted = [d for d in shape if d != 1]
    if len(given) != len(wanted) or any(w is not None and w != g for g, w in zip(given, wanted)):
        return None
    sizes = iter(given)
    return tuple(next(sizes) if d != 1 else 1 for d in shape)
