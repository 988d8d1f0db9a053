"""The launcher: one function on N Spark tasks, in barrier mode (all start together) or not.

The DataFrame is repartitioned to exactly N partitions right before
``mapInArrow(..., barrier=...)`` (barrier stages refuse coalesce/union
lineage; ``layout`` decides which rows each task reads), each task gets its
partition as Arrow record batches, and each
task's return value comes back to the driver over the task's connection to the
driver's relay (``payloads``: not through the JVMs, whatever its size), or for
bytes that will be unpickled as binary rows through Spark. While the job
runs, every task's output is relayed to the driver (``relay``); the first
task to raise cancels the job and its exception is re-raised on the driver
as a ``WorkerError`` with the remote traceback. A task that dies without
raising (a lost executor) is left to Spark's retries.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import pyarrow as pa
from pyspark import BarrierTaskContext
from pyspark.sql import DataFrame

from sparkdl import _compat
from sparkdl._tf_log import quiet_tensorflow
from sparkdl.collective import Listener, SparkdlCommunicator, topology
from sparkdl.data.rules import EMPTY_INPUT, RowCheckError
from sparkdl.launch import gpu, payloads, rendezvous, session
from sparkdl.launch.errors import InputLost, ResultLost, SlotsLost, worker_error
from sparkdl.launch.forward import TaskReporter, forward_output
from sparkdl.launch.layout import TaskLayout, task_input
from sparkdl.launch.parquet_files import ParquetFiles
from sparkdl.launch.phases import Phases
from sparkdl.launch.relay import OutputRelay
from sparkdl.launch.task_context import current_task

# One row per task that returned bytes (the bytes themselves only with spark_results, in chunks): which
# attempt of the task Spark kept, and how many bytes it returned.
_RESULT_SCHEMA = "partition int, attempt bigint, size bigint, chunk int, payload binary"
_RESULT_ARROW_SCHEMA = pa.schema(
    [
        ("partition", pa.int32()),
        ("attempt", pa.int64()),
        ("size", pa.int64()),
        ("chunk", pa.int32()),
        ("payload", pa.binary()),
    ]
)
_CHUNK_BYTES = 32 << 20  # keeps each binary row far below Arrow's 2 GB limit
_RERUN_ALONE = -1  # the size in the row of a barrier task Spark ran again without the stage's other tasks

# A task gets its partition's batches and its reporter (errors, progress) and returns bytes for the driver.
TaskFunction = Callable[[Iterable[pa.RecordBatch], TaskReporter], bytes | None]


# How long the driver waits, after a failed job, for the tasks' last output and error reports.
_REPORT_GRACE_SECONDS = 10.0
_STAGE_POLL_SECONDS = 1.0  # how often a barrier job's StageWatch looks at the cluster's slots and the rendezvous

logger = logging.getLogger(__name__)


def run_tasks(
    frame: DataFrame,
    tasks: int | TaskLayout,
    task: TaskFunction,
    *,
    barrier: bool,
    timeout: float = 600.0,
    on_progress: Callable[[int, dict], None] = lambda rank, event: None,
    offered: dict[str, bytes] | None = None,
    spark_results: bool = False,
    watch_slots: bool | None = None,
) -> StageResults:
    """Runs ``task`` once per task of ``tasks`` (a layout, or a number of workers each reading a shard of its own),
    on the rows the layout gives it (``launch.layout.task_input``).

    Returns the bytes each task returned, by partition index (tasks returning
    None are left out; a barrier task Spark ran again alone, after the others
    had finished, returns what its earlier attempt returned, or raises
    ``ResultLost`` where that never reached the driver: ``StageResults``).
    They come over the driver's relay, of any size (as a
    ``bytearray``, sparing a copy); with ``spark_results`` through Spark's
    task results instead (the driver JVM's heap, ``spark.driver.maxResultSize``):
    for bytes the caller unpickles, which must never come from a socket.
    ``watch_slots``: the stage cannot complete once the cluster has fewer task slots than its tasks (default: a
    barrier stage); it then fails with ``SlotsLost`` after ``timeout`` (``StageWatch``, which also waits for a barrier
    stage's ranks whose Python starts late).
    ``offered`` names payloads the tasks may fetch from the driver's relay
    (``payloads.fetch(reporter, name)``) instead of carrying them in the
    closure. ``barrier=True`` starts all tasks together, as the ring needs;
    otherwise they are ordinary tasks that Spark may retry alone. ``timeout``
    bounds how long a task waits to reach the driver's relay and each of its
    answers. ``on_progress(rank, event)`` receives the tasks' progress reports as they come, and
    each task's phases (``sparkdl.launch.phases``) just before its result.
    """
    layout = tasks if isinstance(tasks, TaskLayout) else TaskLayout.data_parallel(tasks)
    num_tasks = layout.slots
    spark = frame.sparkSession
    local_mode = session.is_local_mode(session.master(spark))
    relay_secret = secrets.token_bytes(32)
    encrypt = session.encrypts_traffic(spark)  # the relay's connections are sealed when Spark's RPC is
    tag = session.JobTag(spark)
    exchange = payloads.PayloadExchange(offered)
    meeting = rendezvous.Rendezvous(num_tasks) if barrier else None
    relay = OutputRelay(
        session.driver_host(spark),
        relay_secret,
        num_tasks,
        on_error=lambda report: tag.cancel(),
        on_progress=on_progress,
        exchange=exchange,
        rendezvous=meeting,
        encrypt=encrypt,
    )
    relay_address = relay.address  # the closure below must not capture the relay itself
    files = layout.files

    def run_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        phases = Phases()  # the task's own phases, from now on (sparkdl.launch.phases)
        quiet_tensorflow()  # before the task imports TensorFlow: its start-up lines, times N workers, are noise
        context = current_task()
        partition, attempt = context.partitionId(), context.taskAttemptId()
        if barrier and len(BarrierTaskContext.get().getTaskInfos()) < num_tasks:
            # Spark ran this task again without the others, which had finished: it cannot train alone, and what it
            # returned the first time, if anything, is on the driver already (_results hands it back)
            yield _result_row(partition, attempt, _RERUN_ALONE, 0, None)
            return
        gpu.pin_task_gpus(context.resources(), partition, local_mode)
        with forward_output(
            relay_address,
            relay_secret,
            partition,
            timeout,
            keep_local_copy=not local_mode,
            encrypt=encrypt,
            phases=phases,
        ) as reporter:
            try:
                payload = task(
                    _spark_input(batches) if files is None else _files_input(files, partition, batches), reporter
                )
                reporter.progress(phases.event())  # before the upload, which the driver waits for
                if payload is not None and not spark_results:
                    payloads.upload(reporter, payload, attempt)  # before this attempt can report success
            except BaseException as exc:
                reporter.error(exc)
                raise
        if payload is None:
            return
        chunks = range(0, max(len(payload), 1), _CHUNK_BYTES) if spark_results else (None,)
        for index, start in enumerate(chunks):
            yield _result_row(
                partition,
                attempt,
                len(payload),
                index,
                None if start is None else payload[start : start + _CHUNK_BYTES],
            )

    results = task_input(frame, layout).mapInArrow(run_task, _RESULT_SCHEMA, barrier=barrier)
    if barrier:
        # Spark retries a failed barrier stage only when it is a shuffle-map stage (a failed barrier
        # result stage aborts the job): the shuffle makes the training stage retryable after a lost task.
        results = results.repartition(1)
    every_slot = barrier if watch_slots is None else watch_slots
    watch = StageWatch(spark, num_tasks, timeout, tag, meeting) if every_slot else contextlib.nullcontext()
    try:
        with tag, watch:
            table = _compat.collect_arrow(results)
    except Exception:
        if isinstance(watch, StageWatch) and watch.lost is not None:
            raise watch.lost.seen_by(relay.reports) from None
        relay.wait_until_quiet(_REPORT_GRACE_SECONDS)
        report = relay.first_error()
        if report is None:
            raise  # no task's own code raised (an executor was lost, Spark's retries ran out): Spark's error says it
        raise worker_error(report, relay.reports) from None
    finally:
        relay.close()
    if not table.num_rows and not relay.served:
        # Spark skips a stage whose input is an empty shuffle (adaptive execution): no task ran
        raise RowCheckError(EMPTY_INPUT)
    try:
        return _results(table, None if spark_results else exchange, meeting)
    finally:
        exchange.discard_rest()


def _result_row(partition: int, attempt: int, size: int, chunk: int, data: bytes | None) -> pa.RecordBatch:
    """A task's row of the results (``_RESULT_SCHEMA``)."""
    return pa.RecordBatch.from_pydict(
        {"partition": [partition], "attempt": [attempt], "size": [size], "chunk": [chunk], "payload": [data]},
        schema=_RESULT_ARROW_SCHEMA,
    )


def _spark_input(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A task's input batches, an error in reading them raised as ``InputLost`` (Spark's to retry; see there)."""
    batches = iter(batches)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as exc:
            raise InputLost(f"reading this task's input rows from Spark failed: {type(exc).__name__}: {exc}") from exc
        yield batch


def _files_input(files: ParquetFiles, partition: int, placeholder: Iterator[pa.RecordBatch]):
    """A task's input batches read from its partition's files (``TaskLayout.files``), after Spark's placeholder row."""
    for _ in placeholder:
        pass
    yield from files.read(partition)


class StageWatch:
    """While a job that needs all its tasks at once runs (a barrier stage's), watches what its tasks wait for.

    - Slots lost: where the cluster has had fewer task slots than the stage's tasks (an executor lost and not
      replaced) for ``timeout`` seconds, cancels the job and keeps a ``SlotsLost`` for the caller, which Spark would
      otherwise leave waiting for the slots without end; it names the hosts whose executors went away, and the
      ranks that ran on a host left with none (``meeting``: a barrier stage's rendezvous, which knows every rank's
      host). Knows nothing of slots where Spark does not say (``session.task_slots`` None: Spark Connect without
      the server's settings).
    - Ranks starting late: Spark launches a barrier stage's tasks together or not at all, so while ranks wait at
      the rendezvous for ranks whose task has not connected yet, those are starting their Python (a new
      executor's Python worker importing TensorFlow, which took longer than the fit's ``timeout`` on a busy
      machine): the watch renews the waiting ranks' wait (``Rendezvous.tell_starting``), for
      ``worker_python.STARTUP_SECONDS`` at most from their arrival, after which they give up after ``timeout``,
      naming the ranks; a retried stage's ranks are waited for as long again. (A lost executor fails its task,
      and Spark the stage's other tasks: nobody waits for it.)
    """

    def __init__(self, spark, needed: int, timeout: float, tag: session.JobTag, meeting: rendezvous.Rendezvous | None):
        self._spark, self._needed, self._timeout, self._tag, self._meeting = spark, needed, timeout, tag, meeting
        self._poll_seconds = min(_STAGE_POLL_SECONDS, timeout / 4)  # renewals well within the ranks' timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkdl-stage-watch", daemon=True)
        self.lost: SlotsLost | None = None

    def __enter__(self) -> StageWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        short_since = None
        try:
            hosts_before = session.executor_hosts(self._spark)
        except Exception:  # the session is stopping: nothing left to watch
            return
        while not self._stop.wait(self._poll_seconds):
            try:
                slots = session.task_slots(self._spark)
                hosts_now = session.executor_hosts(self._spark)
            except Exception:  # the session is stopping: nothing left to watch
                return
            now = time.monotonic()
            if self._meeting is not None:
                self._meeting.tell_starting()
            if slots is None or slots >= self._needed:
                short_since = None
                continue
            short_since = now if short_since is None else short_since
            if now - short_since >= self._timeout:
                gone: list[str] = []
                ranks: list[int] = []
                if hosts_before and hosts_now:
                    gone = sorted(set(hosts_before - hosts_now))
                    # a rank's host, but not its executor, is known: name ranks only where the host has none left
                    if self._meeting is not None:
                        ranks = self._meeting.ranks_on([host for host in gone if hosts_now[host] == 0])
                self.lost = SlotsLost(self._needed, slots, now - short_since, gone, ranks)
                logger.warning("sparkdl: %s", self.lost)
                self._tag.cancel()
                return


class StageResults(dict):
    """The bytes each task returned, by partition; a partition whose result was lost (``lost``) raises
    ``ResultLost`` where it is asked for, and one whose task returned nothing ``KeyError``, as from a dict."""

    def __init__(self, results: Mapping[int, bytes], lost: Iterable[int] = ()):
        super().__init__(results)
        self.lost = frozenset(lost)

    def __missing__(self, partition: int) -> bytes:
        if partition in self.lost:
            raise ResultLost(
                f"Rank {partition}'s result was lost: Spark ran rank {partition} of the barrier stage again alone "
                "after the other ranks had finished (its executor was lost at the stage's end), and its attempt "
                "that trained with them had not returned its result to the driver. Fit again: a fit with "
                "checkpoint_dir resumes from its newest checkpoint."
            )
        raise KeyError(partition)


def _results(
    table: pa.Table, exchange: payloads.PayloadExchange | None, meeting: rendezvous.Rendezvous | None = None
) -> StageResults:
    """Each partition's bytes, from the attempt Spark kept: the relay's upload of that attempt, or the rows' chunks.
    A barrier task Spark ran again alone (``_RERUN_ALONE``) gets back the upload of its rank's task when the ranks
    last met (``meeting``), the attempt the stage's other ranks finished with, if that task uploaded one (not one
    of an earlier attempt: its training was another)."""
    table = table.sort_by([("partition", "ascending"), ("chunk", "ascending")])
    kept: dict[int, tuple[int, int]] = {}
    chunks: dict[int, list[bytes]] = {}
    for partition, attempt, size, payload in zip(
        *(table.column(name).to_pylist() for name in ("partition", "attempt", "size", "payload"))
    ):
        kept[partition] = (attempt, size)
        chunks.setdefault(partition, []).append(payload)
    alone = {partition for partition, (_, size) in kept.items() if size == _RERUN_ALONE}
    if exchange is not None:
        taken: dict[int, bytes] = {}
        lost: set[int] = set()
        for partition, (attempt, size) in kept.items():
            if partition not in alone:
                taken[partition] = exchange.take(partition, attempt, size)
                continue
            task = meeting.task_at_last_meeting(partition) if meeting else None
            result = None if task is None else exchange.take_if_uploaded(partition, task)
            logger.info(
                "sparkdl: Spark ran rank %d of the barrier stage again alone, after the others had finished: %s",
                partition,
                "its attempt that met the others returned nothing"
                if result is None
                else "the result of its attempt that met the others is kept",
            )
            if result is None:
                lost.add(partition)
            else:
                taken[partition] = result
        return StageResults(taken, lost)
    results = {partition: b"".join(parts) for partition, parts in chunks.items() if partition not in alone}
    for partition, data in results.items():
        if len(data) != kept[partition][1]:
            raise RuntimeError(
                f"Partition {partition}'s task returned {kept[partition][1]} bytes, but {len(data)} "
                "arrived through Spark."
            )
    return StageResults(results, lost=alone)  # through Spark, the first attempt's rows went with its executor


def connect_collective(
    reporter: TaskReporter, secret: bytes, timeout: float, *, encrypt: bool = False
) -> SparkdlCommunicator:
    """Inside a barrier task: the communicator of all tasks of the stage, rank = partition index (sealed if ``encrypt``).

    Each task publishes its listener's address and its host's identity at the rendezvous, over its
    connection to the driver (``sparkdl.launch.rendezvous``); ranks of one host then also share memory.
    """
    context = BarrierTaskContext.get()
    rank = context.partitionId()
    host = context.getTaskInfos()[rank].address.rsplit(":", 1)[0]
    listener = Listener(host=host)
    try:
        record = topology.record(listener.address, topology.host_identity(host))
        records = rendezvous.join(reporter, rank, context.taskAttemptId(), record, timeout)
    except BaseException:
        listener.close()
        raise
    addresses, hosts = topology.parse_records(records)
    return SparkdlCommunicator.connect(rank, addresses, listener, secret, timeout=timeout, encrypt=encrypt, hosts=hosts)
