"""``mode="average"``: periodic model averaging through Spark's own machinery, no sockets of ours.

For executors that cannot reach the driver (or each other) on ports of our own.
Training runs in ROUNDS, each one ordinary (non-barrier) Spark job:

1. The driver broadcasts the current state with ``SparkContext.broadcast``: the
   model's weights AND the optimizer's variables (Adam's moments, the iteration
   count, ...) as a list of numpy arrays, so that every round's local
   optimizers continue where the last round left off. (Under Spark Connect,
   which has no broadcasts, the state and the model travel in the round's task
   closure instead: ``launch.session.ship``.)
2. One task per partition of ``training.frame.repartition(num_workers)``
   (persisted once for the whole job) sets that state on a Keras model cached
   in its Python worker, trains ``sync_every`` steps on its own rows with the
   model's own optimizer, and adds its DELTA (new state - broadcast state) to
   a Spark accumulator over lists of numpy arrays. Per-task counters
   (contributions, samples, steps, delta bytes) go to a second accumulator,
   the round's training metrics come back as Arrow rows of the job. (Under
   Spark Connect, which has no accumulators, the delta and the counters come
   back as binary rows of the same job: ``sparkdl.ps.deltas``.)
3. The driver averages the deltas (sum / number of contributions), applies
   them, drops the old broadcast and broadcasts the new state.

Every worker runs the batches that sync mode's ``data.batches`` would give it
(same ``data.epoch_order``, rank = partition index, global step position
carried across rounds), so with plain SGD and ``sync_every=1`` averaging the
deltas is exactly averaging the gradients: the result equals sync mode.

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

Choosing ``sync_every``: see ``recommended_sync_every`` (half an epoch, with the figures).

Nothing here unpickles data from our own sockets: only Spark's broadcast and
accumulator machinery (under Connect: the job's closure and its result rows,
read with ``allow_pickle=False``) moves state, so executors need not reach the
driver, nor, under Spark Connect, the client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import time
from typing import Iterable, Iterator, Optional

import numpy as np
import pyarrow as pa
from pyspark import StorageLevel, TaskContext

from sparkdl import _compat, data
from sparkdl.checkpoint import BackgroundWriter, Checkpoint, CheckpointStore
from sparkdl.launch import session
from sparkdl.progress import ProgressMonitor
from sparkdl.ps.deltas import ROW_FIELDS, RoundDeltas, Sender
from sparkdl.train import serialization
from sparkdl.train.reporting import merge_histories

logger = logging.getLogger(__name__)

# A round's rows: metrics (partition, epoch, steps, metric, value) and, under Connect, delta chunks.
_METRICS_SCHEMA = "partition int, epoch int, steps int, metric string, value double, chunk int, payload binary"
_METRICS_ARROW_SCHEMA = pa.schema([("partition", pa.int32()), ("epoch", pa.int32()), ("steps", pa.int32()),
                                   ("metric", pa.string()), ("value", pa.float64()), *ROW_FIELDS])
_ROWS_SCHEMA = "partition int, rows long, validation_rows long"
# Columns of the per-partition counter matrix.
_CONTRIBUTIONS, _SAMPLES, _STEPS, _DELTA_BYTES = range(4)

# Python workers are reused between tasks (spark.python.worker.reuse=true): the
# deserialized model stays here between rounds, keyed by the job's token.
_MODEL_CACHE: dict[str, "_CachedModel"] = {}


@dataclasses.dataclass(frozen=True)
class _AverageJob:
    """What every task of every round needs; shipped in the task closure (small)."""

    token: str
    shapes: data.ColumnShapes
    num_workers: int
    batch_size: int
    steps_per_epoch: int
    total_steps: int
    sync_every: int
    seed: int
    shuffle: bool
    custom_objects: Optional[dict]
    validate: bool = False  # rows are held out: evaluate the averaged state at each epoch boundary
    first_step: int = 0  # resumed from a checkpoint: the global step of its epoch's end

    @property
    def rounds(self) -> int:
        return -(-(self.total_steps - self.first_step) // self.sync_every)

    def round_steps(self, round_index: int) -> tuple[int, int]:
        """The global steps ``[start, stop)`` that round ``round_index`` trains."""
        start = self.first_step + round_index * self.sync_every
        return start, min(start + self.sync_every, self.total_steps)

    def epochs_finished(self, round_index: int) -> range:
        """Epochs whose last step falls in round ``round_index``: the averaged state after it is theirs."""
        start, stop = self.round_steps(round_index)
        return range(start // self.steps_per_epoch, stop // self.steps_per_epoch)


@dataclasses.dataclass
class _CachedModel:
    model: object
    variables: list  # model.weights + optimizer.variables, the order of the broadcast state
    seed_states: list  # (variable, initial value) of the layers' own SeedGenerators


def run_average(training: "data.TrainingData", *, model_bytes: bytes, num_workers: int, epochs: int,
                batch_size: int, sync_every: int, seed: int, shuffle: bool, custom_objects: dict | None,
                monitor: Optional[ProgressMonitor] = None, resumed: Optional[Checkpoint] = None,
                checkpoints: Optional[CheckpointStore] = None) -> tuple[bytes, dict[str, list[float]], dict]:
    """Returns (trained model as .keras bytes incl. optimizer state, history, stats).

    With ``resumed`` training starts from that checkpoint's model and optimizer state at the
    first step of its epoch (a checkpoint is the averaged state after the round in which its
    epoch ended, so it may already hold up to ``sync_every - 1`` steps of the next epoch). With
    ``checkpoints`` that state is saved for every epoch once its metrics are complete.

    ``history[name][epoch]`` is the step-weighted mean over workers of the
    training metric over that epoch's steps (like sync mode's history).
    ``stats`` holds ``rounds``, ``samples``, ``steps``, ``delta_bytes`` (summed
    over the tasks whose updates were merged), ``contributions`` (task deltas
    averaged, ``rounds * num_workers`` when nothing went wrong),
    ``steps_per_epoch``, ``sync_every``, ``partition_rows`` (training rows),
    ``partition_validation_rows`` and ``seconds``. With held-out rows the history
    also holds ``val_*``: the averaged model's metrics on them (module docstring).
    """
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    started = time.perf_counter()
    spark = training.frame.sparkSession
    steps_per_epoch = data.steps_per_epoch(training.num_rows, num_workers, batch_size)
    initial_epoch = resumed.epoch if resumed is not None else 0
    job = _AverageJob(
        token=secrets.token_hex(16), shapes=training.shapes, num_workers=num_workers, batch_size=batch_size,
        steps_per_epoch=steps_per_epoch, total_steps=epochs * steps_per_epoch, sync_every=sync_every, seed=seed,
        shuffle=shuffle, custom_objects=custom_objects, validate=training.validation_rows > 0,
        first_step=initial_epoch * steps_per_epoch,
    )
    rounds = job.rounds

    if resumed is not None:
        model_bytes = resumed.model_bytes
    model = serialization.model_from_bytes(model_bytes, custom_objects)
    monitor = monitor or ProgressMonitor(epochs=epochs, steps_per_epoch=steps_per_epoch, reporting_ranks=1)
    variables = _state_variables(model)
    state = [_read(v) for v in variables]
    sums: dict[tuple[str, int], list[float]] = {}  # (metric, epoch) -> [sum of value*steps, steps]
    names: list[str] = []
    writer = BackgroundWriter(checkpoints) if checkpoints is not None else None
    publisher = _EpochPublisher(job, monitor, writer, model, variables, sums, names,
                                resumed.history if resumed is not None else {})

    frame = training.frame.repartition(num_workers).persist(StorageLevel.MEMORY_AND_DISK)
    model_broadcast = session.ship(spark, model_bytes, size=len(model_bytes), what="the model")
    state_bytes = len(model_bytes) + sum(array.nbytes for array in state)  # each round's closure holds both
    state_broadcast = None
    totals = np.zeros(4, np.int64)
    with writer or contextlib.nullcontext():  # waits for the last checkpoint; raises if one was not written
        try:
            partition_rows, validation_rows = _rows_per_partition(frame, num_workers)  # also fills the cache
            logger.info("sparkdl: average mode, %d workers, rows per worker %s, %d steps/epoch x %d epochs, "
                        "%d rounds of %d steps", num_workers, partition_rows, steps_per_epoch, epochs, rounds,
                        sync_every)
            for round_index in range(rounds):
                round_started = time.perf_counter()
                state_broadcast = session.ship(spark, state, size=state_bytes, what="the model and its state")
                deltas = RoundDeltas(spark)

                def round_task(batches, _job=job, _round=round_index, _model=model_broadcast, _state=state_broadcast,
                               _sender=deltas.sender()):
                    return _round_task(batches, _job, _round, _model, _state, _sender)

                table = _compat.collect_arrow(frame.mapInArrow(round_task, _METRICS_SCHEMA))
                delta_sums, counter_sums = deltas.sums(table)
                state = _apply_average(state, delta_sums, counter_sums, num_workers, round_index)
                totals += counter_sums[0].sum(axis=0)
                _add_metrics(table, sums, names)
                state_broadcast.unpersist()
                state_broadcast.destroy()
                state_broadcast = None
                publisher.round_done(round_index, state, time.perf_counter() - round_started)
            if job.validate:  # the last round's epochs: no next round evaluates the final state, so one extra job does
                state_broadcast = session.ship(spark, state, size=state_bytes, what="the model and its state")

                def evaluate_task(batches, _job=job, _model=model_broadcast, _state=state_broadcast):
                    return _evaluate_task(batches, _job, _model, _state, _job.epochs_finished(rounds - 1))

                _add_metrics(_compat.collect_arrow(frame.mapInArrow(evaluate_task, _METRICS_SCHEMA)), sums, names)
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
    history = merge_histories(publisher.earlier_history, publisher.history(range(initial_epoch, epochs)))
    stats = {
        "rounds": rounds,
        "samples": int(totals[_SAMPLES]),
        "steps": int(totals[_STEPS]),
        "delta_bytes": int(totals[_DELTA_BYTES]),
        "contributions": int(totals[_CONTRIBUTIONS]),
        "steps_per_epoch": steps_per_epoch,
        "sync_every": sync_every,
        "partition_rows": partition_rows,
        "partition_validation_rows": validation_rows,
        "seconds": time.perf_counter() - started,
    }
    return serialization.model_to_bytes(model), history, stats


class _EpochPublisher:
    """After each round: progress for the monitor; each epoch whose metrics are complete goes to the
    monitor's epoch listeners and, with the averaged state after the round that ended it, to the
    checkpoints.

    An epoch's training metrics are complete with the round that ends it; its ``val_*`` metrics
    come with the next round's job (or the final evaluation job), which evaluates that state.
    """

    def __init__(self, job: _AverageJob, monitor: ProgressMonitor, writer: Optional[BackgroundWriter], model,
                 variables: list, sums: dict, names: list, earlier_history: dict[str, list[float]]):
        self._job = job
        self._monitor = monitor
        self._writer = writer
        self._model = model
        self._variables = variables
        self._sums = sums
        self._names = names
        self.earlier_history = earlier_history
        self._waiting: Optional[tuple[range, list]] = None  # epochs whose val_* metrics are not in yet, their state
        self._samples_per_second = 0.0

    def history(self, epochs: range) -> dict[str, list[float]]:
        return {name: [self._sums[name, e][0] / self._sums[name, e][1] if (name, e) in self._sums else float("nan")
                       for e in epochs] for name in self._names}

    def round_done(self, round_index: int, state: list, seconds: float) -> None:
        job = self._job
        start, stop = job.round_steps(round_index)
        self._samples_per_second = (stop - start) * job.batch_size * job.num_workers / max(seconds, 1e-9)
        epoch = (stop - 1) // job.steps_per_epoch
        logs = {name: values[0] for name, values in self.history(range(epoch, epoch + 1)).items()
                if not name.startswith("val_")}
        self._monitor.step(0, epoch, stop - epoch * job.steps_per_epoch, logs, self._samples_per_second)
        logger.debug("sparkdl: round %d of %d took %.3f s", round_index + 1, job.rounds, seconds)
        finished = job.epochs_finished(round_index)
        if job.validate:
            self.finish()
            self._waiting = (finished, state) if len(finished) else None
        elif len(finished):
            self._publish(finished, state)

    def finish(self) -> None:
        """Publishes the epochs still waiting for their validation metrics."""
        if self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            self._publish(*waiting)

    def _publish(self, epochs: range, state: list) -> None:
        first = self._job.first_step // self._job.steps_per_epoch
        history = self.history(range(first, epochs[-1] + 1))
        for epoch in epochs:
            self._monitor.epoch_end(epoch, {name: values[epoch - first] for name, values in history.items()},
                                    self._samples_per_second)
        if self._writer is not None:
            _assign(self._variables, state)
            self._writer.save(Checkpoint(epochs[-1] + 1, serialization.model_to_bytes(self._model),
                                         merge_histories(self.earlier_history, history), "average"))


def _assign(variables: list, values: list) -> None:
    for variable, value in zip(variables, values):
        variable.assign(value)


def _state_variables(model) -> list:
    """The variables a round moves: the model's weights, then the optimizer's (built first)."""
    _compat.build_optimizer(model.optimizer, model.trainable_variables)
    return list(model.weights) + _compat.optimizer_variables(model.optimizer)


def _read(variable) -> np.ndarray:
    return np.array(variable.numpy(), copy=True)


def _rows_per_partition(frame, num_workers: int) -> tuple[list[int], list[int]]:
    """Training and held-out rows of each worker's partition; fails before training when one has no training
    rows, as sync mode does."""

    def count(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        rows, held_out = data.row_counts(batches)
        yield pa.RecordBatch.from_pydict(
            {"partition": [TaskContext.get().partitionId()], "rows": [rows], "validation_rows": [held_out]},
            schema=pa.schema([("partition", pa.int32()), ("rows", pa.int64()), ("validation_rows", pa.int64())]))

    table = _compat.collect_arrow(frame.mapInArrow(count, _ROWS_SCHEMA))
    partitions = table.column("partition").to_pylist()
    by_partition = dict(zip(partitions, table.column("rows").to_pylist()))
    held_out_by_partition = dict(zip(partitions, table.column("validation_rows").to_pylist()))
    rows = [int(by_partition.get(p, 0)) for p in range(num_workers)]
    held_out = [int(held_out_by_partition.get(p, 0)) for p in range(num_workers)]
    if min(rows) == 0:
        raise ValueError(f"Worker partitions got {rows} training rows: every worker needs at least one row. "
                         "Use fewer workers or more data.")
    return rows, held_out


def _apply_average(state: list[np.ndarray], delta_sums: list, counter_sums: list, num_workers: int,
                   round_index: int) -> list[np.ndarray]:
    if not counter_sums or not delta_sums:
        raise RuntimeError(f"Round {round_index}: no task delta reached the driver.")
    contributions = counter_sums[0][:, _CONTRIBUTIONS]
    if contributions.min() == 0:
        raise RuntimeError(f"Round {round_index}: partitions {np.flatnonzero(contributions == 0).tolist()} "
                           "contributed no delta.")
    if contributions.max() != 1:
        logger.warning("sparkdl: round %d merged %s deltas per partition; averaging over all of them",
                       round_index, contributions.tolist())
    if len(delta_sums) != len(state):
        raise RuntimeError(f"Round {round_index}: workers sent {len(delta_sums)} arrays for {len(state)} variables.")
    n = int(contributions.sum())
    updated = []
    for old, total in zip(state, delta_sums):
        if np.issubdtype(old.dtype, np.floating):
            new = old.astype(np.float64) + np.asarray(total, np.float64) / n
        else:  # iteration counters: every worker adds the same count
            new = old.astype(np.int64) + np.rint(np.asarray(total, np.float64) / n).astype(np.int64)
        updated.append(new.astype(old.dtype))
    return updated


def _add_metrics(table: pa.Table, sums: dict, names: list) -> None:
    for epoch, steps, name, value in zip(*(table.column(c).to_pylist() for c in ("epoch", "steps", "metric", "value"))):
        if name is None:  # a row of a delta (Spark Connect), not a metric
            continue
        if name not in names:
            names.append(name)
        entry = sums.setdefault((name, epoch), [0.0, 0])
        entry[0] += value * steps
        entry[1] += steps


# ---------------------------------------------------------------------------------------------
# Worker side


def _round_task(batches: Iterable[pa.RecordBatch], job: _AverageJob, round_index: int, model_broadcast,
                state_broadcast, sender: Sender) -> Iterator[pa.RecordBatch]:
    """One worker's round: set the shipped state, train its steps, send the delta; returns its rows."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # before anything in this worker imports Keras
    x, y, x_val, y_val = job.shapes.split_numpy(batches)
    rank = TaskContext.get().partitionId()
    if len(x) == 0:
        raise ValueError(f"Worker partition {rank} got no training rows: every worker needs at least one row.")
    cached, state = _load_state(job, model_broadcast, state_broadcast)
    rows = _empty_rows()
    if job.validate and round_index > 0:  # the state just set is the averaged model after the last round's epochs
        _evaluate(cached.model, x_val, y_val, job, rank, job.epochs_finished(round_index - 1), rows)
    _seed_round(cached, job, rank, round_index)

    model, b, steps_per_epoch = cached.model, job.batch_size, job.steps_per_epoch
    start, stop = job.round_steps(round_index)
    position = start
    while position < stop:  # one segment per epoch the round touches
        epoch = position // steps_per_epoch
        end = min(stop, (epoch + 1) * steps_per_epoch)
        order = data.epoch_order(len(x), steps_per_epoch * b, seed=job.seed, rank=rank, epoch=epoch,
                                 shuffle=job.shuffle)
        totals: dict[str, float] = {}
        for step in range(position - epoch * steps_per_epoch, end - epoch * steps_per_epoch):
            index = order[step * b:(step + 1) * b]
            logs = model.train_on_batch(x[index], y[index], return_dict=True)  # this batch's metrics
            for name, value in logs.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        for name, total in totals.items():
            _add_row(rows, rank, epoch, end - position, name, total / (end - position))
        position = end

    delta = [_delta(_read(variable), old) for variable, old in zip(cached.variables, state)]
    counts = np.zeros((job.num_workers, 4), np.int64)
    counts[rank] = (1, (stop - start) * b, stop - start, sum(d.nbytes for d in delta))
    for chunk, payload in sender.send(delta, counts):
        _add_row(rows, rank, chunk=chunk, payload=payload)
    return iter([pa.RecordBatch.from_pydict(rows, schema=_METRICS_ARROW_SCHEMA)])


