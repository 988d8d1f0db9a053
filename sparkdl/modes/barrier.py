"""One frame for every barrier mode's tasks: start-up, the ranks' rows, the starting point, checkpoints, progress and
the result hand-back, written once; a barrier plan supplies only its training (``BarrierPlan.train``).

| part            | where it runs | what it does                                                                  |
|-----------------|---------------|-------------------------------------------------------------------------------|
| ``BarrierPlan`` | driver, tasks | a plan whose workers run in one barrier stage: its ``run`` and its ``train``  |
| ``BarrierTask`` | shipped       | what every task of the stage receives: settings, secret, plan, checkpoints   |
| ``Ranks``       | tasks         | one task's place among the ranks, and the frame's services to ``train``      |

A task of the stage (``run_barrier_task``) loads Keras, reads its partition, connects to the other ranks
(``BarrierPlan.connect``), learns every shard's row counts (the same on every rank, so that every rank takes the
same decisions with no further talk) and hands a ``Ranks`` to its plan's ``train``. One rank, the writer
(``BarrierPlan.writer``), speaks for all: it reports progress, writes the checkpoints and returns the result. A
stage Spark retries after losing a task resumes from the newest checkpoint its failed attempt saved
(``Ranks.whole_model_start``, ``Ranks.newer_checkpoint``), inside its epoch where that is a step checkpoint
(``Ranks.epoch_rest``; ``Ranks.step_checkpoints`` says when the ranks take them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from sparkdl import schedule
from sparkdl.checkpoint import Checkpoint, Checkpointer, CheckpointStore, StepCheckpoints
from sparkdl.data import Partition, Rows, RowStats, read_partition
from sparkdl.keras import callbacks, random_state, serialization
from sparkdl.keras.prebuilt import PrebuiltModel
from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend
from sparkdl.launch import payloads, run_tasks
from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.session import encrypts_traffic
from sparkdl.launch.stage import connect_collective
from sparkdl.modes.base import Job, ModeResult, Plan, Settings
from sparkdl.position import EpochPosition, EpochRest, Segment, key_sum

MODEL = "model"  # the name under which the driver offers the model to start from


@dataclasses.dataclass(frozen=True)
class BarrierPlan(Plan):
    """A plan whose workers run as one barrier stage (sync, sharded, gossip, pipeline): a subclass implements
    ``train`` (in every task) and may change who the ranks are (``connect``, ``shard_ranks``, ``writer``) and
    what the driver offers and takes back (``run``)."""

    saves_checkpoints: ClassVar[str] = "tasks"

    def connect(self, reporter: TaskReporter, task: BarrierTask) -> contextlib.AbstractContextManager:
        """The communicator of a task of the stage (by default sparkdl's)."""
        return connect_collective(reporter, task.secret, task.settings.timeout, encrypt=task.encrypt)

    def shard_ranks(self, size: int) -> range:
        """The ranks whose rows are the shards of the training rows, one each (by default every rank)."""
        return range(size)

    def shard_of(self, rank: int, size: int) -> int:
        """The shard whose steps rank ``rank`` walks: the one whose rows it reads, or holds a copy of, or whose
        batches' sizes it follows (by default its own)."""
        return rank

    def writer(self, size: int) -> int:
        """The rank that reports progress, writes the checkpoints and returns the result (by default rank 0)."""
        return 0

    def train(self, ranks: Ranks) -> bytes | None:
        """In every task: trains, and returns what the driver takes back from this rank (None: nothing)."""
        raise NotImplementedError

    def run(self, job: Job) -> ModeResult:
        return self.writers_result(job)

    def writers_result(self, job: Job, offered: dict[str, bytes] | None = None) -> ModeResult:
        """Runs the stage (``run_stage``); the writer's trained model, history and stats as the result
        (``serialization.result_to_bytes``). The result's Keras model is built from the start point while the stage
        runs (``keras.prebuilt``)."""
        prebuilt = PrebuiltModel(job.start.model_bytes, job.settings.custom_objects, timeout=job.settings.timeout)
        results = self.run_stage(job, offered)
        model_bytes, history, initial_epoch, stats, resumed_history = serialization.result_from_bytes(
            results[self.writer(job.settings.num_workers)]
        )
        return ModeResult(prebuilt.trained(model_bytes), history, stats, initial_epoch, resumed_history)

    def run_stage(self, job: Job, offered: dict[str, bytes] | None = None) -> dict[int, bytes]:
        """Runs the stage, the model to start from (and ``offered``) on the driver's relay: what each task returned,
        by rank."""
        task = BarrierTask.of(job, self)
        return run_tasks(
            job.training.frame,
            job.layout,
            lambda batches, reporter: run_barrier_task(batches, reporter, task),
            barrier=True,
            timeout=job.settings.timeout,
            on_progress=job.monitor.on_event,
            offered={**(offered or {}), MODEL: job.start.model_bytes},
        )


@dataclasses.dataclass(frozen=True)
class BarrierTask:
    """Everything a task of the stage needs but the model (which the writer or each rank fetches from the driver's
    relay: it may be far larger than a closure should be), shipped from the driver in the task closure."""

    settings: Settings
    secret: bytes
    plan: BarrierPlan  # the variant and its options, as its mode's ``configure`` made them
    start_history: dict = dataclasses.field(default_factory=dict)  # of the epochs a resumed fit trained already
    checkpoints: CheckpointStore | None = None  # the writer saves after every epoch (and a retried stage resumes)
    encrypt: bool = False  # seal the links: the session runs with spark.network.crypto.enabled
    start_arrays: dict = dataclasses.field(default_factory=dict)  # the start checkpoint's random state (small)

    @classmethod
    def of(cls, job: Job, plan: BarrierPlan) -> BarrierTask:
        secret = secrets.token_bytes(32)
        encrypt = encrypts_traffic(job.training.frame.sparkSession)
        draws = job.start.arrays.get(random_state.DRAWS)
        arrays = {random_state.DRAWS: draws} if draws is not None else {}
        return cls(job.settings, secret, plan, job.start.history, job.checkpoints, encrypt, arrays)


def run_barrier_task(batches: Iterable[pa.RecordBatch], reporter: TaskReporter, task: BarrierTask) -> bytes | None:
    """A task of the stage, from its Arrow partition to what its plan's ``train`` returns."""
    use_tensorflow_backend()  # before anything in this worker imports Keras
    import keras  # noqa: F401 -- loads TensorFlow unless this Python worker has it already

    reporter.phase("import")
    partition = read_partition(task.settings.rules, batches)
    reporter.phase("read")
    with task.plan.connect(reporter, task) as comm:
        settings, counts, (rows, held_out) = _rows_of_shards(
            comm, partition, task.settings, task.plan.shard_ranks(comm.size)
        )
        reporter.phase("connect")
        limit_threads_to_task_cpus()
        writer = comm.rank == task.plan.writer(comm.size)
        return task.plan.train(Ranks(comm, reporter, task, settings, rows, held_out, counts, writer))


def _rows_of_shards(comm, partition: Partition, settings: Settings, shards: range):
    """Every shard's ``(training, held-out)`` row counts and its training keys' ``position.key_sum``, the ``settings``
    for those rows (every rank: the same steps per epoch), and this rank's ``(training, held-out)`` rows.

    The shards' checks statistics travel with the counts: every rank judges those of all rows (``RowRules.judge``)
    and raises the same error, naming the column, before any step; so does a shard without rows.
    """
    keys = partition.keys
    own = np.array([len(keys), partition.held_out_rows, np.uint64(key_sum(keys)).view(np.int64)], np.int64)
    gathered = comm.allgather(np.concatenate([own, partition.stats.to_array()]))[
        shards.start : shards.stop : shards.step
    ]
    counts = gathered[:, : len(own)]
    rows_per_shard = counts[:, 0].tolist()
    checked = settings.rules.judge(
        RowStats.combined(settings.rules.stats, gathered[:, len(own) :]).values, len(rows_per_shard)
    )
    schedule.require_rows(dict(enumerate(rows_per_shard)))
    settings = settings.for_rows(rows_per_shard)
    if comm.rank == 0:
        schedule.warn_fillers(rows_per_shard, settings.steps_per_epoch)
    return settings, counts, partition.rows(checked.fields)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """One task's place in the stage, handed to ``BarrierPlan.train``, and what the frame does for it: the starting
    point, the writer's checkpointing and progress, the result."""

    comm: Any  # the communicator (sparkdl's, or Horovod's for sync with backend="horovod")
    reporter: TaskReporter
    task: BarrierTask
    settings: Settings  # the task's settings with the shards' exact steps per epoch
    rows: Rows  # this task's training rows
    held_out: Rows  # this task's validation rows
    counts: np.ndarray  # every shard's (training, held-out) row counts and key sum (``position.key_sum``)
    writer: bool  # this rank reports progress, writes the checkpoints and returns the result

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def key_sum(self) -> int:
        """All shards' training rows' ``sparkdl.position.key_sum``."""
        return int(self.counts[:, 2].view(np.uint64).sum(dtype=np.uint64))

    def epoch_rest(self, start: Checkpoint) -> EpochRest | None:
        """Collective: what is left of the epoch ``start`` stopped in (a step checkpoint's), on this rank; None where
        ``start`` is an epoch's end."""
        if start.position is None:
            return None
        plan, size = self.task.plan, self.comm.size
        rest = EpochRest.resume(
            start.position,
            self.rows.keys,
            self.key_sum,
            self.comm,
            batch_size=self.settings.batch_size,
            shards=plan.shard_ranks(size),
            shard=plan.shard_of(self.rank, size),
            by_partition=self.settings.by_partition,
        )
        if self.writer:
            self.reporter.progress(
                {"event": "resumed", "epoch": rest.epoch, "step": start.position.steps, "steps_left": rest.steps_left}
            )
        return rest

    def position_at(self, rest: EpochRest | None, epoch: int, steps: int) -> EpochPosition:
        """Where epoch ``epoch`` stands after ``steps`` of this run's steps in it (``rest``: the epoch resumed)."""
        if rest is not None and epoch == rest.epoch:
            return rest.position_after(steps)
        settings = self.settings
        rows = tuple(self.counts[:, 0].tolist())
        segment = Segment(len(self.counts), rows, settings.steps_per_epoch, steps, settings.by_partition)
        return EpochPosition(epoch, settings.seed, settings.shuffle, self.key_sum, (segment,))

    def step_checkpoints(self, *, every_rank: bool) -> StepCheckpoints | None:
        """When the fit takes step checkpoints, where it is asked to (``Settings.checkpoint_every``, with
        checkpoints): on the writer alone, where it saves alone; else (``every_rank``: the ranks take part in each
        save) on every rank, at the writer's steps (``StepCheckpoints``' agreement). None elsewhere."""
        interval = self.settings.checkpoint_every
        if interval is None or self.task.checkpoints is None or not (every_rank or self.writer):
            return None
        return StepCheckpoints(interval, self._writers_decision if every_rank else None)

    def _writers_decision(self, due: bool) -> bool:
        """Collective: the writer's ``due``, on every rank."""
        return bool(self.comm.broadcast(np.array([due], np.uint8), root=self.writer_rank)[0])

    def checkpoint_stats(self, start: Checkpoint, checkpoints: StepCheckpoints | None) -> dict:
        """The stats every barrier mode reports of its step checkpoints: those it saved and the seconds training
        waited for them (``step_checkpoints``), and where in its epoch it resumed (``resumed_at``: the epoch, its
        steps done, and each segment's shards, steps planned and done), where it did."""
        stats = {}
        if checkpoints is not None:
            stats["step_checkpoints"] = checkpoints.stats()
        if start.position is not None:  # where the epoch stood: the steps a fault cost are the steps since then
            segments = [[s.shards, s.planned, s.done] for s in start.position.segments]
            stats["resumed_at"] = {"epoch": start.epoch, "step": start.position.steps, "segments": segments}
        return stats

    @property
    def writer_rank(self) -> int:
        return self.task.plan.writer(self.comm.size)

    def newer_checkpoint(self) -> Checkpoint | None:
        """Collective: the checkpoint training starts from where it is newer than the driver's start (a stage Spark
        retried after its failed attempt saved one): found by the writer, read by every rank; None where training
        starts from the driver's offer."""
        newer = self._writers_newer_checkpoint()
        found = np.array(newer.place if newer is not None else (-1, 0), np.int64)
        epoch, steps = self.comm.broadcast(found, root=self.writer_rank).tolist()
        if epoch < 0:
            return None
        if newer is None:  # every other rank reads the checkpoint the writer found
            assert self.task.checkpoints is not None
            newer = self.task.checkpoints.read((epoch, steps))
        return newer

    def whole_model_start(self) -> Checkpoint:
        """Collective: the whole model every rank starts from, fetched (or a newer checkpoint read) by the writer and
        broadcast; the history is the writer's only."""
        comm, root, mode = self.comm, self.writer_rank, self.task.plan.mode
        start = None
        if self.writer:
            task = self.task
            start = self._writers_newer_checkpoint() or Checkpoint(
                task.settings.initial_epoch,
                payloads.fetch(self.reporter, MODEL),
                task.start_history,
                mode,
                task.start_arrays,
                position=task.settings.initial_position,
            )
        where = start.position.to_vector() if start and start.position else np.empty(0, np.int64)
        draws = start.arrays.get(random_state.DRAWS, np.empty(0, np.int64)) if start else np.empty(0, np.int64)
        sizes = [len(start.model_bytes), len(where), len(draws)] if start else [0, 0, 0]
        header = comm.broadcast(np.array([start.epoch if start else 0, *sizes], np.int64), root=root)
        own = np.frombuffer(start.model_bytes, np.uint8) if start else np.empty(int(header[1]), np.uint8)
        model = comm.broadcast(own, root=root)
        stood, arrays = None, {}
        if header[2]:
            stood = EpochPosition.from_vector(
                comm.broadcast(where if start else np.empty(int(header[2]), np.int64), root=root)
            )
        if header[3]:
            arrays[random_state.DRAWS] = comm.broadcast(
                draws if start else np.empty(int(header[3]), np.int64), root=root
            )
        return start or Checkpoint(int(header[0]), model.tobytes(), {}, mode, arrays, position=stood)

    def _writers_newer_checkpoint(self) -> Checkpoint | None:
        """On the writer, the newest checkpoint after the driver's start (a retried stage's failed attempt saved it);
        None on the other ranks and where there is none."""
        checkpoints, settings = self.task.checkpoints, self.task.settings
        if not self.writer or checkpoints is None:
            return None
        initial = settings.initial_position.steps if settings.initial_position is not None else 0
        return checkpoints.latest(newer_than=(settings.initial_epoch, initial))

    def part_start(self) -> Checkpoint:
        """The checkpoint of a rank that starts from the driver's offer of its own part of the model (no model
        bytes: ``whole_model`` fetches them where the writer needs them; the start's random state)."""
        task, settings = self.task, self.task.settings
        return Checkpoint(
            settings.initial_epoch,
            b"",
            task.start_history,
            task.plan.mode,
            task.start_arrays,
            position=settings.initial_position,
        )

    def whole_model(self, start: Checkpoint):
        """The whole model of ``start`` (the driver's offer where ``start`` holds no bytes), as a Keras model: the
        writer's, to assemble for its checkpoints and result."""
        model_bytes = start.model_bytes or payloads.fetch(self.reporter, MODEL)
        return serialization.model_from_bytes(model_bytes, self.task.settings.custom_objects)

    @contextlib.contextmanager
    def checkpointing(self, start: Checkpoint) -> Iterator[Checkpointer | None]:
        """The writer's checkpointer (None on the other ranks, and without checkpoints), closed after the block; the
        writer reports the start of training to the driver first."""
        saving = self.task.checkpoints if self.writer else None
        with Checkpointer(saving, start, self.task.plan.mode) if saving else contextlib.nullcontext() as checkpointer:
            if self.writer:
                steps = self.settings.steps_per_epoch
                rows, validation_rows = int(self.counts[:, 0].sum()), int(self.counts[:, 1].sum())
                self.reporter.progress(callbacks.start_event(start.epoch, steps, rows, validation_rows))
            yield checkpointer

    def report_epoch(self, epoch: int, logs: dict, seconds: float) -> None:
        """The writer reports an epoch's end (its combined ``logs``, every shard's rows, its ``seconds``) to the
        driver, for a plan that runs a loop of its own; the other ranks report nothing."""
        if self.writer:
            samples, validation_rows = int(self.counts[:, 0].sum()), int(self.counts[:, 1].sum())
            self.reporter.progress(callbacks.epoch_event(epoch, logs, samples, validation_rows, seconds))

    def progress_callback(self):
        """The writer's Keras callback that reports each epoch (every shard's training and held-out rows) and step to
        the driver, for a plan whose ranks run Keras's ``fit`` on combined metrics; None on the other ranks."""
        if not self.writer:
            return None
        return callbacks.progress_callback(
            self.reporter.progress,
            steps_per_epoch=self.settings.steps_per_epoch,
            rows_per_epoch=int(self.counts[:, 0].sum()),
            validation_rows=int(self.counts[:, 1].sum()),
        )

    def result(self, model_bytes: bytes, history: dict, start: Checkpoint, stats: dict) -> bytes:
        """The writer's result: the trained model, the history it trained from ``start``, the stats, and ``start``'s
        history where it resumed from a newer checkpoint than the driver's."""
        resumed = start.history if start.epoch != self.task.settings.initial_epoch else None
        return serialization.result_to_bytes(model_bytes, history, start.epoch, stats, resumed)
