"""Average mode's driver side: rounds of Spark jobs whose deltas the driver averages, no sockets of ours.

For executors that cannot reach the driver (or each other) on ports of our own.
Training runs in ROUNDS, each one ordinary (non-barrier) Spark job:

1. The driver broadcasts the current state with ``SparkContext.broadcast``: the
   model's weights AND the optimizer's variables (Adam's moments, the iteration
   count, ...) as a list of numpy arrays, so that every round's local
   optimizers continue where the last round left off. (Under Spark Connect,
   which has no broadcasts, the state and the model travel in the round's task
   closure instead: ``launch.session.ship``.)
2. One task per partition of the rows dealt to ``num_workers`` (``launch.layout.task_input``)
   (persisted once for the whole job) sets that state on a Keras model cached
   in its Python worker, trains ``sync_every`` steps on its own rows with the
   model's own optimizer, and adds its DELTA (new state - broadcast state) to
   a Spark accumulator over lists of numpy arrays. Per-task counters
   (contributions, samples, steps, delta bytes) go to a second accumulator,
   the round's training metrics come back as Arrow rows of the job. (Under
   Spark Connect, which has no accumulators, the delta and the counters come
   back as binary rows of the same job: ``deltas.py``.)
3. The driver averages the deltas (sum / number of contributions), applies
   them, drops the old broadcast and broadcasts the new state.

All of it passes through the driver's JVM: before its first job the mode refuses a
model whose state and deltas the driver cannot carry (``capacity.py``).

Accumulators and task retries (checked against PySpark 4 in local mode, see
``tests/test_average_mode.py::test_failed_attempts_are_not_double_counted``):
a Python task that raises exits its worker before sending any accumulator
update (``pyspark/worker.py`` sends them only after the function returned),
and the JVM merges the updates of failed tasks only for accumulators with
``countFailedValues`` (internal metrics, not Python's). Updates of a
successful task are merged on the driver before the job returns, and for the
result stage each partition's only once, even with speculative copies
(``DAGScheduler`` skips partitions whose job output is already finished). Our
deltas are added in the result stage (the persisted repartition is read
inside it), so a retried task's delta counts once. The average is
nevertheless divided by the contributions actually merged (counted per
partition in the counter accumulator), so that a double-counted or missing
update can never scale the step, and a discrepancy is logged.

Validation (``validation_col``/``validation_split``): the ``val_*`` metrics
of an epoch describe the AVERAGED model, never a worker's local one. The
averaged state after the round in which an epoch's last step falls is
already broadcast to the next round's tasks, so each of them first
evaluates its held-out rows with that state (before training; a forward
pass over a few rows, no extra job) and returns the metrics as rows
attributed to that epoch, weighted by its held-out row count; the driver
combines them like the training metrics. The last round has no next round:
one extra evaluation-only job over the persisted frame evaluates the final
state for it, so the last epoch's ``val_*`` metrics are those of the
returned model. When an epoch ends inside a round (``sync_every`` not a
divisor of the epoch's steps) no averaged model exists at that exact step:
the epoch gets the first averaged model after it (the end of that round, at
most ``sync_every - 1`` steps later); epochs that end inside the same round
share its value. With ``sync_every`` dividing ``steps_per_epoch`` (or a
multiple of it) the evaluated model is exactly the one at the epoch's end.

Choosing ``sync_every``: see ``rounds.recommended_sync_every`` (half an epoch, with the figures).

Nothing here unpickles data from our own sockets: only Spark's broadcast and
accumulator machinery (under Connect: the job's closure and its result rows,
read with ``allow_pickle=False``) moves state, so executors need not reach the
driver, nor, under Spark Connect, the client.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import pyarrow as pa
from pyspark import StorageLevel

from sparkdl import _compat, data
from sparkdl.checkpoint import Checkpointer, StepCheckpoints
from sparkdl.keras import serialization
from sparkdl.launch import session
from sparkdl.launch.layout import task_input
from sparkdl.launch.task_context import partition_id
from sparkdl.metrics import weighted_mean
from sparkdl.modes.average import capacity
from sparkdl.modes.average import rounds as schedule
from sparkdl.modes.average.deltas import RoundDeltas
from sparkdl.modes.average.task import METRICS_SCHEMA, evaluate_task, read, round_task, state_variables
from sparkdl.modes.base import Job, Mode, ModeResult, Option, Plan, Settings
from sparkdl.position import key_sum
from sparkdl.progress import ProgressMonitor
from sparkdl.schedule import require_rows

logger = logging.getLogger(__name__)

_ROWS_SCHEMA = "partition int, rows long, validation_rows long, key_sum long, stats array<long>"


SYNC_EVERY = Option("sync_every", "local steps between two averagings (default: half an epoch's steps)")


@dataclasses.dataclass(frozen=True)
class AveragePlan(Plan):
    """Workers train ``sync_every`` local steps, then the driver averages their models (and optimizer state).

    It trains with ``train_on_batch`` in rounds, not Keras's ``fit``: no user callbacks. The
    driver reports progress and writes the checkpoints, each epoch once its metrics are complete, and step
    checkpoints after the rounds where ``checkpoint_every`` is due.
    """

    sync_every: int | None = None  # local steps between two averagings (None: half an epoch)

    runs_callbacks: ClassVar[bool] = False
    saves_step_checkpoints: ClassVar[bool] = True
    resumes_on_other_workers: ClassVar[bool] = False  # its tasks share no collective (``rounds.position_step``)
    reads_rows_in_its_stage: ClassVar[bool] = False  # its rounds read the rows Spark persisted

    def why_all_at_once(self, slots: int) -> str:
        return (
            f"In mode='average' the tasks of every round would run in waves of {slots}, each round taking "
            "that many times longer"
        )

    def run(self, job: Job) -> ModeResult:
        """Trains in rounds from ``job.start``; the model returned holds the averaged weights and optimizer state.

        A checkpoint is the averaged state after the round in which its epoch ended, so it may
        already hold up to ``sync_every - 1`` steps of the next epoch, or (``checkpoint_every``) after a round
        inside an epoch; its position says where the epoch stands (``Rounds.position``), and a resumed fit, on the
        same workers and rows, continues from it with the same rounds as an uninterrupted fit (the resumed
        epoch's training metrics then cover the steps after it). ``history[name][epoch]`` is the sample-weighted mean over workers
        of the training metric over that epoch's steps (like sync mode's history). ``stats`` holds
        ``rounds``, ``samples``, ``steps``, ``delta_bytes`` (summed over the tasks whose updates
        were merged), ``contributions`` (task deltas averaged, ``rounds * num_workers`` when nothing
        went wrong), ``steps_per_epoch``, ``sync_every``, ``partition_rows`` (training rows),
        ``partition_validation_rows`` and ``seconds``. With held-out rows the history also holds
        ``val_*``: the averaged model's metrics on them (module docstring).
        """
        started = time.perf_counter()
        spark = job.training.frame.sparkSession
        model = serialization.model_from_bytes(job.start.model_bytes, job.settings.custom_objects)
        variables = state_variables(model)
        state = [read(v) for v in variables]
        capacity.check(spark, sum(array.nbytes for array in state), job.settings.num_workers)  # before any job
        frame = task_input(job.training.frame, job.layout).persist(StorageLevel.MEMORY_AND_DISK)
        try:
            partition_rows, validation_rows, key_sum = _rows_per_partition(frame, job.settings)
            settings = job.settings.for_rows(partition_rows)  # the rounds' common steps per epoch
            position = job.start.position
            if position is not None:  # the rest of its epoch in the order it was taken in
                settings = dataclasses.replace(settings, seed=position.seed, shuffle=position.shuffle)
                first_step = schedule.position_step(settings, job.start, partition_rows, key_sum)
            else:
                first_step = schedule.resume_step(settings, job.start.step)
        except BaseException:
            frame.unpersist()
            raise
        job.monitor.steps_known(0, settings.steps_per_epoch)
        job.monitor.rows_known(0, sum(partition_rows), sum(validation_rows))
        sync_every = self.sync_every or schedule.recommended_sync_every(settings.steps_per_epoch)
        rounds = schedule.Rounds(
            settings, secrets.token_hex(16), sync_every, first_step, tuple(partition_rows), key_sum
        )
        metrics = _Metrics()
        publisher = _EpochPublisher(rounds, job.monitor, job.checkpointer, model, variables, metrics)

        model_broadcast = session.ship(spark, job.start.model_bytes, size=len(job.start.model_bytes), what="the model")
        state_bytes = len(job.start.model_bytes) + sum(array.nbytes for array in state)  # each round ships both
        state_broadcast = None
        totals = np.zeros(4, np.int64)
        try:
            logger.info(
                "sparkdl: average mode, %d workers, rows per worker %s, %d steps/epoch x %d epochs, "
                "%d rounds of %d steps",
                settings.num_workers,
                partition_rows,
                settings.steps_per_epoch,
                settings.epochs,
                rounds.count,
                sync_every,
            )
            for round_index in range(rounds.count):
                round_started = time.perf_counter()
                state_broadcast = session.ship(spark, state, size=state_bytes, what="the model and its state")
                deltas = RoundDeltas(spark)
                sender = deltas.sender()

                def run_round(
                    batches,
                    _rounds=rounds,
                    _round=round_index,
                    _model=model_broadcast,
                    _state=state_broadcast,
                    _sender=sender,
                ):
                    return round_task(batches, _rounds, _round, _model, _state, _sender)

                table = _compat.collect_arrow(frame.mapInArrow(run_round, METRICS_SCHEMA))
                delta_sums, counter_sums = deltas.sums(table)
                state = schedule.apply_average(state, delta_sums, counter_sums, round_index)
                totals += counter_sums[0].sum(axis=0)
                metrics.add(table)
                state_broadcast.unpersist()
                state_broadcast.destroy()
                state_broadcast = None
                publisher.round_done(round_index, state, time.perf_counter() - round_started)
            if settings.validate:  # the last round's epochs: no next round evaluates the final state; one job does
                state_broadcast = session.ship(spark, state, size=state_bytes, what="the model and its state")
                last = rounds.epochs_finished(rounds.count - 1)

                def evaluate(batches, _rounds=rounds, _model=model_broadcast, _state=state_broadcast, _last=last):
                    return evaluate_task(batches, _rounds, _model, _state, _last)

                metrics.add(_compat.collect_arrow(frame.mapInArrow(evaluate, METRICS_SCHEMA)))
                state_broadcast.unpersist()
                state_broadcast.destroy()
                state_broadcast = None
            publisher.finish()
        finally:
            if state_broadcast is not None:
                state_broadcast.destroy()
            model_broadcast.destroy()
            frame.unpersist()

        _assign(variables, state)
        history = metrics.history(range(settings.initial_epoch, settings.epochs))
        stats: dict = {
            "rounds": rounds.count,
            "samples": int(totals[schedule.SAMPLES]),
            "steps": int(totals[schedule.STEPS]),
            "delta_bytes": int(totals[schedule.DELTA_BYTES]),
            "contributions": int(totals[schedule.CONTRIBUTIONS]),
            "steps_per_epoch": settings.steps_per_epoch,
            "sync_every": sync_every,
            "partition_rows": partition_rows,
            "partition_validation_rows": validation_rows,
            "seconds": time.perf_counter() - started,
        }
        if (step_checkpoints := publisher.step_checkpoints()) is not None:
            stats["step_checkpoints"] = step_checkpoints
        if position is not None:  # where the epoch stood: the steps a fault cost are the steps since then
            segments = [[s.shards, s.planned, s.done] for s in position.segments]
            stats["resumed_at"] = {"epoch": position.epoch, "step": position.steps, "segments": segments}
        return ModeResult(model, history, stats, settings.initial_epoch)


class AverageMode(Mode):
    """No server and no sockets: every ``sync_every`` local steps the driver averages the workers' weights and
    optimizer state (Spark broadcasts and task results).

    ``mode="average"``: :class:`AveragePlan`.
    """

    names = ("average",)

    def options(self, name: str) -> tuple[Option, ...]:
        return (SYNC_EVERY,)

    def configure(self, name: str, model, values: dict) -> AveragePlan:
        return AveragePlan.from_values(name, values)


class _Metrics:
    """The rounds' metric rows, combined per (metric, epoch) by the one rule (``metrics.weighted_mean``)."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, int], list[tuple[float, int]]] = {}  # (metric, epoch) -> [(value, samples)]
        self._names: list[str] = []

    def add(self, table: pa.Table) -> None:
        columns = (table.column(c).to_pylist() for c in ("epoch", "samples", "metric", "value"))
        for epoch, samples, name, value in zip(*columns):
            if name is None:  # a row of a delta (Spark Connect), not a metric
                continue
            if name not in self._names:
                self._names.append(name)
            self._values.setdefault((name, epoch), []).append((value, samples))

    def history(self, epochs: range) -> dict[str, list[float]]:
        return {name: [weighted_mean(self._values.get((name, epoch), ())) for epoch in epochs] for name in self._names}


