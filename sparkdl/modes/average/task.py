"""What one worker does in an average-mode round: set the shipped state, train its steps, send its delta.

Python workers are reused between tasks (``spark.python.worker.reuse=true``): the deserialized
model stays cached here between rounds, keyed by the job's token. Every worker runs the batches
of the one schedule (``Settings.batches``, rank = partition index, global steps carried across
rounds), so with plain SGD and ``sync_every=1`` averaging the deltas, weighted by the rows each
worker trained, is exactly sync mode's rows-weighted average of the gradients: the result equals sync mode. A round's metrics come back as rows of its job, each
weighted by the samples behind it (``samples``: rows trained, or held-out rows for ``val_*``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from sparkdl import _compat, schedule
from sparkdl.data import Rows, read_partition
from sparkdl.keras import random_state, serialization
from sparkdl.keras.held_out import in_batches
from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend
from sparkdl.launch.task_context import partition_id
from sparkdl.modes.average.deltas import ROW_FIELDS, Sender
from sparkdl.modes.average.rounds import Rounds

# A round's rows: metrics (partition, epoch, samples, metric, value) and, under Connect, delta chunks.
METRICS_SCHEMA = "partition int, epoch int, samples long, metric string, value double, chunk int, payload binary"
_METRICS_ARROW_SCHEMA = pa.schema(
    [
        ("partition", pa.int32()),
        ("epoch", pa.int32()),
        ("samples", pa.int64()),
        ("metric", pa.string()),
        ("value", pa.float64()),
        *ROW_FIELDS,
    ]
)

_MODEL_CACHE: dict[str, _CachedModel] = {}


@dataclasses.dataclass
class _CachedModel:
    model: Any  # a keras.Model
    variables: list  # model.weights + optimizer.variables, the order of the broadcast state


def state_variables(model) -> list:
    """The variables a round moves: the model's weights, then the optimizer's (built first)."""
    _compat.build_optimizer(model.optimizer, model.trainable_variables)
    return list(model.weights) + _compat.optimizer_variables(model.optimizer)


def read(variable) -> np.ndarray:
    return np.array(variable.numpy(), copy=True)


def round_task(
    batches: Iterable[pa.RecordBatch],
    rounds: Rounds,
    round_index: int,
    model_broadcast,
    state_broadcast,
    sender: Sender,
) -> Iterator[pa.RecordBatch]:
    """One worker's round: set the shipped state, train its steps, send the delta; returns its rows."""
    use_tensorflow_backend()  # before anything in this worker imports Keras
    settings = rounds.settings
    partition = read_partition(settings.rules, batches)
    rank = partition_id()
    schedule.require_rows({rank: len(partition.keys)})
    rows, held_out = partition.own_rows()  # all rows judged by the driver
    cached, state = _load_state(rounds, model_broadcast, state_broadcast)
    out = _empty_rows()
    if settings.validate and round_index > 0:  # the state just set is the averaged model after the last round's epochs
        _evaluate(cached.model, held_out, settings.batch_size, rank, rounds.epochs_finished(round_index - 1), out)
    _seed_round(cached, rounds, rank, round_index)

    model, steps_per_epoch = cached.model, settings.steps_per_epoch
    start, stop = rounds.steps(round_index)
    position, trained, steps = start, 0, 0
    while position < stop:  # one segment per epoch the round touches, its metrics a row each
        epoch = position // steps_per_epoch
        end = min(stop, (epoch + 1) * steps_per_epoch)
        totals: dict[str, float] = {}
        segment = 0
        for batch in settings.batches(rows, position, end, fillers=False):  # empty steps: nothing to train
            logs = model.train_on_batch(*batch, return_dict=True)  # this batch's metrics
            size = _batch_rows(batch)
            for name, value in logs.items():
                totals[name] = totals.get(name, 0.0) + float(value) * size
            segment += size
            steps += 1
        for name, total in totals.items():
            _add_row(out, rank, epoch, segment, name, total / segment)
        trained += segment
        position = end

    # Float deltas go weighted by the rows behind them; the driver divides their sum by all workers' rows.
    delta = [d * trained if np.issubdtype(d.dtype, np.floating) else d for d in _deltas(cached, state)]
    counts = np.zeros((settings.num_workers, 4), np.int64)
    counts[rank] = (1, trained, steps, sum(d.nbytes for d in delta))
    for chunk, payload in sender.send(delta, counts):
        _add_row(out, rank, chunk=chunk, payload=payload)
    return iter([pa.RecordBatch.from_pydict(out, schema=_METRICS_ARROW_SCHEMA)])


