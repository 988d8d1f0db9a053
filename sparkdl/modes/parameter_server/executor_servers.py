"""``server_placement="executors"``: a server task per shard, beside the workers in one barrier stage; the driver's side
of it: the stage's tasks, the shards' states assembled, and the checkpoints.

The driver's ``ServerModel`` (the model, cut into the same shards as in the driver placement, each with
its optimizer) serves nothing here: the driver offers the model (and, resuming, each shard's optimizer
state) on its relay, runs one barrier stage of ``num_workers`` workers and ``num_servers`` server tasks
(``stage.layout``), and sets its shards from the state the server tasks return, so that the trained
model is assembled exactly as the driver's own server would have left it.

Checkpoints (``checkpoint_dir``) are still the driver's: when every worker has finished an epoch (counted
here per stage attempt, so that an epoch a retried stage trains again is saved again), and when workers
ask for a step checkpoint (``step_requests``), the driver connects to each server task as the controller
and reads its shard's state and the workers' positions on it (``sparkdl.ps.client.fetch_state``:
authenticated with the job's secret, of exactly the size its own copy of the shard says), then saves
the whole model and the shards' optimizer state in the driver placement's format (``checkpoints``): a
checkpoint of one placement resumes in the other. The last epoch's checkpoint is saved from the state the
server tasks return. When Spark retries the stage after a lost task, every task of the new attempt starts
from the newest of these checkpoints (``server_task``), each worker at its own step there: "retry and
rejoin" here means the whole stage restarts from the last checkpoint saved, as sync mode's does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from sparkdl.keras import serialization
from sparkdl.launch import session
from sparkdl.launch.layout import TaskLayout
from sparkdl.launch.stage import TaskFunction
from sparkdl.launch.task_context import partition_id
from sparkdl.metrics import combine_logs
from sparkdl.modes.base import Job
from sparkdl.modes.parameter_server import server_task, stage
from sparkdl.modes.parameter_server.checkpoints import ServerCheckpoints
from sparkdl.modes.parameter_server.placement import Placement, Served, Servers, ServerSetup
from sparkdl.modes.parameter_server.step_requests import REQUEST_EVENT
from sparkdl.modes.parameter_server.task import MODEL, ParameterServerTask, run_parameter_server_task
from sparkdl.ps.client import fetch_state
from sparkdl.ps.server_model import ServerModel

if TYPE_CHECKING:
    from sparkdl.modes.parameter_server.mode import ParameterServerPlan

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExecutorServers(Placement):
    """A server task per shard, beside the workers in one barrier stage."""

    barrier: ClassVar[bool] = True

    def layout(self, num_workers: int, num_servers: int) -> TaskLayout:
        return stage.layout(num_workers, num_servers)

    @contextlib.contextmanager
    def start(self, job: Job, plan: ParameterServerPlan, setup: ServerSetup) -> Iterator[Servers]:
        """Nothing runs before the stage: the server tasks start with it, and end once every worker is done."""
        if session.dynamic_allocation(job.training.frame.sparkSession):
            raise ValueError(
                f"Expected server_placement='driver' under {session.DYNAMIC_ALLOCATION_SETTING}=true. Received: "
                "server_placement='executors', whose server tasks run beside the workers in one barrier stage, "
                "which Spark refuses under dynamic allocation. Use server_placement='driver' (plain tasks), or turn "
                "dynamic allocation off."
            )
        yield _Stage(job, plan, setup)


class _Stage(Servers):
    def __init__(self, job: Job, plan: ParameterServerPlan, setup: ServerSetup):
        self.addresses = None  # the server tasks': met at the stage's rendezvous
        self.offered = {MODEL: job.start.model_bytes}
        if setup.restored:
            arrays = setup.server_model.optimizer_arrays()
            for k in range(plan.num_servers):
                mine = {name: array for name, array in arrays.items() if name.split("/", 1)[0] == f"shard{k}"}
                self.offered[stage.optimizer_payload(k)] = stage.arrays_to_bytes(mine)
        self._server = server_task.ServerTask(
            settings=job.settings,
            plan=plan,
            secret=setup.secret,
            encrypt=setup.encrypt,
            restored=setup.restored,
            checkpoints=job.checkpoints if job.checkpointer is not None else None,
            start=job.start.place,
            positions=setup.positions,
        )
        self._server_model = setup.server_model
        self._num_workers = job.settings.num_workers
        self._controller = Controller(job, plan, setup.server_model, setup.secret, setup.encrypt)

    def task(self, worker: ParameterServerTask) -> TaskFunction:
        num_workers, server = self._num_workers, self._server

        def run_task(batches, reporter):
            if partition_id() < num_workers:
                return run_parameter_server_task(batches, reporter, worker)
            return server_task.run_server_task(batches, reporter, server)

        return run_task

    def on_event(self, rank: int, event: dict) -> None:
        self._controller.on_event(rank, event)

    def finish(self, results: dict[int, bytes], history: dict[str, list[float]]) -> Served:
        """Sets the driver's shards from the states the server tasks returned (each exactly its own shard's size, or an
        error), then saves the last epoch's checkpoint of them."""
        reports = []
        for k, shard in enumerate(self._server_model.shards):
            state, report = server_task.read_result(results[self._num_workers + k])
            shard.load_state(state)
            reports.append(report)
        self._controller.save_last(history)
        first = reports[0]
        return Served(
            [report["stats"] for report in reports],
            first["initial_epoch"],
            first["resumed_history"],
            self._controller.stats(),
        )


