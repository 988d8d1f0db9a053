"""One Arrow batch of a column to the array a model input takes, checked row by row (``transform``'s side).

Training checks every row once, as the training tasks read it, before their first step; ``transform`` is a
lazy transformation that starts no job of its own, so its tasks check each batch as they read it,
by the same rule (``sparkdl.data.shapes``): nulls, non-finite floats, ragged or mismatched
shapes and integers a float input would round fail the task with a message naming the column.
Strings reach a string input as ``bytes`` objects holding exactly Spark's UTF-8.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from sparkdl.data import shapes
from sparkdl.data.columns import IMAGE_MODES
from sparkdl.data.fields import image_bytes
from sparkdl.data.model_io import Port


@dataclasses.dataclass(frozen=True)
class InputColumn:
    """A model input and the column (or columns, in order) that feed it."""

    port: Port
    names: tuple[str, ...]
    setting: str  # features_col, features_col['ids'], ...
    image: bool = False

    @property
    def what(self) -> str:
        names = self.names[0] if len(self.names) == 1 else list(self.names)
        return f"Column {names!r} (`{self.setting}`)"

    def _at(self, position: int) -> str:
        """The column holding flat value ``position``: for a list of number columns, the one at that place."""
        if len(self.names) == 1:
            return self.what
        return f"Column {self.names[position % len(self.names)]!r} (`{self.setting}`)"

    def to_numpy(self, column: pa.Array) -> np.ndarray:
        """The batch as an array of shape ``(rows, *input shape)`` in the input's dtype; raises on bad rows."""
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if column.null_count:
            raise ValueError(
                f"{self.what} has null rows: expected a value in every row (found {column.null_count} in a batch "
                f"of {len(column)} rows). Drop or impute them first (e.g. df.dropna(subset=[...]))."
            )
        rows = len(column)
        shape, values = self._image(column) if self.image else self._nested(column)
        shape = shapes.fit_shape(self.what, shape, self.port, nested=len(shape) > 1) if rows else shape
        if self.port.is_text:  # bytes objects, exactly Spark's UTF-8 (plan refused other columns for this input)
            return values.reshape((rows, *shape))
        dtype = np.dtype("float32") if self.port.dtype == "bfloat16" else np.dtype(self.port.dtype)
        if values.dtype.kind in "iu" and rows:
            shapes.check_range(self.what, int(values.min()), int(values.max()), self.port)
        if values.dtype.kind == "f" and not (finite := np.isfinite(values)).all():
            raise ValueError(
                f"{self._at(int(np.argmin(finite)))} has rows containing NaN or infinite values (after conversion "
                f"to {values.dtype}): expected finite numbers."
            )
        return values.astype(dtype, copy=False).reshape((rows, *shape))

    def _nested(self, column: pa.Array) -> tuple[tuple[int, ...], np.ndarray]:
        shape: list[int] = []
        level = 1
        while pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            widths = np.diff(column.offsets.to_numpy())
            if len(widths) and widths.min() != widths.max():
                where = "" if level == 1 else f" at nesting level {level}"
                raise ValueError(
                    f"{self.what} is ragged{where}: rows have between {widths.min()} and {widths.max()} values; "
                    "expected the same number of values in every row."
                )
            shape.append(int(widths[0]) if len(widths) else 0)
            column = column.flatten()
            if column.null_count:
                first = int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
                raise ValueError(
                    f"{self._at(first)} has {'null rows' if len(self.names) > 1 else 'rows containing null values'}: "
                    "expected numbers only. Drop or impute them first (e.g. df.dropna(subset=[...]))."
                )
            level += 1
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            # as bytes (a cast that copies nothing): Spark's strings reach the model byte for byte, never decoded
            column = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
        values = column.to_numpy(zero_copy_only=False)
        return tuple(shape), values

    def _image(self, column: pa.StructArray) -> tuple[tuple[int, ...], np.ndarray]:
        fields = {
            name: column.field(name).to_numpy(zero_copy_only=False) for name in ("height", "width", "nChannels", "mode")
        }
        if not np.isin(fields["mode"], list(IMAGE_MODES)).all():
            raise ValueError(f"{self.what} holds images that are not 8-bit gray, BGR or BGRA: expected 8-bit images.")
        shape = []
        for name in ("height", "width", "nChannels"):
            if len(fields[name]) and fields[name].min() != fields[name].max():
                raise ValueError(f"{self.what} holds images of different {name}s: expected one size for every image.")
            shape.append(int(fields[name][0]) if len(fields[name]) else 0)
        return tuple(shape), image_bytes(column.field("data"))