def evaluate_task(
    batches: Iterable[pa.RecordBatch], rounds: Rounds, model_broadcast, state_broadcast, epochs: range
) -> Iterator[pa.RecordBatch]:
    """The evaluation-only pass after the last round: the final averaged state on this worker's held-out rows."""
    use_tensorflow_backend()
    partition = read_partition(rounds.settings.rules, batches)
    _, held_out = partition.own_rows()
    out = _empty_rows()
    if len(held_out):
        cached, _ = _load_state(rounds, model_broadcast, state_broadcast)
        _evaluate(cached.model, held_out, rounds.settings.batch_size, partition_id(), epochs, out)
    return iter([pa.RecordBatch.from_pydict(out, schema=_METRICS_ARROW_SCHEMA)])


def _empty_rows() -> dict[str, list]:
    return {name: [] for name in _METRICS_ARROW_SCHEMA.names}


def _add_row(
    rows: dict[str, list], partition: int, epoch=None, samples=None, metric=None, value=None, chunk=None, payload=None
) -> None:
    for column, item in zip(_METRICS_ARROW_SCHEMA.names, (partition, epoch, samples, metric, value, chunk, payload)):
        rows[column].append(item)


def _load_state(rounds: Rounds, model_broadcast, state_broadcast) -> tuple[_CachedModel, list[np.ndarray]]:
    """The worker's cached model, set to the shipped state."""
    cached = _cached_model(rounds, model_broadcast)
    state = state_broadcast.value
    if len(state) != len(cached.variables):
        raise RuntimeError(f"Broadcast state has {len(state)} arrays; the model has {len(cached.variables)} variables.")
    for variable, value in zip(cached.variables, state):
        variable.assign(value)
    return cached, state


def _evaluate(model, held_out: Rows, batch_size: int, rank: int, epochs: range, out: dict[str, list]) -> None:
    """Adds ``val_*`` metric rows for ``epochs``, weighted (``samples`` column) by this worker's held-out rows."""
    if not len(held_out) or not len(epochs):
        return
    logs = model.evaluate(in_batches(held_out, batch_size), verbose=0, return_dict=True)
    for epoch in epochs:
        for name, value in logs.items():
            _add_row(out, rank, epoch, len(held_out), f"val_{name}", float(value))


def _batch_rows(batch: tuple) -> int:
    targets = batch[1]
    return len(next(iter(targets.values())) if isinstance(targets, dict) else targets)


def _deltas(cached: _CachedModel, state: list[np.ndarray]) -> list[np.ndarray]:
    return [_delta(read(variable), old) for variable, old in zip(cached.variables, state)]


def _delta(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    if np.issubdtype(old.dtype, np.floating):
        return new - old  # exact in the variable's dtype while new and old are within 2x (Sterbenz)
    return new.astype(np.int64) - old.astype(np.int64)


def _cached_model(rounds: Rounds, model_broadcast) -> _CachedModel:
    cached = _MODEL_CACHE.get(rounds.token)
    if cached is None:
        _MODEL_CACHE.clear()  # an earlier job's model is done with
        limit_threads_to_task_cpus()
        import keras

        settings = rounds.settings
        keras.utils.set_random_seed((settings.seed + partition_id()) % 2**32)  # as sync mode does
        model = serialization.model_from_bytes(model_broadcast.value, settings.custom_objects)
        cached = _CachedModel(model, state_variables(model))
        _MODEL_CACHE[rounds.token] = cached
    return cached


def _seed_round(cached: _CachedModel, rounds: Rounds, rank: int, round_index: int) -> None:
    """Randomness (dropout and the like) differs per worker and per round, reproducibly from ``seed`` and the round's
    first global step, so that a fit resumed at a checkpoint's step draws what the uninterrupted fit drew.

    Layers draw from their own ``SeedGenerator``, which is set here (``keras.random_state``). The
    global seed is set once per Python worker (``_cached_model``), not here: ``keras.utils.set_random_seed``
    makes TensorFlow retrace the train step, which would cost every round about 0.1-0.5 s.
    """
    first = rounds.steps(round_index)[0]
    random_state.start(cached.model, seed=(rounds.settings.seed << 32) + first, rank=rank)