def _empty_rows() -> dict[str, list]:
    return {name: [] for name in _METRICS_ARROW_SCHEMA.names}


def _add_row(rows: dict[str, list], partition: int, epoch=None, steps=None, metric=None, value=None, chunk=None,
             payload=None) -> None:
    for column, item in zip(_METRICS_ARROW_SCHEMA.names, (partition, epoch, steps, metric, value, chunk, payload)):
        rows[column].append(item)


def _evaluate_task(batches: Iterable[pa.RecordBatch], job: _AverageJob, model_broadcast, state_broadcast,
                   epochs: range) -> Iterator[pa.RecordBatch]:
    """The evaluation-only pass after the last round: the final averaged state on this worker's held-out rows."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    _, _, x_val, y_val = job.shapes.split_numpy(batches)
    rows = _empty_rows()
    if len(x_val):
        cached, _ = _load_state(job, model_broadcast, state_broadcast)
        _evaluate(cached.model, x_val, y_val, job, TaskContext.get().partitionId(), epochs, rows)
    return iter([pa.RecordBatch.from_pydict(rows, schema=_METRICS_ARROW_SCHEMA)])


def _load_state(job: _AverageJob, model_broadcast, state_broadcast) -> tuple[_CachedModel, list[np.ndarray]]:
    """The worker's cached model, set to the shipped state."""
    cached = _cached_model(job, model_broadcast)
    state = state_broadcast.value
    if len(state) != len(cached.variables):
        raise RuntimeError(f"Broadcast state has {len(state)} arrays; the model has {len(cached.variables)} variables.")
    for variable, value in zip(cached.variables, state):
        variable.assign(value)
    return cached, state


