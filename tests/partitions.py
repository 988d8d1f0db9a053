"""What each worker of a fit sees: its partition's rows and their keys, and the batches it trains on."""

import numpy as np
import pyarrow as pa

from sparkdl import data
from sparkdl._compat import collect_arrow
from sparkdl.data.rules import CHECKS
from sparkdl.launch.layout import TaskLayout, task_input


class Part(tuple):
    """A worker's training rows as ``(x, y)`` or ``(x, y, sample_weight)``, in the order it holds them, and
    ``keys``: each row's key (``sparkdl.data.ROW_KEY``)."""

    keys: np.ndarray


def partitions_as_fit_sees_them(training, num_workers):
    """Each barrier task's training rows (not its held-out ones), read back through the same dealing that fit uses
    (``Part``s)."""
    columns = [field.column for field in training.checked.fields.all]
    columns += [name for name in (CHECKS, data.VALIDATION) if name in training.frame.columns]

    def tag(batches):
        from pyspark import TaskContext

        for batch in batches:
            yield batch.append_column("part", pa.array([TaskContext.get().partitionId()] * batch.num_rows, pa.int32()))

    frame = task_input(training.frame.select(*columns), TaskLayout.data_parallel(num_workers))
    schema = ", ".join([f"{f.name} {f.dataType.simpleString()}" for f in frame.schema.fields] + ["part int"])
    table = collect_arrow(frame.mapInArrow(tag, schema))
    parts = []
    for rank in range(num_workers):
        rows = table.filter(pa.compute.equal(table.column("part"), rank)).drop_columns(["part"])
        train, _ = data.read_partition(training.rules, rows.to_batches()).rows(training.checked.fields)
        part = Part(train.take(np.arange(len(train))))
        part.keys = train.keys
        parts.append(part)
    return parts


def epoch_order(keys, *, seed, epoch):
    """The rule, written out: an epoch trains a worker's rows sorted by SplitMix64's finalizer of ``key + salt``,
    ``salt`` that finalizer of ``seed ^ finalizer(epoch)`` (all modulo 2**64)."""

    def mix(z):
        z = (z + 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)

    salt = mix(seed ^ mix(epoch))
    values = [mix((int(key) + salt) % 2**64) for key in keys]
    return np.array(sorted(range(len(keys)), key=values.__getitem__), np.int64)


def training_stream(parts, *, steps, epochs, seed):
    """The rows of every step of every epoch, the workers' batches side by side: what one process
    training on each global step's rows in one batch must see to match the workers.

    Written from the rule, not with the library's schedule: each worker orders its n rows per epoch
    (:func:`epoch_order`) and step s takes positions [s*n//steps, (s+1)*n//steps).
    Returns ``(x, y, sizes)``: the rows in order and the size of each global step's batch.
    """
    xs, ys, sizes = [], [], []
    for epoch in range(epochs):
        orders = [epoch_order(part.keys, seed=seed, epoch=epoch) for part in parts]
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
