"""Task slots: a fit holds the slots its workers need from its first Spark job to its end, and waits its turn for them.

Spark refuses a barrier stage with more tasks than the cluster has slots, but one that fits waits
for free slots, without end and without a word, while other tasks hold them: another fit's training
may hold them for hours. Fits run side by side when CrossValidator or TrainValidationSplit has
``parallelism`` above 1, so every fit first claims its slots (:func:`claim_slots`), under one lock for
the whole process::

    free = the cluster's task slots (session.task_slots)
         - the tasks running now (the status tracker's active stages), but those of claimed fits and
           of sparkdl's worker probes (a fit waits for its probe anyway)
         - the slots claimed by the other sparkdl fits of this process

A claim lasts as long as its fit. Every job the fit starts carries the claim's job tag (the worker
probe, whose thread the fit starts, too), so its own tasks, which run inside its claimed slots, are
not counted twice: a claim counts the same from the fit's check, through its worker probe, to its
last training task.

A fit that finds too few free slots waits for them, as Spark's own estimators queue for theirs, up to
its ``timeout``: it logs once what it waits for, and again when it has its slots. Claims are all or
nothing (a waiting fit holds no slot, so waiting fits cannot hold each other's), and they are granted
in the order the fits asked (a fit that needs many slots is not overtaken for ever by later fits
that need few). A claim that ends wakes the waiting fits; the tasks of other jobs (a finished
candidate's evaluation, a query of another thread) end unannounced, so the first waiting fit also
looks again every ``_POLL_SECONDS``. A fit still without its slots after ``timeout`` fails naming the
slots it needs, the free ones and who holds the others. Only a fit the cluster could never hold
(more workers than slots in all, :func:`check_slots`) fails at once.

Spark Connect has no status tracker in this process: there only the check of the cluster's total
slots (:func:`check_slots`) applies, and a log line says so.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

from pyspark.sql import SparkSession

from sparkdl.launch import session

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.2  # how often the first waiting fit looks again for the tasks of other jobs that ended
_lock = threading.Lock()
_changed = threading.Condition(_lock)  # notified when a claim ends or a fit leaves the line
_claims: dict[str, int] = {}  # the job tag of each running fit of this process -> the slots it claimed
_waiting: collections.deque[str] = collections.deque()  # the job tags of the fits waiting for slots, first first
# The job tags of sparkdl's worker probes running now (``sparkdl.launch.probe``): a fit waits for the probe of its
# session before training, wherever it was started (a job starts it early, beside its own work), so the probe's
# tasks are not busy slots to that fit.
_probes: set[str] = set()


def _barrier_reason(slots: int) -> str:
    return "A barrier stage needs all of its tasks running together"


def check_slots(
    spark: SparkSession, num_workers: int, wait_seconds: float, *, why: Callable[[int], str] = _barrier_reason
) -> None:
    """Fails fast when the workers could never run together, instead of letting Spark (or the server) hang.

    Executors of a freshly started cluster register over a few seconds, so the
    check waits up to ``wait_seconds`` for enough of them (not in local mode,
    whose slots are fixed, nor under Spark Connect, whose slots are read from
    the server's settings). ``why(slots)`` says why the job needs a slot per
    worker (a training mode's ``Plan.why_all_at_once``), for the error.
    """
    master = session.master(spark)
    if session.is_local_mode(master) or session.is_connect(spark):
        wait_seconds = 0.0
    deadline = time.monotonic() + wait_seconds
    while (slots := session.task_slots(spark)) is not None and slots < num_workers:
        if time.monotonic() >= deadline:
            raise ValueError(
                f"Expected `num_workers` <= the cluster's task slots. Received num_workers={num_workers}, but the "
                f"cluster runs {slots} tasks at once (master={master!r}, "
                f"spark.task.cpus={spark.conf.get('spark.task.cpus', '1')}). {why(slots)}: "
                "lower num_workers or add executors/cores."
            )
        time.sleep(0.5)
    if slots is None:
        logger.info(
            "sparkdl: the task slots of master=%r cannot be read over Spark Connect (set "
            "spark.executor.instances and spark.executor.cores to enable the check): the slot check is "
            "skipped, and Spark's own barrier check applies",
            master,
        )


@contextlib.contextmanager
def claim_slots(
    spark: SparkSession,
    num_workers: int,
    *,
    why: Callable[[int], str] = _barrier_reason,
    wait_seconds: float = 30.0,
    timeout: float = 600.0,
) -> Iterator[None]:
    """Holds ``num_workers`` free task slots while the block runs (a whole fit), released however it ends.

    First the cluster must have that many slots at all (:func:`check_slots`, which waits up to
    ``wait_seconds`` for executors to register); then the fit waits its turn until that many are free,
    up to ``timeout`` seconds, or a ``ValueError`` names the slots needed, free and held (module
    docstring). Jobs that this thread starts in the block carry the claim's job tag. ``why(slots)``
    says why the workers need their slots at once.
    """
    check_slots(spark, num_workers, wait_seconds, why=why)
    if session.is_connect(spark):
        logger.info(
            "sparkdl: over Spark Connect the free task slots cannot be read (no status tracker in this "
            "process): only the cluster's total slots were checked, and a fit that finds its slots busy "
            "waits for them"
        )
        yield
        return
    tag = session.JobTag(spark, "sparkdl-fit")
    _claim(spark, tag.name, num_workers, timeout, why)
    try:
        with tag:
            yield
    finally:
        with _changed:
            del _claims[tag.name]
            _changed.notify_all()


@dataclasses.dataclass(frozen=True)
class _Slots:
    """The cluster's slots as a waiting fit sees them."""

    total: int
    claimed: int  # by the other sparkdl fits of this process
    fits: int  # how many fits hold those
    busy: int  # running the tasks of other jobs
    ahead: int  # fits waiting before this one

    @property
    def free(self) -> int:
        return max(self.total - self.busy - self.claimed, 0)

    def __str__(self) -> str:
        return (
            f"{self.free} of the cluster's {self.total} are free ({self.claimed} claimed by {self.fits} other "
            f"sparkdl fit(s) running in this process, {self.busy} running the tasks of other jobs, "
            f"{self.ahead} fit(s) waiting before this one)"
        )


def _slots_now(spark: SparkSession, name: str) -> _Slots:
    """The slots as the waiting fit ``name`` sees them now (called under the lock)."""
    return _Slots(
        total=session.task_slots(spark) or 0,
        claimed=sum(_claims.values()),
        fits=len(_claims),
        busy=_busy_tasks(spark, [*_claims, *_probes]),
        ahead=_waiting.index(name),
    )


def _claim(spark: SparkSession, name: str, num_workers: int, timeout: float, why: Callable[[int], str]) -> None:
    """Waits its turn (first come, first served) until ``num_workers`` slots are free, then claims them."""
    started = time.monotonic()
    deadline = started + timeout
    announced = False
    with _changed:  # two fits checking at the same moment cannot both take the last slots
        _waiting.append(name)
        try:
            while True:
                now = _slots_now(spark, name)
                if now.ahead == 0 and now.free >= num_workers:
                    _claims[name] = num_workers
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(
                        f"Expected {num_workers} task slot(s) to be free within timeout={timeout:g}s. Received "
                        f"num_workers={num_workers}: after {time.monotonic() - started:.1f}s, {now}. {why(now.total)}, "
                        "so the fit waits for free slots before its first job. Raise `timeout`, run fewer fits at "
                        "once (CrossValidator/TrainValidationSplit `parallelism`), lower `num_workers`, or add "
                        "executors/cores."
                    )
                if not announced:
                    logger.info("sparkdl: waiting up to %gs for %d free task slot(s): %s", timeout, num_workers, now)
                    announced = True
                # Only the first fit in line may claim: it also looks again for other jobs' tasks that ended.
                _changed.wait(min(left, _POLL_SECONDS) if now.ahead == 0 else left)
        finally:
            _waiting.remove(name)
            _changed.notify_all()  # the next fit in line may claim now
    if announced:
        logger.info("sparkdl: got %d task slot(s) after waiting %.1fs", num_workers, time.monotonic() - started)


@contextlib.contextmanager
def probing(tag: str) -> Iterator[None]:
    """While the block runs, the jobs tagged ``tag`` (a worker probe's) do not count as busy slots."""
    with _lock:
        _probes.add(tag)
    try:
        yield
    finally:
        with _lock:
            _probes.discard(tag)


def _busy_tasks(spark: SparkSession, claim_tags: list[str]) -> int:
    """Tasks running now in the stages of jobs that no claim's (or probe's) tag marks: a claimed fit runs in its
    own slots, and a fit waits for its probe."""
    tracker = spark.sparkContext.statusTracker()
    jvm_tracker = spark.sparkContext._jsc.sc().statusTracker()
    claimed_stages: set[int] = set()
    for tag in claim_tags:
        for job in jvm_tracker.getJobIdsForTag(tag):
            job_info = tracker.getJobInfo(job)
            claimed_stages.update(job_info.stageIds if job_info is not None else ())
    busy = 0
    for stage in tracker.getActiveStageIds():
        stage_info = tracker.getStageInfo(stage)
        if stage not in claimed_stages and stage_info is not None:
            busy += stage_info.numActiveTasks
    return busy
