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
each push names its step and rows (``push_pull.PushSteps``), and each pull
returns the weights after the step's one update, the same for every worker.

Where it starts: a worker asks every shard where it stands (``sparkdl.ps.positions``) and
resumes at the first of its steps some shard has not applied: a task Spark retried goes on
after the last step the running server applied of its failed attempt, and in a fit resumed
from a checkpoint (the driver's, with the workers' positions) each worker goes on after its
own last step there, the rest of its epoch in the same order (an ``EpochRest`` of its
schedule). It asks for step checkpoints every ``checkpoint_every`` (``step_requests``).

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
from sparkdl.modes.parameter_server.push_pull import PushPull, PushSteps, StepHook
from sparkdl.modes.parameter_server.step_requests import StepRequests
from sparkdl.position import EpochPosition, EpochRest, Segment, key_sum
from sparkdl.ps import wire
from sparkdl.ps.client import ParameterClient
from sparkdl.ps.positions import UNKNOWN
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

    Returns JSON ``{"history": {metric: [per epoch from first_epoch]}, "first_epoch", "samples": [rows per epoch of
    the history], "validation_rows": n, "counters": {name: count for name in COUNTERS}, "first_step",
    "initial_step", "steps_per_epoch"}``: ``first_step`` the global step it started at, where the shards said it
    stood (``initial_step``: the fit's first, where they knew of none).
    """
    use_tensorflow_backend()  # before anything in this worker imports Keras
    import keras

    settings, plan = task.settings, task.plan
    rank = partition_id()
    partition = read_partition(settings.rules, batches)
    schedule.require_rows({rank: len(partition.keys)})
    # No lockstep: each worker judges its own rows' checks before its first step (a barrier mode judges them all).
    rows, held_out = partition.own_rows()
    limit_threads_to_task_cpus()
    if task.beside_servers:  # where the servers start from (a retried stage: the newest checkpoint), then train from
        epoch = stage.start_place(stage.meet(reporter, {}, settings.timeout), settings.num_workers)[0]
        settings = dataclasses.replace(settings, initial_epoch=epoch)
    model = serialization.model_from_bytes(payloads.fetch(reporter, MODEL), settings.custom_objects)
    model.jit_compile = False  # the push and pull run through tf.numpy_function, which XLA cannot compile
    variables = model.trainable_variables
    spans = ShardSpans([tuple(v.shape) for v in variables], task.shards)
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
        if plan.rule.synchronous:  # every worker's rows: one schedule, the same steps per epoch (as sync mode's ranks)
            rows_per_worker = client.join(len(rows), settings.num_workers)
            if rank == 0:
                schedule.warn_fillers(rows_per_worker, schedule.steps_per_epoch(rows_per_worker, settings.batch_size))
        else:
            rows_per_worker = [len(rows)]  # no lockstep: a worker's epoch is its own rows, in its own steps
        settings = settings.for_rows(rows_per_worker)
        steps = settings.steps_per_epoch
        initial, stop = settings.initial_epoch * steps, settings.epochs * steps
        # where it resumes: the first of its steps some shard has not applied (a retried task, a resumed fit)
        first = min(initial if step == UNKNOWN else step for step in client.resume(len(rows), key_sum(rows.keys)))
        epoch, done = divmod(first, steps)
        requests = None
        if settings.checkpoint_every is not None and (rank == 0 or not plan.rule.synchronous):
            requests = StepRequests(
                settings.checkpoint_every,
                steps_per_epoch=steps,
                first=first,
                holds=plan.rule.synchronous,
                report=reporter.progress,
            )
        push_steps = PushSteps(
            first, stop, plan.push_every, schedule.step_sizes(len(rows), steps) if plan.rule.synchronous else None
        )
        push_pull = PushPull(client, spans, plan.compression, push_steps, requests)
        hook = StepHook(model, spans, push_pull, plan.push_every, plan.compression)
        hook.assign(variables, push_pull.pull())
        keras.utils.set_random_seed(settings.seed + rank)  # dropout and the like differ per worker, by design
        reporter.progress(callbacks.start_event(settings.initial_epoch, steps, len(rows), len(held_out)))
        for skipped in range(settings.initial_epoch, epoch):  # trained before it resumed: the others' metrics count
            reporter.progress({**callbacks.epoch_event(skipped, {}, 0, 0, 0.0), "skipped": True})
        history: dict[str, list[float]] = {}
        samples: list[int] = []  # the rows behind each epoch's metrics

        def fit(stream, epochs: range, rows_per_epoch: int, steps_in_epoch: int) -> None:
            progress = callbacks.progress_callback(
                reporter.progress,
                steps_per_epoch=steps_in_epoch,
                rows_per_epoch=rows_per_epoch,
                validation_rows=len(held_out),
            )
            trained = model.fit(
                stream,
                epochs=epochs.stop,
                initial_epoch=epochs.start,
                shuffle=False,
                verbose=0,
                validation_data=in_batches(held_out, settings.batch_size) if len(held_out) else None,
                callbacks=[progress, *settings.callbacks],
            )
            for name, values in trained.history.items():
                history.setdefault(name, []).extend(float(v) for v in values)
            samples.extend([rows_per_epoch] * len(epochs))

        with intercept_apply(model.optimizer, hook):
            whole_from = epoch
            if done:  # the rest of the epoch it stood in: its schedule's steps from the next one, in the same order
                rest = EpochRest(
                    EpochPosition(epoch, settings.seed, settings.shuffle, 0, ()),
                    (),
                    Segment(len(rows_per_worker), tuple(rows_per_worker), steps, done),
                    schedule.epoch_order(rows.keys, seed=settings.seed, epoch=epoch, shuffle=settings.shuffle),
                    rank if plan.rule.synchronous else 0,  # its shard of the schedule's
                )
                fit(settings.rest_stream(rows, rest), range(epoch, epoch + 1), rest.rows_left, rest.steps_left)
                whole_from = epoch + 1
            if whole_from < settings.epochs:
                fit(settings.epoch_stream(rows, whole_from), range(whole_from, settings.epochs), len(rows), steps)
        hook.flush()
        client.done()
    counters = dict(
        zip(
            COUNTERS,
            (
                sum(samples),
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
            "history": history,
            "first_epoch": epoch,
            "samples": samples,
            "validation_rows": len(held_out),
            "counters": counters,
            "first_step": first,
            "initial_step": initial,
            "steps_per_epoch": steps,
        }
    ).encode()


def combine_histories(results: list[dict]) -> dict[str, list[float]]:
    """One history from the workers' results (:func:`run_parameter_server_task`'s), epoch by epoch from the fit's
    first (``initial_step``'s epoch), each worker's metrics where its history has the epoch.

    By the one rule (``metrics.combine_logs``): training metrics weighted by the samples each worker
    trained in the epoch, ``val_*`` metrics by its held-out rows, so they are the metrics over all
    held-out rows (workers without held-out rows report none and weigh nothing). An epoch no worker trained in
    this run (all had, before it resumed) has NaN metrics.
    """
    start = min(r["initial_step"] // r["steps_per_epoch"] for r in results)
    stop = max(r["first_epoch"] + len(r["samples"]) for r in results)
    names = list(dict.fromkeys(name for r in results for name in r["history"]))
    history: dict[str, list[float]] = {name: [] for name in names}
    for epoch in range(start, stop):
        logs, samples, validation_rows = [], [], []
        for r in results:
            index = epoch - r["first_epoch"]
            if 0 <= index < len(r["samples"]):
                logs.append({name: values[index] for name, values in r["history"].items() if index < len(values)})
                samples.append(r["samples"][index])
                validation_rows.append(r["validation_rows"])
        combined = combine_logs(logs, samples, validation_rows)
        for name in names:
            history[name].append(combined.get(name, float("nan")))
    return history