class Controller:
    """The driver's side of the stage while it runs: progress to the monitor, and the checkpoints.

    Knows each server task's address (its progress event, the newest task attempt's) and, per stage attempt,
    which workers have finished which epoch: a worker's ``start`` event (a retried stage's task starts again)
    forgets what the worker's earlier attempt reported.
    """

    def __init__(self, job: Job, plan: ParameterServerPlan, server_model: ServerModel, secret: bytes, encrypt: bool):
        self._monitor = job.monitor
        self._checkpoints = (
            ServerCheckpoints(job.checkpointer, job.settings, lockstep=plan.rule.synchronous, start=job.start)
            if job.checkpointer is not None
            else None
        )
        self._server_model = server_model
        self._secret = secret
        self._encrypt = encrypt
        self._num_workers = job.settings.num_workers
        self._epochs = job.settings.epochs
        self._timeout = job.settings.timeout
        self._lock = threading.Lock()
        self._servers: dict[int, tuple[int, str]] = {}  # shard -> (task attempt id, address)
        self._reports: dict[int, dict[int, dict]] = {}  # epoch -> worker -> its epoch event
        self._last: tuple[int, dict[str, float]] | None = None  # the final epoch's logs (its state: the results)

    def on_event(self, rank: int, event: dict) -> None:
        """A task's progress event (from a relay thread)."""
        self._monitor.on_event(rank, event)
        kind = event.get("event")
        if rank >= self._num_workers:
            if kind == stage.SERVER_EVENT:
                self.server_started(int(event["shard"]), str(event["address"]), int(event["task"]))
            return
        if kind == "start":
            with self._lock:
                for epoch, reports in self._reports.items():
                    if epoch >= int(event["initial_epoch"]):
                        reports.pop(rank, None)
        elif kind == REQUEST_EVENT:
            self._step_requested(rank)
        elif kind == "epoch":
            epoch = int(event["epoch"])
            with self._lock:
                reports = self._reports.setdefault(epoch, {})
                if event.get("skipped"):  # its earlier attempt's report, if any, is the one with metrics
                    reports.setdefault(rank, event)
                else:
                    reports[rank] = event
                if len(reports) < self._num_workers:
                    return
                del self._reports[epoch]
            logs = combine_logs(
                [r["logs"] for r in reports.values()],
                [r.get("samples", 1) for r in reports.values()],
                [r.get("validation_rows", 0) for r in reports.values()],
            )
            self._epoch_done(epoch, logs)

    def server_started(self, shard: int, address: str, task: int) -> None:
        """Server task ``task`` (a task attempt id) serves ``shard`` at ``address``."""
        with self._lock:
            if task >= self._servers.get(shard, (-1, ""))[0]:
                self._servers[shard] = (task, address)

    def save_last(self, history: dict[str, list[float]]) -> None:
        """After the stage: the last epoch's checkpoint, of the state the server tasks returned (they stop once every
        worker is done, so the driver cannot ask them: every worker is at its last step, the checkpoint holds no
        positions); ``history``: the workers', for its logs if no event had them."""
        if self._checkpoints is None:
            return
        last = self._epochs - 1
        logs = self._last[1] if self._last is not None else {name: values[-1] for name, values in history.items()}
        with self._checkpoints.saving():
            self._checkpoints.checkpointer.record(logs, epoch=last)
            self._checkpoints.save(self._model_bytes(), self._server_model.optimizer_arrays(), None, epochs=last + 1)

    def stats(self) -> dict:
        """The step checkpoints' stats, where the driver saves checkpoints."""
        return {"step_checkpoints": {"saved": self._checkpoints.step_saves}} if self._checkpoints is not None else {}

    def _epoch_done(self, epoch: int, logs: dict[str, float]) -> None:
        if self._checkpoints is None:
            return
        if epoch + 1 >= self._epochs:
            self._last = (epoch, logs)
            return
        with self._checkpoints.saving():
            self._checkpoints.checkpointer.record(logs, epoch=epoch)
            positions = self._read_state(epoch + 1)
            if positions is not None:
                self._checkpoints.save(
                    self._model_bytes(), self._server_model.optimizer_arrays(), positions, epochs=epoch + 1
                )

    def _step_requested(self, worker: int) -> None:
        """Worker ``worker`` asked for a step checkpoint (``step_requests``): the shards' state now (under sync_ps held
        after the worker's step until read)."""
        if self._checkpoints is None:
            return
        with self._checkpoints.saving():
            if self._checkpoints.wants_step(worker) and (positions := self._read_state(0)) is not None:
                self._checkpoints.save(self._model_bytes(), self._server_model.optimizer_arrays(), positions)

    def _read_state(self, epochs: int) -> tuple[list[int], list[int], list[list[int]]] | None:
        """Every shard's state, read from its server task into the driver's copy (``epochs``: the complete epochs it
        is after, 0 for a step checkpoint), and the workers' positions (``ParameterServer.positions``'s form); None
        where a server task could not be read (logged)."""
        with self._lock:
            servers = dict(self._servers)
        next_steps = []
        positions = np.empty(3 * self._num_workers, np.int64)  # each shard's, as fetch_state says
        try:
            for k, shard in enumerate(self._server_model.shards):
                if k not in servers:
                    raise RuntimeError(f"server task {k} has not said where it serves")
                state = fetch_state(
                    servers[k][1],
                    shard=k,
                    controller=self._num_workers,
                    secret=self._secret,
                    nbytes=shard.state_nbytes,
                    epochs=epochs,
                    timeout=self._timeout,
                    encrypt=self._encrypt,
                    positions=positions,
                )
                shard.load_state(state)
                next_steps.append(positions[: self._num_workers].tolist())
        except Exception as exc:  # their tasks have ended: the stage failed, or the workers finished meanwhile
            logger.warning(
                "sparkdl: no checkpoint %s: the driver could not read the server tasks' state (%s); the stage "
                "failed (Spark retries it from the last checkpoint), or the workers finished training before the "
                "read (the last epoch's checkpoint is written from the server tasks' results)",
                f"after epoch {epochs}" if epochs else "of the step a worker asked for",
                exc,
            )
            return None
        workers = positions[self._num_workers :].reshape(2, self._num_workers)  # every worker told every server
        return workers[0].tolist(), workers[1].view(np.uint64).tolist(), next_steps

    def _model_bytes(self) -> bytes:
        return serialization.model_to_bytes(self._server_model.model)
