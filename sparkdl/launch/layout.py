"""Which tasks a stage runs and which rows each reads: a mode's task layout, and the partitions that deliver it.

Every row gets a key (``ROW_KEY``, Spark's ``monotonically_increasing_id`` of the input: its partition and its place
there) and is dealt to shard ``(place + partition) mod shards`` (``sparkdl.position.shard_of``). A data-parallel mode runs one worker per shard
(``TaskLayout.data_parallel``). Other modes declare tasks that read nothing (a server, a pipeline's middle stages) or
share a shard (a pipeline's first and last stage read the same rows): each row is copied to every task reading its
shard. The deal is round-robin within each input partition (shards within one row per input partition of each
other), and anyone who knows a row's key knows the shard it went to, on any number of shards: a fit resumed
mid-epoch on another number of workers finds which rows the epoch has trained from the keys alone
(``sparkdl.position``). The keys are the same on every run over the same input (a table, files), since Spark
numbers rows by their input partition.

Where every worker can read one input partition whole, known to hold as many rows as the others within
``BALANCE_TOLERANCE`` before the fit reads them, it does (``TaskLayout.by_partition``): no shuffle, and a row's shard is
its partition (``sparkdl.position.shard_of``). That is known of a persisted input of one partition a worker (its
training rows counted over the cached rows, :func:`training_rows_by_partition`), and of an unpersisted projection of
files, which is read as one partition of whole files a worker (``sparkdl.launch.whole_files``: their bytes, from the
file listing). Other inputs are shuffled: a partition's rows are otherwise known only from a pass over the source, one
worker's surplus of rows would hold up every lockstep step, and Spark's barrier stage reads one partition a task
(SPARK-24820), so a persisted input of more partitions than workers is shuffled too.

Where the whole files are Parquet and the workers read their columns as they are, a mode whose stage reads its rows
(``launch.run_tasks``) has its tasks read their files themselves (``TaskLayout.files``, ``sparkdl.launch.parquet_files``),
not through Spark's rows: the same rows under the same keys, several times faster.
"""

from __future__ import annotations

import dataclasses

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sparkdl.data import ROW_KEY, VALIDATION
from sparkdl.launch.parquet_files import ParquetFiles, plan_reads
from sparkdl.launch.whole_files import read_whole

