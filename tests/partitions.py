"""What each worker of a fit sees: its partition's rows in order, and the batches it trains on."""

import numpy as np
import pyarrow as pa

from sparkdl import data, schedule
from sparkdl._compat import collect_arrow


def partitions_as_fit_sees_them(frame, num_workers, feature_width):
    """Each barrier task's rows in order, read back through the same repartition that fit uses."""

    def tag(batches):
        from pyspark import TaskContext

        for batch in batches:
            n = batch.num_rows
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array([TaskContext.get().partitionId()] * n, pa.int32()),
                    pa.array(range(n), pa.int32()),
                    batch.column(data.FEATURES),
                    batch.column(data.LABEL),
                ],
                names=["part", "pos", data.FEATURES, data.LABEL],
            )

    schema = f"part int, pos int, {data.FEATURES} array<float>, {data.LABEL} array<float>"
    table = collect_arrow(frame.repartition(num_workers).mapInArrow(tag, schema)).sort_by(
        [("part", "ascending"), ("pos", "ascending")]
    )
    parts = []
    for rank in range(num_workers):
        rows = table.filter(pa.compute.equal(table.column("part"), rank))
        x, y = data.arrow_to_numpy(rows.to_batches(), feature_width, 1)
        parts.append((x, y.reshape(-1)))
    return parts


def training_stream(parts, *, batch_size, steps, epochs, seed):
    """The rows of every step of every epoch, the workers' batches side by side: what one process
    training at the global batch size must see to match the workers."""
    xs, ys = [], []
    for epoch in range(epochs):
        orders = [
            schedule.epoch_order(len(px), steps * batch_size, seed=seed, rank=r, epoch=epoch, shuffle=True)
            for r, (px, _) in enumerate(parts)
        ]
        for step in range(steps):
            for (px, py), order in zip(parts, orders):
                index = order[step * batch_size : (step + 1) * batch_size]
                xs.append(px[index])
                ys.append(py[index])
    return np.concatenate(xs), np.concatenate(ys)
