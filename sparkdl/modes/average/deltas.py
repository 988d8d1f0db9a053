"""How each average-mode round's deltas and counters get from the tasks to the driver.

On a classic session they go into Spark accumulators over lists of numpy arrays
(``ArrayListParam``), as the design card has it: no result rows through the
driver, no sockets of ours. Spark Connect has no accumulators, so there each
task returns them as binary result rows of the round's own job (an ``.npz``
archive, written and read with ``allow_pickle=False``, in chunks well below the
Connect client's 128 MB message limit). Either way only successful task attempts
count: Spark merges the accumulator updates of failed attempts for none of
Python's accumulators, and a job's result holds each partition's rows once.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
from pyspark.accumulators import AccumulatorParam
from pyspark.sql import SparkSession

from sparkdl.launch import session

ROW_FIELDS = [("chunk", pa.int32()), ("payload", pa.binary())]  # the columns result rows add to a round's rows
_CHUNK_BYTES = 16 << 20


class ArrayListParam(AccumulatorParam):
    """Elementwise sum of equally long lists of numpy arrays; ``[]`` is the zero.

    A task's single ``add`` keeps its arrays' own dtype (float32 deltas travel at
    4 bytes a value); sums on the driver widen to float64 / int64.
    """

    def zero(self, value):
        return []

    def addInPlace(self, value1, value2):
        if len(value1) == 0:
            return value2
        if len(value2) == 0:
            return value1
        if len(value1) != len(value2):
            raise ValueError(f"Cannot add lists of {len(value1)} and {len(value2)} arrays.")
        total = []
        for a, b in zip(value1, value2):
            wide = np.float64 if np.issubdtype(a.dtype, np.floating) else np.int64
            if a.dtype == wide:
                a += b
            else:
                a = a.astype(wide) + b
            total.append(a)
        return total


class Sender:
    """Task side (travels in the round's closure): hands a task's delta and counter matrix to the driver."""

    def __init__(self, deltas, counters):
        self._deltas = deltas
        self._counters = counters

    def send(self, delta: list[np.ndarray], counts: np.ndarray) -> list[tuple[int, bytes]]:
        """Returns the ``(chunk, payload)`` result rows to emit (none when accumulators carry them)."""
        if self._deltas is not None:
            self._deltas.add(delta)
            self._counters.add([counts])
            return []
        buffer = io.BytesIO()
        np.savez(buffer, counts, *delta)
        data = buffer.getvalue()
        return [
            (index, data[start : start + _CHUNK_BYTES]) for index, start in enumerate(range(0, len(data), _CHUNK_BYTES))
        ]


class RoundDeltas:
    """Driver side of one round: where its tasks' deltas and counters go, and their sums after the job."""

    def __init__(self, spark: SparkSession):
        self._deltas = self._counters = None
        if not session.is_connect(spark):
            self._deltas = spark.sparkContext.accumulator([], ArrayListParam())
            self._counters = spark.sparkContext.accumulator([], ArrayListParam())

    def sender(self) -> Sender:
        return Sender(self._deltas, self._counters)

    def sums(self, table: pa.Table) -> tuple[list, list]:
        """``(delta sums, [counter matrix sum])`` as the accumulators hold them, from them or from ``table``'s rows."""
        if self._deltas is not None and self._counters is not None:
            return self._deltas.value, self._counters.value
        rows = table.filter(table.column("payload").is_valid()).sort_by(
            [("partition", "ascending"), ("chunk", "ascending")]
        )
        chunks: dict[int, list[bytes]] = {}
        for partition, payload in zip(rows.column("partition").to_pylist(), rows.column("payload").to_pylist()):
            chunks.setdefault(partition, []).append(payload)
        adder = ArrayListParam()
        deltas: list = []
        counters: list = []
        for parts in chunks.values():
            with np.load(io.BytesIO(b"".join(parts)), allow_pickle=False) as archive:
                arrays = [archive[f"arr_{i}"] for i in range(len(archive.files))]
            counters = adder.addInPlace(counters, arrays[:1])
            deltas = adder.addInPlace(deltas, arrays[1:])
        return deltas, counters
