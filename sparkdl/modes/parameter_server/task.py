"""What one Spark task does in the parameter-server mode (async, hogwild, ssp, sync_ps).

Keras's ``fit`` runs unchanged; the optimizer hook replaces "apply the
gradients locally" by "push them to the server shards and take the weights
the server holds now" (``push_pull.py``). With ``push_every=k`` the gradients of
k steps, taken at the same pulled weights, are averaged into one push (k times
fewer round trips, a k times larger effective batch per update). With
``compression`` the pushes travel at half the bytes; the pulled weights are
float32.

Under ``sync_ps`` a worker first joins the server, which answers with every
worker's training rows once all have joined: all then follow one schedule, the
same steps per epoch (the largest partition's, as sync mode's ranks), each
step's rows and order as sync mode's rank of the same partition trains them;
each push names its step and rows (``push_pull.SyncSteps``), and each pull
returns the weights after the step's one update, the same for every worker.

Validation (``validation_col``/``validation_split``): a worker evaluates its
own held-out rows at every epoch end with the weights it holds then (the
server's, as of its last pull), through Keras's ``validation_data``; it
returns its held-out row count with its history, and the driver weighs the
workers' ``val_*`` metrics by it (:func:`combine_histories`).

Under ``server_placement="executors"`` the servers are tasks of the worker's own
barrier stage: the worker learns the epoch they start from and, once they listen,
their addresses at the stage's rendezvous (``stage``), and joins (sync_ps) and
finishes with every shard, each a server of its own.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

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
from sparkdl.metrics import combine_logs
from sparkdl.modes.base import Settings
from sparkdl.modes.parameter_server import stage
from sparkdl.modes.parameter_server.push_pull import PushPull, StepHook, SyncSteps
from sparkdl.ps import wire
from sparkdl.ps.client import ParameterClient
from sparkdl.ps.sharding import ShardSpans

if TYPE_CHECKING:
    from sparkdl.modes.parameter_server.mode import ParameterServerPlan

MODEL = "model"  # the name the driver offers the model to start from

#: sync_ps: how much longer than ``timeout`` a worker waits for a pull (or its join) that the server holds, so that
#: the server's own timeout, whose message names the workers it waited for, answers first.
WAIT_GRACE_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class ParameterServerTask:
    """Everything a worker needs but the model, shipped from the driver in the task closure: the fit's plan (its
    update rule, ``push_every``, ``compression``, read where they are used) and what the driver's servers started
    with.

    The model, which may be far larger than a closure should be (a Spark Connect message, the driver
    JVM's heap), is fetched from the driver's relay (``payloads.fetch``) by every task.
    """

    settings: Settings
    plan: ParameterServerPlan
    secret: bytes
    addresses: list[str] | None  # None: server tasks of the same stage, met at its rendezvous ("executors")
    shards: list[list[int]]
    encrypt: bool = False  # seal the connections: the session runs with spark.network.crypto.enabled

    @property
    def beside_servers(self) -> bool:
        """server_placement="executors": the shards are server tasks of this stage, each a server of its own."""
        return self.addresses is None


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

    settings, plan = task.settings, task.plan
    rank = partition_id()
    rows, held_out = read_partition(settings.fields, batches)
    schedule.require_rows({rank: len(rows)})
    limit_threads_to_task_cpus()
    if task.beside_servers:  # where the servers start from (a retried stage: the newest checkpoint), then train from
        epoch = stage.start_epoch(stage.meet(reporter, {}, settings.timeout), settings.num_workers)
        settings = dataclasses.replace(settings, initial_epoch=epoch)
    model = serialization.model_from_bytes(payloads.fetch(reporter, MODEL), settings.custom_objects)
    model.jit_compile = False  # the push and pull run through tf.numpy_function, which XLA cannot compile
    variables = model.trainable_variables
    spans = ShardSpans([tuple(v.shape) for v in variables], task.shards)
    samples = len(rows)  # every row once per epoch
    addresses = task.addresses
    if addresses is None:  # the servers listen by now: their addresses
        addresses = stage.server_addresses(stage.meet(reporter, {}, settings.timeout), settings.num_workers)

    with ParameterClient(
        addresses,
        worker=rank,
        secret=task.secret,
        shard_sizes=spans.shard_sizes,
        timeout=settings.timeout,
        encrypt=task.encrypt,
        compression=plan.compression,
        wait_grace=WAIT_GRACE_SECONDS if plan.rule.synchronous else 0.0,
        separate_servers=task.beside_servers,
    ) as client:
        steps = None
        if plan.rule.synchronous:  # every worker's rows: one schedule, the same steps per epoch (as sync mode's ranks)
            counts = client.join(len(rows), settings.num_workers)
            settings = settings.for_rows(counts)
            if rank == 0:
                schedule.warn_fillers(counts, settings.steps_per_epoch)
            steps = SyncSteps(
                settings.initial_epoch * settings.steps_per_epoch,
                schedule.step_sizes(len(rows), settings.steps_per_epoch),
            )
        else:
            settings = settings.for_rows([len(rows)])  # no lockstep: a worker's epoch is its own rows, in its own steps
        push_pull = PushPull(client, spans, plan.compression, steps)
        hook = StepHook(model, spans, push_pull, plan.push_every, plan.compression)
        hook.assign(variables, push_pull.pull())
        stream = settings.epoch_stream(rows, settings.initial_epoch)
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
                push_pull.pushes,
                push_pull.pulls,
                spans.size * (wire.push_dtype(plan.compression).itemsize * push_pull.pushes + 4 * push_pull.pulls),
                push_pull.push_seconds,
                push_pull.pull_seconds,
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


def combine_histories(results: list[dict]) -> dict[str, list[float]]:
    """One history from the workers' ``{"history": ..., "samples": n, "validation_rows": n}`` results.

    By the one rule (``metrics.combine_logs``): training metrics weighted by the samples each worker
    trained per epoch, ``val_*`` metrics by its held-out rows, so they are the metrics over all
    held-out rows (workers without held-out rows report none and weigh nothing).
    """
    epochs = max((len(values) for result in results for values in result["history"].values()), default=0)
    history: dict[str, list[float]] = {}
    for epoch in range(epochs):
        logs = [{name: values[epoch] for name, values in r["history"].items() if epoch < len(values)} for r in results]
        for name, value in combine_logs(
            logs, [r["samples"] for r in results], [r["validation_rows"] for r in results]
        ).items():
            history.setdefault(name, []).append(value)
    return history
