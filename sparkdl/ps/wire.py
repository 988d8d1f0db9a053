"""What a push carries on the wire, and the buffers it lands in: so that a push costs no copy the server can avoid.

A push's payload is one shard's gradient as float32 or, with ``compression`` ("bf16" or "fp16"),
as the half-width dtype the worker narrowed it to once (``sparkdl.collective.compression``): half
the bytes. The server receives every push of a connection into the same buffer (a fresh 32 MB
array is a fresh mapping whose page faults cost as much as copying it), aligned so that
TensorFlow reads it in place (``sparkdl.keras.adopted``), checks it for NaN and infinity in its own
dtype (:func:`all_finite`), and the shard widens it to float32 as it applies it. Pulled weights
travel as float32 whatever ``compression`` says (docs/modes.md, "Compression", says why).
"""

from __future__ import annotations

import numpy as np

from sparkdl.collective import compression as compressions
from sparkdl.ps.protocol import FLOAT

# A half-width value is NaN or infinite exactly when its exponent bits are all ones: with the sign bit
# masked off (0x7FFF), its bits are then at least these.
_NON_FINITE_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80}


def push_dtype(compression: str | None) -> np.dtype:
    """The dtype a push carries: float32, or the half-width dtype of ``compression``."""
    return FLOAT if compression is None else compressions.wire_dtype(compression)


def all_finite(values: np.ndarray) -> bool:
    """Whether ``values`` (float32, float16 or bfloat16) hold no NaN or infinity, checked in their own dtype."""
    if values.dtype == FLOAT:
        return bool(np.isfinite(values).all())
    return int(np.max(_magnitude_bits(values), initial=0)) < _NON_FINITE_BITS[values.dtype.name]


def count_non_finite(values: np.ndarray) -> int:
    """How many of ``values`` are NaN or infinite (for the message refusing a push: not on the hot path)."""
    if values.dtype == FLOAT:
        return int(values.size - np.count_nonzero(np.isfinite(values)))
    return int(np.count_nonzero(_magnitude_bits(values) >= _NON_FINITE_BITS[values.dtype.name]))


def _magnitude_bits(values: np.ndarray) -> np.ndarray:
    """A half-width array's bits without the sign bit."""
    return np.bitwise_and(values.view(np.uint16), 0x7FFF)
