"""Held-out rows as a Keras ``Sequence``, so that validation reads them from disk a batch at a time.

Given arrays, ``fit(validation_data=...)`` and ``evaluate`` need every held-out row in memory at once, which
would make a worker's memory grow with its partition again. Given this ``Sequence``, Keras asks for one batch
at a time, read from the worker's spilled rows (``sparkdl.data.spill``). The batches are the ones Keras cuts
from arrays (consecutive rows, ``batch_size`` each, the last one shorter), so the metrics are the same.
"""

from __future__ import annotations

import numpy as np

from sparkdl.data.rows import Rows


def in_batches(rows: Rows, batch_size: int):
    """``rows`` in order, ``batch_size`` at a time, as a ``keras.utils.Sequence`` for ``validation_data``/``evaluate``."""
    import keras

    class HeldOutBatches(keras.utils.Sequence):
        def __len__(self) -> int:
            return -(-len(rows) // batch_size)

        def __getitem__(self, index: int) -> tuple:
            if not 0 <= index < len(self):
                raise IndexError(f"batch {index} of {len(self)}")
            start = index * batch_size
            return rows.take(np.arange(start, min(start + batch_size, len(rows))))

    return HeldOutBatches()
