"""Feeds Keras one epoch at a time, from chunks of rows, so that one call can run several steps.

Two costs of a small model's step are Python's, not TensorFlow's: a Python generator handing
Keras one batch at a time, and one call of the compiled train function per step. Here the
rows arrive as *chunks* (many consecutive steps' rows and each step's span of them,
``sparkdl.data.read_ahead.Chunk``); a chunk's run of equal-sized steps goes to TensorFlow as one
``(steps, rows, ...)`` view, which ``unbatch`` cuts into the steps' batches in C++ (no function
called per step, none to build when an epoch's iterator is made). The dataset holds exactly one
epoch's steps, iterated anew for each epoch, so that Keras can run ``steps_per_execution`` steps
per call (it stops a call at the end of the data) without a call ever taking the next epoch's
batches: every epoch stays exact.

The dataset runs without ``tf.data``'s autotuning: it has nothing to tune (no parallel map, no
prefetch), and its thread costs time. Under TensorFlow 2.21, in a Python worker that has already
run a fit (Spark reuses its workers), dropping an iterator that was read for a while waits for that
iterator's autotuning thread to wake on its own, up to its optimization period (a minute at most):
an epoch of 21 s took 41 s, in plain Keras too.

    >>> dataset = epoch_dataset(lambda epoch: settings.chunks(rows, epoch * steps, (epoch + 1) * steps),
    ...                         example=rows.read(np.arange(1)), to_keras=rows.fields.keras_batch,
    ...                         first_epoch=0, steps=steps)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

from sparkdl.data.read_ahead import Chunk


def epoch_dataset(
    chunks_of_epoch: Callable[[int], Iterator[Chunk]],
    *,
    example: dict[str, np.ndarray],
    to_keras: Callable[[dict], tuple],
    first_epoch: int,
    steps: int,
):
    """A ``tf.data.Dataset`` of ``steps`` batches: epoch ``first_epoch``'s the first time it is iterated,
    the next epoch's each time after (Keras iterates a dataset of known length once per epoch).

    ``chunks_of_epoch(epoch)`` yields that epoch's chunks, ``steps`` steps in all; ``example`` holds
    arrays by field like theirs (a string field's as ``bytes`` objects); ``to_keras`` turns one step's
    tensors by field into what ``model.fit`` takes (``Fields.keras_batch``).
    """
    import tensorflow as tf

    epochs = itertools.count(first_epoch)
    names = sorted(example)
    signature = tuple(_spec(example[name]) for name in names)

    def one_epoch():
        for chunk in chunks_of_epoch(next(epochs)):
            yield from stacked_runs(chunk, names)

    def keras_batch(*arrays):
        return to_keras(dict(zip(names, arrays)))

    dataset = tf.data.Dataset.from_generator(one_epoch, output_signature=signature).unbatch().map(keras_batch)
    untuned = tf.data.Options()
    untuned.autotune.enabled = False
    return dataset.apply(tf.data.experimental.assert_cardinality(steps)).with_options(untuned)


def stacked_runs(chunk: Chunk, names: list[str]) -> Iterator[tuple[np.ndarray, ...]]:
    """The chunk's steps as runs of consecutive steps of equal size: per run, the ``names`` fields' rows as
    ``(steps, rows, ...)`` arrays (views of the chunk's), whose items are the run's steps in order."""
    spans = chunk.steps
    first = 0
    while first < len(spans):
        start, stop = spans[first]
        size, last = stop - start, first + 1
        while last < len(spans) and spans[last][0] == spans[last - 1][1] and spans[last][1] - spans[last][0] == size:
            last += 1
        count = last - first
        yield tuple(
            chunk.arrays[name][start : start + count * size].reshape(count, size, *chunk.arrays[name].shape[1:])
            for name in names
        )
        first = last


def _spec(array: np.ndarray):
    import tensorflow as tf

    dtype = tf.string if array.dtype.kind in "OUS" else tf.as_dtype(array.dtype)
    return tf.TensorSpec((None, None, *array.shape[1:]), dtype)
