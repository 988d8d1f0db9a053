"""Numpy buffers that TensorFlow takes over in place: aligned as it needs, reused only once it has let go, counted
while anything holds them.

TensorFlow reads a numpy array that a ``tf.numpy_function`` returns in place when its first byte is
:data:`ALIGNMENT`-aligned, and may go on to adopt that memory as a variable's (an assign forwards its
input's buffer); otherwise it copies it. ``tf.convert_to_tensor`` always copies (TensorFlow 2.21: 1.6 ms
for 25 MB, aligned or not); :func:`tensor_of` reads an aligned array in place, through DLPack. An adopted buffer
holds a reference to its array for as long as TensorFlow uses it, so a :class:`BufferPool` hands
out only buffers that nothing but the pool references: a buffer is never written while a variable
may still be made of it.
"""

from __future__ import annotations

import sys
import threading
import weakref

import numpy as np

#: TensorFlow's buffer alignment (Eigen's widest vectors): it reads a numpy buffer in place only when aligned so.
ALIGNMENT = 64


def aligned_empty(size: int, dtype) -> np.ndarray:
    """An uninitialised 1-D array of ``size`` values whose first byte is :data:`ALIGNMENT`-aligned."""
    dtype = np.dtype(dtype)
    raw = np.empty(size * dtype.itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + size * dtype.itemsize].view(dtype)


def tensor_of(array: np.ndarray):
    """A TensorFlow tensor of ``array``: the array's own memory where it is :func:`is_aligned` (DLPack; the tensor
    holds a reference to the array while it lives), a copy otherwise."""
    import tensorflow as tf

    if is_aligned(array):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


def array_of(tensor) -> np.ndarray:
    """A numpy view of a TensorFlow ``tensor``'s memory, through DLPack (``.numpy()`` copies it); the view holds the
    tensor's buffer while it lives. TensorFlow writes a variable read so into a buffer of its own from then on."""
    return np.from_dlpack(tensor)


def is_aligned(array: np.ndarray) -> bool:
    """Whether TensorFlow may read ``array`` in place: C-contiguous and :data:`ALIGNMENT`-aligned."""
    return array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0


class BufferPool:
    """Aligned buffers of ``size`` values of ``dtype``; :meth:`take` gives one that only the pool references."""

    def __init__(self, size: int, dtype, *, keep: int = 3):
        self.size, self.dtype, self._keep = size, np.dtype(dtype), keep
        self._buffers: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        """A kept buffer no one else references (``sys.getrefcount``: the list's reference and the call's own),
        else a fresh one, kept while fewer than ``keep`` are."""
        for i in range(len(self._buffers)):
            if sys.getrefcount(self._buffers[i]) <= 2:
                return self._buffers[i]
        buffer = aligned_empty(self.size, self.dtype)
        if len(self._buffers) < self._keep:
            self._buffers.append(buffer)
        return buffer


class HeldBytes:
    """Buffers made by :meth:`empty`, and whatever :meth:`track` is given (a tensor made from one), counted from then
    until their last reference goes, TensorFlow's too (a tensor read in place keeps its array): :attr:`held`, the
    bytes alive now, and :attr:`peak`, the most at once."""

    def __init__(self):
        self.held = self.peak = 0
        self._lock = threading.Lock()  # the last reference may go in any thread

    def empty(self, size: int, dtype) -> np.ndarray:
        """An :func:`aligned_empty` buffer, counted while the array that owns its memory (every view keeps it) lives."""
        buffer = aligned_empty(size, dtype)
        self.track(buffer.base, buffer.nbytes)
        return buffer

    def track(self, holder, nbytes: int) -> None:
        """Counts ``nbytes`` while ``holder`` (an object that can be weakly referenced) lives."""
        with self._lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        weakref.finalize(holder, self._let_go, nbytes)

    def _let_go(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
