"""What each worker of a fit sees: its partition's rows in order, and the batches it trains on."""

import numpy as np
import pyarrow as pa

from sparkdl import data
from sparkdl._compat import collect_arrow


def partitions_as_fit_sees_them(training, num_workers):
    """Each barrier task's training rows ``(x, y)`` in order, read back through the same repartition that fit uses."""
    columns = [field.column for field in training.fields.all]

    def tag(batches):
        from pyspark import TaskContext

        for batch in batches:
            n = batch.num_rows
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array([TaskContext.get().partitionId()] * n, pa.int32()),
                    pa.array(range(n), pa.int32()),
                    *(batch.column(c) for c in columns),
                ],
                names=["part", "pos", *columns],
            )

    frame = training.frame.select(*columns)
    schema = ", ".join(["part int", "pos int"] + [f"{f.name} {f.dataType.simpleString()}" for f in frame.schema.fields])
    table = collect_arrow(frame.repartition(num_workers).mapInArrow(tag, schema)).sort_by(
        [("part", "ascending"), ("pos", "ascending")]
    )
    parts = []
    for rank in range(num_workers):
        rows = table.filter(pa.compute.equal(table.column("part"), rank))
        train, _ = data.read_partition(training.fields, rows.to_batches())
        parts.append(train.take(np.arange(len(train))))
    return parts


def training_stream(parts, *, steps, epochs, seed):
    """The rows of every step of every epoch, the workers' batches side by side: what one process
    training on each global step's rows in one batch must see to match the workers.

    Written from the rule, not with the library's schedule: each worker permutes its n rows per epoch
    (``numpy.random.default_rng([seed, rank, epoch])``) and step s takes positions [s*n//steps, (s+1)*n//steps).
    Returns ``(x, y, sizes)``: the rows in order and the size of each global step's batch.
    """
    xs, ys, sizes = [], [], []
    for epoch in range(epochs):
        orders = [np.random.default_rng([seed, r, epoch]).permutation(len(px)) for r, (px, *_) in enumerate(parts)]
        for step in range(steps):
            size = 0
            for (px, py, *_), order in zip(parts, orders):
                n = len(px)
                index = order[step * n // steps : (step + 1) * n // steps]
                xs.append(px[index])
                ys.append(py[index])
                size += len(index)
            sizes.append(size)
    return np.concatenate(xs), np.concatenate(ys), sizes
