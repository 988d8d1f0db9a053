"""The running Spark task's context, for code that only ever runs inside a task."""

from __future__ import annotations

from pyspark import TaskContext


def current_task() -> TaskContext:
    """``TaskContext.get()``, which is ``None`` outside a task: a clear error instead of an ``AttributeError``."""
    context = TaskContext.get()
    if context is None:
        raise RuntimeError("This sparkdl function runs inside a Spark task (a worker), not on the driver.")
    return context


def partition_id() -> int:
    """The running task's partition: a worker's rank in every mode."""
    return current_task().partitionId()