def _evaluate(model, x_val: np.ndarray, y_val: np.ndarray, job: _AverageJob, rank: int, epochs: range,
              rows: dict[str, list]) -> None:
    """Adds ``val_*`` metric rows for ``epochs``, weighted (``steps`` column) by this worker's held-out rows."""
    if not len(x_val) or not len(epochs):
        return
    logs = model.evaluate(x_val, y_val, batch_size=job.batch_size, verbose=0, return_dict=True)
    for epoch in epochs:
        for name, value in logs.items():
            _add_row(rows, rank, epoch, len(x_val), f"val_{name}", float(value))


def _delta(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    if np.issubdtype(old.dtype, np.floating):
        return new - old  # exact in the variable's dtype while new and old are within 2x (Sterbenz)
    return new.astype(np.int64) - old.astype(np.int64)


def _cached_model(job: _AverageJob, model_broadcast) -> _CachedModel:
    cached = _MODEL_CACHE.get(job.token)
    if cached is None:
        from sparkdl.train.task import limit_threads_to_task_cpus

        _MODEL_CACHE.clear()  # an earlier job's model is done with
        limit_threads_to_task_cpus()
        import keras

        keras.utils.set_random_seed((job.seed + TaskContext.get().partitionId()) % 2**32)  # as sync mode does
        model = serialization.model_from_bytes(model_broadcast.value, job.custom_objects)
        seed_states = [(v, _read(v)) for v in model.non_trainable_variables if v.path.endswith("seed_generator_state")]
        cached = _CachedModel(model, _state_variables(model), seed_states)
        _MODEL_CACHE[job.token] = cached
    return cached


def _seed_round(cached: _CachedModel, job: _AverageJob, rank: int, round_index: int) -> None:
    """Randomness (dropout and the like) differs per worker and per round, reproducibly from ``seed``.

    Layers draw from their own ``SeedGenerator`` (state ``[seed, counter]``), which is set here. The
    global seed is set once per Python worker (``_cached_model``), not here: ``keras.utils.set_random_seed``
    makes TensorFlow retrace the train step, which would cost every round about 0.1-0.5 s.
    """
    mix = (job.seed + rank + job.num_workers * round_index) % 2**31
    for variable, initial in cached.seed_states:
        value = initial.astype(np.int64)
        value[0] = (value[0] + 7919 * (mix + 1)) % 2**31
        variable.assign(value.astype(initial.dtype))


def recommended_sync_every(steps_per_epoch: int) -> int:
    """The suggested default period: half an epoch's steps, i.e. two averages per epoch.

    Measured on digits (1437 rows, the 64-128-64-10 MLP with Adam, 2 workers x batch 16 = 45
    steps/epoch, 20 epochs, 2-core machine, 2 seeds): test accuracy 97.2% / 96.9% with rounds of
    one epoch (20 rounds, 10-11 s), 97.5% / 97.5% with half an epoch (40 rounds, 16-17 s), 97.8% /
    96.7% with a quarter (82 rounds, 28-32 s), 98.1% with 5 steps (180 rounds, 58 s, one seed);
    sync mode 97.8% in 5 s. Accuracy barely moves while every round costs one Spark job
    (0.3-0.5 s here), so the period should be long; half an epoch keeps the workers' models from
    drifting apart for more than half a pass over their data. Go longer when a step is cheap
    compared to a Spark job, shorter for partitions that differ in distribution.
    """
    return max(1, -(-steps_per_epoch // 2))
