"""Gradients on the wire at half the bytes (bfloat16 or float16), with float32 arithmetic on both ends.

As Horovod's ``Compression.fp16`` and PyTorch DDP's bf16 compression hook: the sender narrows its
float32 gradient once, the wire (a collective, a parameter-server push) carries the half-width
values, and the receiver widens them into float32 before it adds, averages or applies them. A
value too large for float16 (above 65504) is refused with an error rather than sent as infinity;
bfloat16 has float32's range and never overflows.

    >>> wire = narrow(np.array([1.0, 2.5], np.float32), "bf16")
    >>> widen(wire).dtype
    dtype('float32')
"""

from __future__ import annotations

import numpy as np

#: The names ``compression=`` takes, by the dtype each sends.
NAMES = ("bf16", "fp16")
_FLOAT16_MAX = float(np.finfo(np.float16).max)


def check(compression) -> str | None:
    """``compression`` if it is ``None`` or one of :data:`NAMES`; a ValueError naming the setting otherwise."""
    if compression is None or compression in NAMES:
        return compression
    raise ValueError(
        f"Expected `compression` to be None (float32 gradients), 'bf16' or 'fp16'. Received: compression={compression!r}"
    )


def wire_dtype(compression: str) -> np.dtype:
    """The dtype gradients travel as under ``compression``."""
    if compression == "bf16":
        import ml_dtypes  # a dependency of TensorFlow, so present wherever Keras trains

        return np.dtype(ml_dtypes.bfloat16)
    if compression == "fp16":
        return np.dtype(np.float16)
    check(compression)
    raise ValueError(f"Expected a compression, not None. Received: {compression!r}")


def narrow(gradient: np.ndarray, compression: str) -> np.ndarray:
    """``gradient`` (float32) as :func:`wire_dtype`; float16 refuses a value beyond its range."""
    if compression == "fp16":
        check_fits_float16(gradient)
    return np.asarray(gradient).astype(wire_dtype(compression))


def check_fits_float16(values: np.ndarray) -> None:
    """Raises when ``values`` hold a finite value float16 would carry as infinity."""
    largest = float(np.max(np.abs(values), initial=0.0))
    if np.isfinite(largest) and largest > _FLOAT16_MAX:
        raise ValueError(
            f"Expected gradients within float16's range (|g| <= {_FLOAT16_MAX:g}) with compression='fp16'. "
            f"Received: a gradient of magnitude {largest:.4g}. Use compression='bf16' (float32's range) or none."
        )


def widen(wire: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Half-width values back as float32 (into ``out`` when given)."""
    if out is None:
        return np.asarray(wire).astype(np.float32)
    out[...] = wire
    return out