class _EpochPublisher:
    """After each round: progress for the monitor; each epoch whose metrics are complete goes to the
    monitor's epoch listeners and, with the averaged state after the round that ended it, to the
    checkpointer; and, every ``checkpoint_every``, the averaged state after a round inside an epoch (a step
    checkpoint).

    An epoch's training metrics are complete with the round that ends it; its ``val_*`` metrics
    come with the next round's job (or the final evaluation job), which evaluates that state. A
    checkpoint's position is the averaged state's global step (``Rounds.position``): a state taken
    after the round that ended an epoch may already hold steps of the next one.
    """

    def __init__(
        self,
        rounds: schedule.Rounds,
        monitor: ProgressMonitor,
        checkpointer: Checkpointer | None,
        model,
        variables: list,
        metrics: _Metrics,
    ):
        self._rounds = rounds
        self._monitor = monitor
        self._checkpointer = checkpointer
        self._model = model
        self._variables = variables
        self._metrics = metrics
        self._waiting: tuple[range, list, int] | None = None  # epochs awaiting val_* metrics, their state, its step
        self._samples_per_second = 0.0
        interval = rounds.settings.checkpoint_every
        self._step_checkpoints = StepCheckpoints(interval) if interval is not None and checkpointer else None

    def round_done(self, round_index: int, state: list, seconds: float) -> None:
        settings = self._rounds.settings
        start, stop = self._rounds.steps(round_index)
        self._samples_per_second = self._rounds.rows(start, stop) / max(seconds, 1e-9)
        epoch = (stop - 1) // settings.steps_per_epoch
        logs = {
            name: values[0]
            for name, values in self._metrics.history(range(epoch, epoch + 1)).items()
            if not name.startswith("val_")
        }
        self._monitor.step(0, epoch, stop - epoch * settings.steps_per_epoch, logs, self._samples_per_second)
        logger.debug("sparkdl: round %d of %d took %.3f s", round_index + 1, self._rounds.count, seconds)
        finished = self._rounds.epochs_finished(round_index)
        if settings.validate:
            self.finish()
            self._waiting = (finished, state, stop) if len(finished) else None
        elif len(finished):
            self._publish(finished, state, stop)
        if not len(finished) and self._step_checkpoint_due(stop):  # (an epoch's own checkpoint holds that state)
            assert self._step_checkpoints is not None
            with self._step_checkpoints.saving():
                self._save(state, stop)

    def finish(self) -> None:
        """Publishes the epochs still waiting for their validation metrics."""
        if self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            self._publish(*waiting)

    def step_checkpoints(self) -> dict | None:
        """The step checkpoints saved, and the seconds the rounds waited for them (the model's serialization; the
        storage is written in the background); None where the fit saves none."""
        return self._step_checkpoints.stats() if self._step_checkpoints is not None else None

    def _step_checkpoint_due(self, step: int) -> bool:
        """Whether a step checkpoint is due after the round that ended at global ``step``."""
        if self._step_checkpoints is None:
            return False
        steps_per_epoch = self._rounds.settings.steps_per_epoch
        epoch = step // steps_per_epoch
        start = max(self._rounds.first_step, epoch * steps_per_epoch)  # this fit's first step of the epoch
        return self._step_checkpoints.due(epoch, step - start, (epoch + 1) * steps_per_epoch - start)

    def _publish(self, epochs: range, state: list, step: int) -> None:
        """Epochs ``epochs`` are complete; ``state`` is the averaged state at global ``step``."""
        history = self._metrics.history(epochs)
        for index, epoch in enumerate(epochs):
            logs = {name: values[index] for name, values in history.items()}
            self._monitor.epoch_end(epoch, logs, self._samples_per_second)
            if self._checkpointer is not None:
                self._checkpointer.record(logs)
        if self._checkpointer is not None:
            self._save(state, step)

    def _save(self, state: list, step: int) -> None:
        """Saves ``state``, the averaged state at global ``step``, after the epochs complete then."""
        assert self._checkpointer is not None
        _assign(self._variables, state)
        epochs = step // self._rounds.settings.steps_per_epoch
        self._checkpointer.save(epochs, serialization.model_to_bytes(self._model), position=self._rounds.position(step))