_TASK_KEY = "__sparkdl_task_key"
# How much more than the smallest an input partition may hold, in training rows, to be read whole by one worker: in
# lockstep every step waits for the worker with the most rows.
BALANCE_TOLERANCE = 0.10


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
    by_partition: bool = False  # each task reads one input partition whole: no shuffle (a data-parallel layout's)
    files: ParquetFiles | None = None  # each task reads its partition's Parquet files itself, not Spark's rows

    def __post_init__(self) -> None:
        read = sorted({task.shard for task in self.tasks if task.shard is not None})
        if not read or read != list(range(len(read))):
            raise ValueError(f"Expected tasks that read shards 0..k-1, each shard by some task. Received: {self}")
        if self.by_partition and not self.is_data_parallel:
            raise ValueError(f"Expected a data-parallel layout to read whole input partitions. Received: {self}")
        if self.files is not None and not self.by_partition:
            raise ValueError(
                f"Expected tasks that read their own files to read whole input partitions. Received: {self}"
            )

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
        return self.tasks == TaskLayout.data_parallel(self.slots).tasks

    def dealt(
        self, df: DataFrame, frame: DataFrame, read_as: int | None = None, *, tasks_read_files: bool = False
    ) -> tuple[TaskLayout, DataFrame, str]:
        """This layout over ``frame``'s rows (a projection of the user's ``df``) read by whole input partitions where it
        can be (see the module), the rows it reads, and why they are, or are not, shuffled, for the fit's log.
        ``read_as``: the partitions of whole files the epoch a fit resumes in first read its files as (its keys).
        ``tasks_read_files``: the mode's tasks may read whole Parquet files themselves (``TaskLayout.files``)."""
        if not self.is_data_parallel:
            return self, frame, "shuffled: its tasks do not each read a shard of their own"
        if getattr(df, "_jdf", None) is None:
            return self, frame, "shuffled: the input's partitions are not known to a Spark Connect client"
        if _persisted(df):
            layout, why = self._by_cached_partition(frame)
            return layout, frame, why
        partitions = read_as or self.slots
        whole = read_whole(frame, partitions)
        not_whole = "shuffled: the input is not persisted and {}; persist it to deal it by partition"
        if isinstance(whole, str):
            return self, frame, not_whole.format(whole)
        low, high = min(whole.bytes_by_partition) / 1e6, max(whole.bytes_by_partition) / 1e6
        within = f"{low:.3g} to {high:.3g} MB"
        if not _balanced(whole.bytes_by_partition):
            return self, frame, not_whole.format(f"its files pack into {partitions} partitions of {within}")
        if partitions != self.slots:
            why = f"the epoch it resumes in read its files as {partitions} partitions, for {self.slots} workers now"
            return self, whole.frame, f"shuffled: {why}"
        files = plan_reads(frame, whole.files) if tasks_read_files else "the mode reads its rows through Spark"
        read = "by the workers, from Parquet" if isinstance(files, ParquetFiles) else f"through Spark: {files}"
        return (
            dataclasses.replace(self, by_partition=True, files=files if isinstance(files, ParquetFiles) else None),
            whole.frame,
            f"not shuffled: its files read as {partitions} partitions of whole files ({within}), one a worker, {read}",
        )

    def _by_cached_partition(self, frame: DataFrame) -> tuple[TaskLayout, str]:
        """This layout by whole partitions of persisted ``frame`` where it has one a worker, evenly filled."""
        partitions = frame._jdf.rdd().getNumPartitions()
        if partitions != self.slots:
            return self, f"shuffled: {partitions} input partitions for {self.slots} workers (a barrier task reads one)"
        if not _one_partition_count(frame):
            return self, "shuffled: the input's partitions are made from others (a coalesce, a union) without a shuffle"
        rows = training_rows_by_partition(frame, partitions)
        if not _balanced(rows):
            return self, f"shuffled: the input's {partitions} partitions hold {min(rows)} to {max(rows)} training rows"
        return dataclasses.replace(
            self, by_partition=True
        ), f"not shuffled: {partitions} input partitions, one a worker"

    def readers(self, shard: int) -> list[int]:
        """The tasks that read ``shard``."""
        return [index for index, task in enumerate(self.tasks) if task.shard == shard]


def task_input(frame: DataFrame, layout: TaskLayout) -> DataFrame:
    """``frame`` with its rows' ``ROW_KEY`` in exactly ``layout.slots`` partitions, partition ``t`` holding the rows
    task ``t`` reads (a placeholder row where it reads its files itself: ``TaskLayout.files``)."""
    if layout.files is not None:  # the tasks read their files themselves: one placeholder row a task
        return frame.sparkSession.range(0, layout.slots, 1, layout.slots)
    keyed = frame.withColumn(ROW_KEY, F.monotonically_increasing_id())
    if layout.by_partition:
        return keyed
    row = F.col(ROW_KEY)  # shard: (place in the input partition + the partition's number) mod shards, from 1
    place = (F.pmod(row.bitwiseAND(F.lit((1 << 33) - 1)) + F.shiftright(row, 33), F.lit(layout.shards)) + 1).cast("int")
    keys = [F.lit(key).cast("long") for key in partition_keys(layout.slots)]  # hashed as bigints, as computed
    if layout.is_data_parallel:
        task_key = F.element_at(F.array(*keys), place)
        return keyed.withColumn(_TASK_KEY, task_key).repartition(layout.slots, _TASK_KEY).drop(_TASK_KEY)
    readers = F.array(*(F.array(*(keys[t] for t in layout.readers(s))) for s in range(layout.shards)))
    copies = keyed.withColumn(_TASK_KEY, F.explode(F.element_at(readers, place)))
    return copies.repartition(layout.slots, _TASK_KEY).drop(_TASK_KEY)


