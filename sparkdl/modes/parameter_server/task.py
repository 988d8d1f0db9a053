"""What one Spark task does in the parameter-server mode (async, hogwild, ssp).

Keras's ``fit`` runs unchanged; the optimizer hook replaces "apply the
gradients locally" by "push them to the server shards and take the weights
the server holds now" (``exchange.py``). With ``push_every=k`` the gradients of
k steps, taken at the same pulled weights, are averaged into one push (k times
fewer round trips, a k times larger effective batch per update). With
``compression`` the pushes travel at half the bytes; the pulled weights are
float32.

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

import pyarrow as pa

from sparkdl import schedule
from sparkdl.data import read_partition
from sparkdl.keras import callbacks, serialization
from sparkdl.keras.held_out import in_batches
from sparkdl.keras.optimizer_hooks import intercept_apply
from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend
from sparkdl.launch import payloads
from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.task_context import partition_id
from sparkdl.modes.base import Settings
from sparkdl.modes.parameter_server.exchange import Exchange, StepHook
from sparkdl.ps import wire
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
    compression: str | None = None  # pushes as "bf16"/"fp16" (``sparkdl.collective.compression``)


# What each task counts and returns in its payload; the driver sums them into the fit's stats. The seconds
# are the worker's waits for the server: a push (sending, the server's check and update, its answer) and a
# pull (the ssp gate, the server's read, receiving).
COUNTERS = ("samples", "pushes", "pulls", "bytes", "push_seconds", "pull_seconds")


def run_parameter_server_task(
    batches: Iterable[pa.RecordBatch], reporter: TaskReporter, task: ParameterServerTask
) -> bytes | None:
    """Trains against the server until this worker's share of steps is done, reporting its progress.

    Returns JSON ``{"history": {metric: [per epoch from initial_epoch]}, "samples": per epoch,
    "validation_rows": n, "counters": {name: count for name in COUNTERS}}``.
    """
    use_tensorflow_backend()  # before anything in this worker imports Keras
    import keras

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
        compression=task.compression,
    ) as client:
        exchange = Exchange(client, layout, task.compression)
        hook = StepHook(model, layout, exchange, task.push_every, task.compression)
        hook.assign(variables, exchange.pull())
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
        with intercept_apply(model.optimizer, hook):
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
        hook.flush()
        client.done()
    counters = dict(
        zip(
            COUNTERS,
            (
                (settings.epochs - settings.initial_epoch) * samples,
                exchange.pushes,
                exchange.pulls,
                layout.size * (wire.push_dtype(task.compression).itemsize * exchange.pushes + 4 * exchange.pulls),
                exchange.push_seconds,
                exchange.pull_seconds,
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
