"""The dataset Keras trains on: each epoch's steps exactly as the chunks' spans cut them, in order, one epoch per
iteration. Real TensorFlow datasets, read the way Keras reads them (a fresh iterator per epoch)."""

import numpy as np
import pytest

from sparkdl.data.read_ahead import Chunk
from sparkdl.keras.epoch_dataset import epoch_dataset, stacked_runs

ROWS = 60


def _fields(rows=ROWS):
    return {
        "x": np.arange(rows * 6, dtype=np.float32).reshape(rows, 2, 3),  # a field of more than one axis
        "name": np.array([f"row {i}".encode() for i in range(rows)], dtype=object),  # a string field
        "y": np.arange(rows, dtype=np.int64),
    }


def _chunks_of(epoch):
    """Spans as the schedule makes them: equal steps, a shorter one, a filler that repeats a row, a chunk alone."""
    fields = _fields()
    offset = 10 * epoch  # each epoch reads other rows, so an epoch served twice would show
    part = {name: array[offset : offset + 20] for name, array in fields.items()}
    yield Chunk(part, [(0, 4), (4, 8), (8, 11), (11, 14), (14, 20)])
    yield Chunk({name: array[offset + 20 : offset + 21] for name, array in fields.items()}, [(0, 1)])
    yield Chunk({name: array[offset + 21 : offset + 27] for name, array in fields.items()}, [(0, 3), (0, 3), (3, 6)])


STEPS = 9


def _expected(epoch):
    rows = []
    for chunk in _chunks_of(epoch):
        for start, stop in chunk.steps:
            rows.append(chunk.arrays["y"][start:stop].tolist())
    return rows


@pytest.mark.parametrize("first_epoch", [0, 2])
def test_each_iteration_is_the_next_epoch_cut_exactly_as_its_spans(first_epoch):
    dataset = epoch_dataset(
        _chunks_of,
        example={name: array[:1] for name, array in _fields().items()},
        to_keras=lambda arrays: ((arrays["x"], arrays["name"]), arrays["y"]),
        first_epoch=first_epoch,
        steps=STEPS,
    )
    assert int(dataset.cardinality()) == STEPS
    for epoch in (first_epoch, first_epoch + 1):
        batches = list(dataset)  # a fresh iterator, as Keras makes one per epoch
        assert [y.numpy().tolist() for _, y in batches] == _expected(epoch)
        for (x, names), y in batches:
            rows = y.numpy()
            assert x.shape == (len(rows), 2, 3)
            np.testing.assert_array_equal(x.numpy(), _fields()["x"][rows])
            assert names.numpy().tolist() == [f"row {i}".encode() for i in rows]


def test_runs_of_equal_consecutive_steps_are_views_stacked_by_step():
    arrays = {"v": np.arange(14, dtype=np.float32).reshape(7, 2)}
    runs = list(stacked_runs(Chunk(arrays, [(0, 2), (2, 4), (4, 5), (5, 6), (5, 6), (6, 7)]), ["v"]))
    assert [run[0].shape for run in runs] == [(2, 2, 2), (2, 1, 2), (2, 1, 2)]  # the filler starts a run of its own
    steps = [step[:, 0].tolist() for run in runs for step in run[0]]
    assert steps == [[0.0, 2.0], [4.0, 6.0], [8.0], [10.0], [10.0], [12.0]]
    assert all(np.shares_memory(run[0], arrays["v"]) for run in runs)  # no copy before TensorFlow's own


def test_the_dataset_runs_without_autotuning():
    """Nothing here is tuned (no parallel map, no prefetch), and under TensorFlow 2.21 a tuned iterator dropped in a
    Python worker that already ran a fit waits for its tuning thread, up to a minute (ps_step.py: a warm async
    fit 84 s where training took 49 s). The options are what Keras's iterator is built with."""
    dataset = epoch_dataset(
        _chunks_of,
        example={name: array[:1] for name, array in _fields().items()},
        to_keras=lambda arrays: (arrays["x"], arrays["y"]),
        first_epoch=0,
        steps=STEPS,
    )
    assert dataset.options().autotune.enabled is False
    assert [y.numpy().tolist() for _, y in dataset] == _expected(0)  # and it still serves the epoch
