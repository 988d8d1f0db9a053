"""A server task of ``server_placement="executors"``: one shard of the parameter server, served from an executor.

It runs the same server as the driver placement (``sparkdl.ps.server.ParameterServer``: the same
listener, handshake, flood protection, frames, update rules and ssp gate), hosting shard ``k`` of the
model's layout only, on the address Spark knows its executor by, with the job's secret. It starts from
the model the driver offers (its weights) and the shard's optimizer state where a resumed fit has one,
or, on a stage Spark retried, from the newest checkpoint server 0 found (``stage``); it serves until
every worker has said DONE, then returns the shard's final state and its counters to the driver over
its relay connection (``.npz``, read with ``allow_pickle=False``).

Where the driver checkpoints, it also takes the driver's connection as the controller
(``sparkdl.ps.protocol``, ``Msg.STATE``): the driver reads the shard's state each time every worker has
finished an epoch, and under sync_ps the rounds of the next epoch wait for that read, as they wait for
the driver's save in the driver placement.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from sparkdl.checkpoint import CheckpointStore
from sparkdl.keras import serialization
from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend
from sparkdl.launch import payloads
from sparkdl.launch.forward import TaskReporter
from sparkdl.modes.base import Settings
from sparkdl.modes.parameter_server import placement, stage
from sparkdl.modes.parameter_server.task import MODEL
from sparkdl.ps.positions import WorkerPositions

if TYPE_CHECKING:
    from sparkdl.modes.parameter_server.mode import ParameterServerPlan


@dataclasses.dataclass(frozen=True)
class ServerTask:
    """Everything a server task needs but the model (fetched from the driver's relay), shipped in the closure: the fit's
    plan (its update rule, ``num_servers``, ``compression``) and what the workers connect with."""

    settings: Settings
    plan: ParameterServerPlan
    secret: bytes
    encrypt: bool = False
    restored: bool = False  # the driver offers each shard's optimizer state (``stage.optimizer_payload``)
    checkpoints: CheckpointStore | None = None  # where the driver checkpoints (a retried stage resumes from there)
    start: tuple[int, int] = (0, 0)  # the place of the driver's start (``Checkpoint.place``)
    positions: WorkerPositions | None = None  # where the workers stood in the driver's start (``checkpoints``)


def run_server_task(batches: Iterable[pa.RecordBatch], reporter: TaskReporter, task: ServerTask) -> bytes:
    """Serves this task's shard until every worker is done; returns ``.npz`` bytes: ``state`` (the shard's variables
    and its optimizer's end to end, ``OptimizerShard.state``) and ``report`` (JSON: the server's ``stats``,
    ``placement.report``, and the epoch it started from)."""
    use_tensorflow_backend()
    from pyspark import BarrierTaskContext

    from sparkdl.ps.server_model import ServerModel

    for _ in batches:  # a server reads no rows: its partition is empty
        pass
    settings, plan = task.settings, task.plan
    context = BarrierTaskContext.get()
    partition = context.partitionId()
    shard = partition - settings.num_workers
    host = context.getTaskInfos()[partition].address.rsplit(":", 1)[0]  # the executor's address, as Spark knows it
    reporter.phase("import")
    limit_threads_to_task_cpus()

    # Where training starts: the driver's start, or a newer checkpoint a failed attempt of this stage left.
    resumed = None
    proposal: dict = {}
    if shard == 0:
        if task.checkpoints is not None:
            resumed = task.checkpoints.latest(newer_than=task.start)
        epoch, steps = resumed.place if resumed is not None else task.start
        proposal = {"epoch": epoch, "steps": steps}
    place = stage.start_place(stage.meet(reporter, proposal, settings.timeout), settings.num_workers)
    epoch = place[0]
    if place != task.start and resumed is None:
        assert task.checkpoints is not None, "only a checkpoint starts elsewhere than the driver's start"
        resumed = task.checkpoints.read(place)  # the one server 0 found
    if resumed is not None:  # saved by this fit's driver: its workers' positions are this stage's
        model_bytes, arrays = resumed.model_bytes, resumed.arrays
        vector = arrays.get(WorkerPositions.ARRAY)
        positions = WorkerPositions.from_vector(vector).on_shards(plan.num_servers) if vector is not None else None
    else:
        model_bytes, positions = payloads.fetch(reporter, MODEL), task.positions
        arrays = (
            stage.arrays_from_bytes(payloads.fetch(reporter, stage.optimizer_payload(shard))) if task.restored else {}
        )
    import tensorflow as tf

    with tf.device("/CPU:0"):  # as on the driver: pulls send views of host memory, pushes arrive there
        model = serialization.model_from_bytes(model_bytes, settings.custom_objects)
        server_model = ServerModel(model, plan.num_servers, compiled=plan.rule.locked, hosted=[shard])
    if arrays and not server_model.restore_optimizers(arrays):
        raise RuntimeError(
            f"Parameter server shard {shard}: the optimizer state it was given does not fit its variables "
            f"(epoch {epoch}); every server task and the driver must cut the model alike"
        )
    reporter.phase("model in")
    saving = task.checkpoints is not None
    with plan.server(
        server_model.shards,
        settings,
        host=host,
        secret=task.secret,
        encrypt=task.encrypt,
        checkpointed=saving,
        first_shard=shard,
        controller=saving,
        positions=positions,
    ) as server:
        address = server.addresses[0]
        event = {"event": stage.SERVER_EVENT, "shard": shard, "address": address, "task": context.taskAttemptId()}
        reporter.progress(event)  # before the workers can train: the driver reads the state from there
        stage.meet(reporter, {"address": address}, settings.timeout)
        server.wait_finished()
        stats = placement.report(server)
    reporter.phase("serve")
    state = server_model.shards[0].state()  # the server has stopped: nothing changes it any more
    report = {
        "stats": stats,
        "initial_epoch": epoch,
        "resumed_history": resumed.history if resumed is not None and place != task.start else None,
    }
    flat = np.concatenate([np.ascontiguousarray(part).reshape(-1).view(np.uint8) for part in state])
    return stage.arrays_to_bytes({"state": flat, "report": np.frombuffer(json.dumps(report).encode(), np.uint8)})


def read_result(data: bytes | bytearray) -> tuple[np.ndarray, dict]:
    """A server task's result: its shard's state bytes (``OptimizerShard.load_state`` checks their size) and its
    report."""
    arrays = stage.arrays_from_bytes(data)
    if set(arrays) != {"state", "report"} or arrays["state"].dtype != np.uint8 or arrays["report"].dtype != np.uint8:
        raise ValueError(f"A server task returned a malformed result: {sorted(arrays)}")
    return arrays["state"], json.loads(arrays["report"].tobytes().decode())