def _balanced(sizes: list[int]) -> bool:
    """Whether input partitions of ``sizes`` (rows, or bytes of files) can each be one worker's: none empty, none
    more than ``BALANCE_TOLERANCE`` above the smallest."""
    return min(sizes) > 0 and max(sizes) <= min(sizes) * (1 + BALANCE_TOLERANCE)


def _persisted(frame: DataFrame) -> bool:
    """Whether ``frame`` (a classic DataFrame) is persisted."""
    level = frame.storageLevel
    return bool(level.useMemory or level.useDisk or level.useOffHeap)


def training_rows_by_partition(frame: DataFrame, partitions: int) -> list[int]:
    """The training rows (held-out ones not counted) of each of persisted ``frame``'s ``partitions``, counted over its
    cached rows: one Spark job, no pass over the source."""
    training = frame.where(~F.col(VALIDATION)) if VALIDATION in frame.columns else frame
    counted = training.groupBy(F.spark_partition_id().alias("partition")).count().collect()
    by_partition = {row["partition"]: row["count"] for row in counted}
    return [int(by_partition.get(p, 0)) for p in range(partitions)]


def _one_partition_count(frame: DataFrame) -> bool:
    """Whether every RDD ``frame``'s partitions are made from, up to a shuffle, has as many partitions: what Spark asks
    of a barrier stage's lineage (a ``coalesce`` or ``union`` before it is refused, cached or not)."""
    jrdd = frame._jdf.rdd()
    count, seen, todo = jrdd.getNumPartitions(), set(), [jrdd]
    while todo:
        rdd = todo.pop()
        if rdd.id() in seen:
            continue
        seen.add(rdd.id())
        if rdd.getNumPartitions() != count:
            return False
        dependencies = rdd.dependencies()
        for i in range(dependencies.size()):
            dependency = dependencies.apply(i)
            if not dependency.getClass().getSimpleName().startswith("Shuffle"):
                todo.append(dependency.rdd())
    return True


def partition_keys(slots: int) -> list[int]:
    """For each partition ``t`` of ``repartition(slots, key)`` over a bigint ``key``, a key that Spark's hash
    partitioning sends there: the smallest ``k >= 0`` with ``pmod(hash(k), slots) == t`` (Spark's ``hash`` is
    Murmur3 with seed 42, :func:`spark_hash_long`)."""
    keys: dict[int, int] = {}
    candidate = 0
    while len(keys) < slots:
        keys.setdefault(spark_hash_long(candidate) % slots, candidate)
        candidate += 1
    return [keys[t] for t in range(slots)]


def spark_hash_long(value: int, seed: int = 42) -> int:
    """Spark's ``hash`` of a bigint (``Murmur3_x86_32.hashLong``), as a signed 32-bit int."""

    def mix_k1(k1: int) -> int:
        k1 = (k1 * 0xCC9E2D51) & _MASK32
        k1 = ((k1 << 15) | (k1 >> 17)) & _MASK32
        return (k1 * 0x1B873593) & _MASK32

    def mix_h1(h1: int, k1: int) -> int:
        h1 ^= k1
        h1 = ((h1 << 13) | (h1 >> 19)) & _MASK32
        return (h1 * 5 + 0xE6546B64) & _MASK32

    value &= (1 << 64) - 1
    h1 = mix_h1(seed & _MASK32, mix_k1(value & _MASK32))
    h1 = mix_h1(h1, mix_k1(value >> 32))
    h1 ^= 8
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _MASK32
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _MASK32
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 >= 1 << 31 else h1


_MASK32 = 0xFFFFFFFF
