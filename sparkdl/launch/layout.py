"""Which tasks a stage runs and which rows each reads: a mode's task layout, and the partitions that deliver it.

A data-parallel mode runs one worker per shard of the rows (``TaskLayout.data_parallel``): the rows are
repartitioned round-robin into exactly that many partitions. Other modes declare tasks that read
nothing (a server, a pipeline's middle stages) or share a shard (a pipeline's first and last stage read
the same rows): there the rows are cut into shards round-robin, each row is copied to every task reading
its shard, and each task's partition is sorted by the row's position, so that tasks of one shard see the
same rows in the same order.
"""

from __future__ import annotations

import dataclasses

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

_ROW, _KEY = "__sparkdl_row", "__sparkdl_task_key"


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a stage: what it does, and which shard of the rows it reads (None: no rows)."""

    role: str  # e.g. "worker", "stage 1", "server": for logs and errors
    shard: int | None


@dataclasses.dataclass(frozen=True)
class TaskLayout:
    """The tasks a mode runs: the slots a fit claims, each task's role, and which tasks read which rows.

    The rows are cut into ``shards`` shards of about equal size; the exact-epoch rule (every training
    row once per epoch) holds per shard; a task reading no shard gets an empty partition.
    """

    tasks: tuple[Task, ...]

    def __post_init__(self) -> None:
        read = sorted({task.shard for task in self.tasks if task.shard is not None})
        if not read or read != list(range(len(read))):
            raise ValueError(f"Expected tasks that read shards 0..k-1, each shard by some task. Received: {self}")

    @classmethod
    def data_parallel(cls, num_workers: int) -> TaskLayout:
        """``num_workers`` workers, each reading a shard of its own: every data-parallel mode's layout."""
        return cls(tuple(Task("worker", rank) for rank in range(num_workers)))

    @property
    def slots(self) -> int:
        return len(self.tasks)

    @property
    def shards(self) -> int:
        return 1 + max(task.shard for task in self.tasks if task.shard is not None)

    @property
    def is_data_parallel(self) -> bool:
        return self == TaskLayout.data_parallel(self.slots)

    def readers(self, shard: int) -> list[int]:
        """The tasks that read ``shard``."""
        return [index for index, task in enumerate(self.tasks) if task.shard == shard]


def task_input(frame: DataFrame, layout: TaskLayout) -> DataFrame:
    """``frame`` in exactly ``layout.slots`` partitions, partition ``t`` holding the rows task ``t`` reads."""
    if layout.is_data_parallel:
        return frame.repartition(layout.slots)
    keys = _partition_keys(frame, layout.slots)
    readers = F.array(
        *(F.array(*(F.lit(keys[t]).cast("long") for t in layout.readers(s))) for s in range(layout.shards))
    )
    copies = (
        frame.repartition(layout.shards)  # round-robin: shards of equal size, as the data-parallel layout cuts them
        .withColumn(_ROW, F.monotonically_increasing_id())
        .withColumn(_KEY, F.explode(F.element_at(readers, F.spark_partition_id() + 1)))
    )
    return copies.repartition(layout.slots, _KEY).sortWithinPartitions(_ROW).drop(_ROW, _KEY)


def _partition_keys(frame: DataFrame, slots: int) -> list[int]:
    """For each partition ``t`` of ``repartition(slots, key)`` over a bigint ``key``, a key that Spark's hash
    partitioning sends there (the keys must stay bigint: Spark hashes an int differently)."""
    spark = frame.sparkSession
    found = (
        spark.range(64 * slots)
        .groupBy(F.pmod(F.hash("id"), F.lit(slots)).alias("partition"))
        .agg(F.min("id").alias("key"))
        .collect()
    )
    keys = {row["partition"]: row["key"] for row in found}
    missing = [t for t in range(slots) if t not in keys]
    if missing:
        raise RuntimeError(f"No key among {64 * slots} hashes to partitions {missing} of {slots}")
    return [keys[t] for t in range(slots)]
