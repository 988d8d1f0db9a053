"""``server_placement="driver"`` (the default): the shards are threads of the driver, serving while the workers train.

The server (``sparkdl.ps.server.ParameterServer``) binds to the driver's address only
(``launch.session.driver_host``) and is stopped, its ports released, when training returns or
raises. The workers are plain tasks, which Spark may retry one by one: a retried worker connects
to the running server again. The model to start from is offered on the driver's relay and every
task fetches it there (``launch.payloads``), so it never passes through a JVM's heap or a Spark
Connect message, whatever its size.

Checkpoints: each time every worker has finished an epoch, the driver saves the server's state of
one moment (the weights then include whatever faster workers pushed since; under sync_ps none:
the next epoch's first round waits for the save), and when workers ask for a step checkpoint
(``step_requests``; under sync_ps the rounds after the step wait for it), each with where every
worker stood (``checkpoints``). A worker Spark retried asks the running server where it stands
and resumes there, at the step after the last one every shard applied of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sparkdl.keras import serialization
from sparkdl.launch import session
from sparkdl.launch.stage import TaskFunction
from sparkdl.modes.base import Job
from sparkdl.modes.parameter_server import placement
from sparkdl.modes.parameter_server.checkpoints import ServerCheckpoints
from sparkdl.modes.parameter_server.placement import Placement, Served, Servers, ServerSetup
from sparkdl.modes.parameter_server.step_requests import REQUEST_EVENT
from sparkdl.modes.parameter_server.task import MODEL, ParameterServerTask, run_parameter_server_task
from sparkdl.ps.server import ParameterServer
from sparkdl.ps.server_model import ServerModel

if TYPE_CHECKING:
    from sparkdl.modes.parameter_server.mode import ParameterServerPlan

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DriverServers(Placement):
    """One server of every shard, on the driver."""

    @contextlib.contextmanager
    def start(self, job: Job, plan: ParameterServerPlan, setup: ServerSetup) -> Iterator[Servers]:
        with plan.server(
            setup.server_model.shards,
            job.settings,
            host=session.driver_host(job.training.frame.sparkSession),
            secret=setup.secret,
            encrypt=setup.encrypt,
            checkpointed=job.checkpointer is not None,
            positions=setup.positions,
        ) as server:
            saving = None
            if job.checkpointer is not None:
                checkpoints = ServerCheckpoints(
                    job.checkpointer, job.settings, lockstep=plan.rule.synchronous, start=job.start
                )
                saving = _ServerCheckpoints(checkpoints, server, setup.server_model)
                job.monitor.add_listener(saving)
            yield _Serving(job, server, saving)


class _Serving(Servers):
    def __init__(self, job: Job, server: ParameterServer, saving: _ServerCheckpoints | None):
        self.addresses = server.addresses
        self.offered = {MODEL: job.start.model_bytes}
        self._server = server
        self._monitor = job.monitor
        self._saving = saving
        self._initial_epoch = job.start.epoch

    def task(self, worker: ParameterServerTask) -> TaskFunction:
        return lambda batches, reporter: run_parameter_server_task(batches, reporter, worker)

    def on_event(self, rank: int, event: dict) -> None:
        self._monitor.on_event(rank, event)
        if event.get("event") == REQUEST_EVENT and self._saving is not None:
            self._saving.step_requested(rank)

    def finish(self, results: dict[int, bytes], history: dict[str, list[float]]) -> Served:
        stats = self._saving.stats() if self._saving is not None else {}
        return Served([placement.report(self._server)], self._initial_epoch, stats=stats)


class _ServerCheckpoints:
    """An epoch listener: when every worker has finished an epoch, saves the server's state; and, when a worker asks,
    a step checkpoint of it."""

    def __init__(self, checkpoints: ServerCheckpoints, server: ParameterServer, server_model: ServerModel):
        self._checkpoints = checkpoints
        self._server = server
        self._server_model = server_model

    def on_epoch(self, epoch: int, logs: dict[str, float], samples_per_second: float) -> None:
        try:
            with self._checkpoints.saving():
                self._checkpoints.checkpointer.record(logs)
                self._save(epoch + 1)
        finally:
            self._server.epoch_saved(epoch)  # sync_ps: the next epoch's rounds may run (also after a failed save)

    def step_requested(self, worker: int) -> None:
        """Worker ``worker`` asked for a step checkpoint (``step_requests``)."""
        try:
            with self._checkpoints.saving():
                if self._checkpoints.wants_step(worker):
                    self._save(None)
        except Exception:  # as an epoch listener's: the fit goes on, the next checkpoint may succeed
            logger.exception("sparkdl: the step checkpoint worker %d asked for failed", worker)
        finally:
            self._server.step_saved()  # sync_ps: the rounds after the held step may run

    def stats(self) -> dict:
        return {"step_checkpoints": {"saved": self._checkpoints.step_saves}}

    def _save(self, epochs: int | None) -> None:
        with self._server.holding_updates():  # weights, optimizer state and positions of one moment
            model_bytes = serialization.model_to_bytes(self._server_model.model)
            arrays = self._server_model.optimizer_arrays()
            positions = self._server.positions()
        self._checkpoints.save(model_bytes, arrays, positions, epochs=epochs)

    def close(self) -> None:
        """The checkpointer is closed by ``fit``, which raises its errors."""
