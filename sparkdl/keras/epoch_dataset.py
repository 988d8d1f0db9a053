"""Feeds Keras one epoch at a time, from chunks of rows, so that one call can run several steps.

Two costs of a small model's step are Python's, not TensorFlow's: a Python generator handing
Keras one batch at a time, and one call of the compiled train function per step. Here the
rows arrive as *chunks* (many consecutive steps' rows and each step's span of them,
``sparkdl.data.read_ahead.Chunk``), which TensorFlow slices into the steps' batches itself;
and the dataset holds exactly one epoch's steps, iterated anew for each epoch, so that Keras
can run ``steps_per_execution`` steps per call (it stops a call at the end of the data) without
a call ever taking the next epoch's batches: every epoch stays exact.

    >>> dataset = epoch_dataset(lambda epoch: settings.chunks(rows, rank, epoch * steps, (epoch + 1) * steps),
    ...                         example=rows.read(np.arange(1)), to_keras=layout.keras_batch,
    ...                         first_epoch=0, steps=steps)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np


def epoch_dataset(
    chunks_of_epoch: Callable[[int], Iterator],
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
    tensors by field into what ``model.fit`` takes (``Layout.keras_batch``).
    """
    import tensorflow as tf

    epochs = itertools.count(first_epoch)
    names = sorted(example)
    signature = (tuple(_spec(example[name]) for name in names), tf.TensorSpec([None, 2], tf.int64))

    def one_epoch():
        for chunk in chunks_of_epoch(next(epochs)):
            yield tuple(chunk.arrays[name] for name in names), np.asarray(chunk.steps, np.int64)

    def steps_of(arrays, spans):
        def step(span):
            return to_keras({name: array[span[0] : span[1]] for name, array in zip(names, arrays)})

        return tf.data.Dataset.from_tensor_slices(spans).map(step)

    dataset = tf.data.Dataset.from_generator(one_epoch, output_signature=signature).flat_map(steps_of)
    return dataset.apply(tf.data.experimental.assert_cardinality(steps))


def _spec(array: np.ndarray):
    import tensorflow as tf

    dtype = tf.string if array.dtype.kind in "OUS" else tf.as_dtype(array.dtype)
    return tf.TensorSpec((None, *array.shape[1:]), dtype)
