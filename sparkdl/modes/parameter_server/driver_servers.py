"""``server_placement="driver"`` (the default): the shards are threads of the driver, serving while the workers train.

The server (``sparkdl.ps.server.ParameterServer``) binds to the driver's address only
(``launch.session.driver_host``) and is stopped, its ports released, when training returns or
raises. The workers are plain tasks, which Spark may retry one by one: a retried worker connects
to the running server again. The model to start from is offered on the driver's relay and every
task fetches it there (``launch.payloads``), so it never passes through a JVM's heap or a Spark
Connect message, whatever its size.

Checkpoints: each time every worker has finished an epoch, the driver saves the server's state of
one moment (the weights then include whatever faster workers pushed since; under sync_ps none:
the next epoch's first round waits for the save).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sparkdl.checkpoint import Checkpointer
from sparkdl.keras import serialization
from sparkdl.launch import session
from sparkdl.launch.stage import TaskFunction
from sparkdl.modes.base import Job
from sparkdl.modes.parameter_server import placement
from sparkdl.modes.parameter_server.placement import Placement, Served, Servers, ServerSetup
from sparkdl.modes.parameter_server.task import MODEL, ParameterServerTask, run_parameter_server_task
from sparkdl.ps.server import ParameterServer
from sparkdl.ps.server_model import ServerModel

if TYPE_CHECKING:
    from sparkdl.modes.parameter_server.mode import ParameterServerPlan


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
        ) as server:
            if job.checkpointer is not None:
                job.monitor.add_listener(_ServerCheckpoints(job.checkpointer, server, setup.server_model))
            yield _Serving(job, server)


class _Serving(Servers):
    def __init__(self, job: Job, server: ParameterServer):
        self.addresses = server.addresses
        self.offered = {MODEL: job.start.model_bytes}
        self._server = server
        self._monitor = job.monitor
        self._initial_epoch = job.start.epoch

    def task(self, worker: ParameterServerTask) -> TaskFunction:
        return lambda batches, reporter: run_parameter_server_task(batches, reporter, worker)

    def on_event(self, rank: int, event: dict) -> None:
        self._monitor.on_event(rank, event)

    def finish(self, results: dict[int, bytes], history: dict[str, list[float]]) -> Served:
        return Served([placement.report(self._server)], self._initial_epoch)


class _ServerCheckpoints:
    """An epoch listener: when every worker has finished an epoch, saves the server's state."""

    def __init__(self, checkpointer: Checkpointer, server: ParameterServer, server_model: ServerModel):
        self._checkpointer = checkpointer
        self._server = server
        self._server_model = server_model

    def on_epoch(self, epoch: int, logs: dict[str, float], samples_per_second: float) -> None:
        try:
            self._checkpointer.record(logs)
            with self._server.holding_updates():  # weights and optimizer state of one moment
                model_bytes = serialization.model_to_bytes(self._server_model.model)
                arrays = self._server_model.optimizer_arrays()
            self._checkpointer.save(epoch + 1, model_bytes, arrays)
        finally:
            self._server.epoch_saved(epoch)  # sync_ps: the next epoch's rounds may run (also after a failed save)

    def close(self) -> None:
        """The checkpointer is closed by ``fit``, which raises its errors."""
