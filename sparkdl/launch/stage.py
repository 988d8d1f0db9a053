"""The launcher: one function on N Spark tasks, in barrier mode (all start together) or not.

The DataFrame is repartitioned to exactly N partitions right before
``mapInArrow(..., barrier=...)`` (barrier stages refuse coalesce/union
lineage), each task gets its partition as Arrow record batches, and each
task's return value comes back to the driver as binary rows. While the job
runs, every task's output is relayed to the driver (``relay``); the first
task to raise cancels the job and its exception is re-raised on the driver
as a ``WorkerError`` with the remote traceback. A task that dies without
raising (a lost executor) is left to Spark's retries.
"""

from __future__ import annotations

import secrets
import time
from typing import Callable, Iterable, Iterator, Optional

import pyarrow as pa
from pyspark import BarrierTaskContext, TaskContext
from pyspark.sql import DataFrame, SparkSession

from sparkdl import _compat
from sparkdl._tf_log import quiet_tensorflow
from sparkdl.collective import Listener, RingCommunicator
from sparkdl.launch import gpu
from sparkdl.launch.errors import worker_error
from sparkdl.launch.relay import OutputRelay, TaskReporter, forward_output

_RESULT_SCHEMA = "partition int, chunk int, payload binary"
_RESULT_ARROW_SCHEMA = pa.schema([("partition", pa.int32()), ("chunk", pa.int32()), ("payload", pa.binary())])
_CHUNK_BYTES = 32 << 20  # keeps each binary row far below Arrow's 2 GB limit

# A task gets its partition's batches and its reporter (errors, progress) and returns bytes for the driver.
TaskFunction = Callable[[Iterable[pa.RecordBatch], TaskReporter], Optional[bytes]]


def task_slots(spark: SparkSession) -> int:
    """How many tasks the cluster can run at once right now (what a barrier stage needs)."""
    sc = spark.sparkContext._jsc.sc()
    profile = sc.resourceProfileManager().defaultResourceProfile()
    return int(sc.maxNumConcurrentTasks(profile))


def _is_local_mode(master: str) -> bool:
    """``local[...]``: tasks are threads of one JVM (fixed slots, no GPU scheduling); not ``local-cluster``."""
    return master.startswith("local") and not master.startswith("local-cluster")


def check_slots(spark: SparkSession, num_workers: int, wait_seconds: float) -> None:
    """Fails fast when the barrier stage could never be scheduled, instead of letting Spark hang or retry.

    Executors of a freshly started cluster register over a few seconds, so the
    check waits up to ``wait_seconds`` for enough of them (not in local mode,
    whose slots are fixed).
    """
    master = spark.sparkContext.master
    if _is_local_mode(master):
        wait_seconds = 0.0
    deadline = time.monotonic() + wait_seconds
    while (slots := task_slots(spark)) < num_workers:
        if time.monotonic() >= deadline:
            raise ValueError(
                f"Expected `num_workers` <= the cluster's task slots. Received num_workers={num_workers}, but the "
                f"cluster runs {slots} tasks at once (master={master!r}, "
                f"spark.task.cpus={spark.conf.get('spark.task.cpus', '1')}). A barrier stage needs all of its "
                "tasks running together: lower num_workers or add executors/cores."
            )
        time.sleep(0.5)


# How long the driver waits, after a failed job, for the tasks' last output and error reports.
_REPORT_GRACE_SECONDS = 10.0


def run_tasks(frame: DataFrame, num_workers: int, task: TaskFunction, *, barrier: bool,
              timeout: float = 600.0,
              on_progress: Callable[[int, dict], None] = lambda rank, event: None) -> dict[int, bytes]:
    """Runs ``task`` once per partition of ``frame.repartition(num_workers)``.

    Returns the bytes each task returned, by partition index (tasks returning
    None are left out). ``barrier=True`` starts all tasks together, as the
    ring needs; otherwise they are ordinary tasks that Spark may retry alone.
    ``timeout`` bounds how long a task waits to reach the driver's relay.
    ``on_progress(rank, event)`` receives the tasks' progress reports as they come.
    """
    sc = frame.sparkSession.sparkContext
    local_mode = _is_local_mode(sc.master)
    relay_secret = secrets.token_bytes(32)
    tag = f"sparkdl-{secrets.token_hex(8)}"
    relay = OutputRelay(sc.getConf().get("spark.driver.host"), relay_secret, num_workers,
                        on_error=lambda report: sc.cancelJobsWithTag(tag), on_progress=on_progress)
    relay_address = relay.address  # the closure below must not capture the relay itself

    def run_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        quiet_tensorflow()  # before the task imports TensorFlow: its start-up lines, times N workers, are noise
        context = TaskContext.get()
        partition = context.partitionId()
        gpu.pin_task_gpus(context.resources(), partition, local_mode)
        with forward_output(relay_address, relay_secret, partition, timeout,
                            keep_local_copy=not local_mode) as reporter:
            try:
                payload = task(batches, reporter)
            except BaseException as exc:
                reporter.error(exc)
                raise
        if payload is None:
            return
        for index, start in enumerate(range(0, max(len(payload), 1), _CHUNK_BYTES)):
            yield pa.RecordBatch.from_pydict(
                {"partition": [partition], "chunk": [index], "payload": [payload[start : start + _CHUNK_BYTES]]},
                schema=_RESULT_ARROW_SCHEMA,
            )

    results = frame.repartition(num_workers).mapInArrow(run_task, _RESULT_SCHEMA, barrier=barrier)
    if barrier:
        # Spark retries a failed barrier stage only when it is a shuffle-map stage (a failed barrier
        # result stage aborts the job): the shuffle makes the training stage retryable after a lost task.
        results = results.repartition(1)
    sc.addJobTag(tag)
    try:
        table = _compat.collect_arrow(results)
    except Exception:
        relay.wait_until_quiet(_REPORT_GRACE_SECONDS)
        report = relay.first_error()
        if report is None:
            raise  # no task's own code raised (an executor was lost, Spark's retries ran out): Spark's error says it
        raise worker_error(report, relay.reports) from None
    finally:
        sc.removeJobTag(tag)
        relay.close()
    table = table.sort_by([("partition", "ascending"), ("chunk", "ascending")])
    results: dict[int, list[bytes]] = {}
    for partition, payload in zip(table.column("partition").to_pylist(), table.column("payload").to_pylist()):
        results.setdefault(partition, []).append(payload)
    return {partition: b"".join(chunks) for partition, chunks in results.items()}


def connect_collective(secret: bytes, timeout: float) -> RingCommunicator:
    """Inside a barrier task: builds the ring of all tasks of the stage, rank = partition index."""
    context = BarrierTaskContext.get()
    rank = context.partitionId()
    host = context.getTaskInfos()[rank].address.rsplit(":", 1)[0]
    listener = Listener(host=host)
    addresses = context.allGather(listener.address)
    return RingCommunicator.connect(rank, addresses, listener, secret, timeout=timeout)