def _assign(variables: list, values: list) -> None:
    for variable, value in zip(variables, values):
        variable.assign(value)


def _rows_per_partition(frame, settings: Settings) -> tuple[list[int], list[int], int]:
    """Training and held-out rows of each worker's partition, and all training rows' ``position.key_sum``, counted in
    one pass that also reduces the rows' checks, which the driver judges (``RowRules.judge``: an error naming the
    column) before any round trains; the rule of at least one training row per worker too."""
    rules = settings.rules

    def count(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        partition = data.read_partition(rules, batches, spill=False)
        yield pa.RecordBatch.from_pydict(
            {
                "partition": [partition_id()],
                "rows": [len(partition.keys)],
                "validation_rows": [partition.held_out_rows],
                "key_sum": [int(np.uint64(key_sum(partition.keys)).view(np.int64))],
                "stats": [partition.stats.to_array().tolist()],
            },
            schema=pa.schema(
                [
                    ("partition", pa.int32()),
                    ("rows", pa.int64()),
                    ("validation_rows", pa.int64()),
                    ("key_sum", pa.int64()),
                    ("stats", pa.list_(pa.int64())),
                ]
            ),
        )

    table = _compat.collect_arrow(frame.mapInArrow(count, _ROWS_SCHEMA))
    stats = data.RowStats.combined(rules.stats, (np.array(s, np.int64) for s in table.column("stats").to_pylist()))
    rules.judge(stats.values, settings.num_workers)
    partitions = table.column("partition").to_pylist()
    by_partition = dict(zip(partitions, table.column("rows").to_pylist()))
    held_out_by_partition = dict(zip(partitions, table.column("validation_rows").to_pylist()))
    rows = [int(by_partition.get(p, 0)) for p in range(settings.num_workers)]
    held_out = [int(held_out_by_partition.get(p, 0)) for p in range(settings.num_workers)]
    require_rows(dict(enumerate(rows)))
    sums = np.array(table.column("key_sum").to_pylist(), np.int64).view(np.uint64)
    return rows, held_out, int(sums.sum(dtype=np.uint64))
