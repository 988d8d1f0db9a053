"""Reads an input made of files as one partition of whole files a worker, so that the training stage needs no shuffle.

Spark's barrier stage reads one input partition a task (SPARK-24820 refuses a ``coalesce`` before it), and Spark
plans a table's files as partitions of at most ``spark.sql.files.maxPartitionBytes`` (128 MB): a table larger than
that has more partitions than a fit has workers, and would be dealt to them through a shuffle. Where the rows are a
projection of a file scan (no filter, join or rows made in Python: the bytes of its files then say how many rows
each partition holds), :func:`read_whole` plans the scan again as exactly ``partitions`` partitions of whole files,
packed the way Spark packs them (largest first, each partition filled up to a size, its next-fit), at the smallest
size that gives that many, and keeps the plan only where Spark made exactly that: as many partitions, no file split.
The plan is deterministic (the files' sizes decide it), so a fit
resumed mid-epoch reads the rows again in the same partitions, under the same keys (``sparkdl.launch.layout``).

The scan is planned under three of the session's settings (``spark.sql.files.maxPartitionBytes``,
``openCostInBytes`` and ``minPartitionNum``) for as long as Spark takes to plan it, then the session's own are put
back: a query that another thread of the driver plans in that moment splits its files differently, with the same
rows.
"""

from __future__ import annotations

import dataclasses
import threading

from pyspark.sql import DataFrame

# The physical plan of a projection of files: the nodes between the rows and the scan
PROJECTION_NODES = {"WholeStageCodegenExec", "ProjectExec", "ColumnarToRowExec", "InputAdapter"}
_SETTINGS = (
    "spark.sql.files.maxPartitionBytes",
    "spark.sql.files.openCostInBytes",
    "spark.sql.files.minPartitionNum",
    "spark.sql.files.maxPartitionNum",
)
_planning = threading.Lock()  # one plan under sparkdl's settings at a time: each puts back what it found


@dataclasses.dataclass(frozen=True)
class WholeFiles:
    """An input read as partitions of whole files: the rows, and the files each partition reads, with their bytes."""

    frame: DataFrame
    bytes_by_partition: list[int]
    files: list[list[str]]  # each partition's files (URIs), in the order Spark reads them


def read_whole(frame: DataFrame, partitions: int) -> WholeFiles | str:
    """``frame`` (unpersisted, classic) read as ``partitions`` partitions of whole files, or why it cannot be (for the
    fit's log). How evenly they are filled is the caller's to judge (``bytes_by_partition``)."""
    scan = _file_scan(frame._jdf.queryExecution().executedPlan())
    if scan is None:
        return "its rows are not a projection of files: a filter, a join, rows made in Python"
    sizes = _file_sizes(scan.inputRDD())
    if len(sizes) < partitions:
        return f"it has fewer files ({len(sizes)}) than the {partitions} partitions it would be read as"
    capacity = _packing_size(sorted(sizes, reverse=True), partitions)
    if capacity is None:
        return f"its {len(sizes)} files do not pack into {partitions} partitions"
    spark = frame.sparkSession
    with _planning:
        found = {key: spark.conf.get(key, None) for key in _SETTINGS}
        try:
            spark.conf.set("spark.sql.files.maxPartitionBytes", str(capacity))
            spark.conf.set("spark.sql.files.openCostInBytes", "0")
            spark.conf.set("spark.sql.files.minPartitionNum", "1")
            spark.conf.unset("spark.sql.files.maxPartitionNum")
            rows = frame.select("*")._jdf.queryExecution().toRdd()  # its partitions are planned here
        finally:
            for key, value in found.items():
                if value is None:
                    spark.conf.unset(key)
                else:
                    spark.conf.set(key, value)
    scan_rdd = _scan_rdd(rows)
    planned = "its file scan is not found under the planned read" if scan_rdd is None else _files_by_partition(scan_rdd)
    if isinstance(planned, str) or len(planned) != partitions:
        why = planned if isinstance(planned, str) else f"{len(planned)} partitions"
        return f"Spark did not plan its files as {partitions} partitions of whole files ({why})"
    jdf = spark._jsparkSession.internalCreateDataFrame(rows, frame._jdf.schema(), False)
    sizes = [sum(size for _, size in partition) for partition in planned]
    return WholeFiles(DataFrame(jdf, spark), sizes, [[uri for uri, _ in partition] for partition in planned])


def _files_by_partition(scan_rdd) -> list[list[tuple[str, int]]] | str:
    """The files (URI, bytes) each partition of a file scan's RDD reads, in order, or why not: a file is split
    between partitions."""
    planned = []
    for partition in scan_rdd.partitions():
        files = list(partition.files())
        if any(file.start() != 0 or file.length() != file.fileSize() for file in files):
            return "a file is split between partitions"
        planned.append([(str(file.filePath()), int(file.length())) for file in files])
    return planned


def _file_scan(node):
    """The file scan a physical plan projects, or None."""
    while node.getClass().getSimpleName() in PROJECTION_NODES:
        node = node.children().apply(0)
    return node if node.getClass().getSimpleName() == "FileSourceScanExec" else None


def _scan_rdd(rdd):
    """The file scan's RDD under ``rdd`` (through its first dependencies), or None."""
    while rdd.getClass().getSimpleName() != "FileScanRDD":
        dependencies = rdd.dependencies()
        if dependencies.isEmpty():
            return None
        rdd = dependencies.apply(0).rdd()
    return rdd


def _file_sizes(scan_rdd) -> list[int]:
    """The size of each file a file scan's RDD reads (some split in parts)."""
    sizes: dict[str, int] = {}
    for partition in scan_rdd.partitions():
        for file in partition.files():
            path = str(file.filePath())
            sizes[path] = max(sizes.get(path, 0) + int(file.length()), int(file.fileSize()))
    return list(sizes.values())


def _packing_size(sizes: list[int], partitions: int) -> int | None:
    """The smallest partition size at which Spark packs files of ``sizes`` (largest first) into ``partitions``
    partitions of whole files, or None where no size does."""
    low, high = max(sizes[0], -(-sum(sizes) // partitions)), sum(sizes)
    while low < high:  # next-fit's count falls as the size grows (in rare orders not: a packing missed is a shuffle)
        middle = (low + high) // 2
        low, high = (low, middle) if _next_fit(sizes, middle) <= partitions else (middle + 1, high)
    return low if _next_fit(sizes, low) == partitions else None


def _next_fit(sizes: list[int], capacity: int) -> int:
    """How many partitions Spark packs files of ``sizes`` into, at ``capacity`` bytes a partition and no cost to open
    a file: each file joins the partition being filled unless it would overflow it, else starts the next."""
    count, filled = 0, capacity
    for size in sizes:
        if filled + size > capacity:
            count, filled = count + 1, 0
        filled += size
    return count
