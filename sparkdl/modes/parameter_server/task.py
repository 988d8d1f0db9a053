"""What one Spark task does in the parameter-server mode (async, hogwild, ssp).

Keras's ``fit`` runs unchanged; the optimizer hook replaces "apply the
gradients locally" by "push them to the server shards and take the weights
the server holds now". With ``push_every=k`` the gradients of k steps, taken
at the same pulled weights, are averaged into one push (k times fewer round
trips, a k times larger effective batch per update).

Validation (``validation_col``/``validation_split``): a worker evaluates its
own held-out rows at every epoch end with the weights it holds then (the
server's, as of its last pull), through Keras's ``validation_data``; it
returns its held-out row count with its history, and the driver weighs the
workers' ``val_*`` metrics by it (``mode.combine_histories``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from sparkdl import schedule
from sparkdl.data import read_partition
from sparkdl.keras import callbacks, serialization
from sparkdl.keras.held_out import in_batches
from sparkdl.keras.optimizer_hooks import fused_numpy_call, intercept_apply
from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend
from sparkdl.launch import payloads
from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.task_context import partition_id
from sparkdl.modes.base import Settings
from sparkdl.ps.client import ParameterClient
from sparkdl.ps.sharding import ShardLayout

MODEL = "model"  # the name the driver offers the model to start from


@dataclasses.dataclass(frozen=True)
class ParameterServerTask:
    """Everything a task needs but the model, shipped from the driver in the task closure.

    The model, which may be far larger than a closure should be (a Spark Connect message, the driver
    JVM's heap), is fetched from the driver's relay (``payloads.fetch``) by every task.
    """

    settings: Settings
    secret: bytes
    addresses: list[str]
    shards: list[list[int]]
    push_every: int
    encrypt: bool = False  # seal the connections: the session runs with spark.network.crypto.enabled


# What each task counts and returns in its payload; the driver sums them into the fit's stats.
COUNTERS = ("samples", "pushes", "pulls", "bytes")


class _Exchange:
    """The numpy side of a step: accumulate gradients, push every k steps, return the weights to use next."""

    def __init__(self, client: ParameterClient, layout: ShardLayout, push_every: int):
        self._client = client
        self._layout = layout
        self._push_every = push_every
        self._accumulated: np.ndarray | None = None
        self._count = 0
        self.pushes = self.pulls = 0
        self.weights = self._pull()

    def __call__(self, gradient: np.ndarray) -> np.ndarray:
        self._accumulated = gradient.copy() if self._accumulated is None else self._accumulated + gradient
        self._count += 1
        if self._count == self._push_every:
            self.flush()
        return self.weights

    def flush(self) -> None:
        """Pushes what has been accumulated (also the remainder at the end of training)."""
        if self._count and self._accumulated is not None:
            self._client.push(self._layout.split(self._accumulated / self._count))
            self.pushes += 1
            self._accumulated, self._count = None, 0
            self.weights = self._pull()

    def _pull(self) -> np.ndarray:
        self.pulls += 1
        return self._layout.join(self._client.pull())


def run_parameter_server_task(
    batches: Iterable[pa.RecordBatch], reporter: TaskReporter, task: ParameterServerTask
) -> bytes | None:
    """Trains against the server until this worker's share of steps is done, reporting its progress.

    Returns JSON ``{"history": {metric: [per epoch from initial_epoch]}, "samples": per epoch,
    "validation_rows": n, "counters": {name: count for name in COUNTERS}}``.
    """
    use_tensorflow_backend()  # before anything in this worker imports Keras
    import keras
    import tensorflow as tf

    settings = task.settings
    rank = partition_id()
    rows, held_out = read_partition(settings.layout, batches)
    schedule.require_rows({rank: len(rows)})
    settings = settings.for_rows([len(rows)])  # no lockstep: a worker's epoch is its own rows, in its own steps
    limit_threads_to_task_cpus()
    model = serialization.model_from_bytes(payloads.fetch(reporter, MODEL), settings.custom_objects)
    model.jit_compile = False  # the exchange runs through tf.numpy_function, which XLA cannot compile
    variables = model.trainable_variables
    layout = ShardLayout([tuple(v.shape) for v in variables], task.shards)
    samples = len(rows)  # every row once per epoch

    with ParameterClient(
        task.addresses,
        worker=rank,
        secret=task.secret,
        shard_sizes=layout.shard_sizes,
        timeout=settings.timeout,
        encrypt=task.encrypt,
    ) as client:
        exchange = _Exchange(client, layout, task.push_every)

        def push_then_take_server_weights(apply, grads, trainable_variables):
            grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, trainable_variables)]
            for variable, value in zip(trainable_variables, fused_numpy_call(grads, exchange, "sparkdl_exchange")):
                variable.assign(value)
            return model.optimizer.iterations.assign_add(1)

        _assign_flat(variables, exchange.weights)
        stream = settings.batches(rows, rank)
        keras.utils.set_random_seed(settings.seed + rank)  # dropout and the like differ per worker, by design
        reporter.progress(
            {"event": "start", "initial_epoch": settings.initial_epoch, "steps_per_epoch": settings.steps_per_epoch}
        )
        progress = callbacks.progress_callback(
            reporter.progress,
            steps_per_epoch=settings.steps_per_epoch,
            rows_per_epoch=samples,
            validation_rows=len(held_out),
        )
        with intercept_apply(model.optimizer, push_then_take_server_weights):
            history = model.fit(
                stream,
                epochs=settings.epochs,
                initial_epoch=settings.initial_epoch,
                steps_per_epoch=settings.steps_per_epoch,
                shuffle=False,
                verbose=0,
                validation_data=in_batches(held_out, settings.batch_size) if len(held_out) else None,
                callbacks=[progress, *settings.callbacks],
            )
        exchange.flush()
        client.done()
    counters = dict(
        zip(
            COUNTERS,
            (
                (settings.epochs - settings.initial_epoch) * samples,
                exchange.pushes,
                exchange.pulls,
                4 * sum(layout.shard_sizes) * (exchange.pushes + exchange.pulls),
            ),
        )
    )
    return json.dumps(
        {
            "history": {name: [float(v) for v in values] for name, values in history.history.items()},
            "samples": samples,
            "validation_rows": len(held_out),
            "counters": counters,
        }
    ).encode()


def _assign_flat(variables: list, flat: np.ndarray) -> None:
    position = 0
    for variable in variables:
        size = int(np.prod(variable.shape))
        variable.assign(flat[position : position + size].reshape(tuple(variable.shape)))
        position += size
