"""Where the parameter server's shards run (``server_placement``): the interface every placement has, and the
servers' stats, named once for both.

A placement is one module behind :class:`Placement`: ``driver_servers`` (threads of the driver, the default)
and ``executor_servers`` (Spark tasks beside the workers, in one barrier stage). The fit's run path
(``ParameterServerPlan.run``) is the same for both: it builds the driver's copy of the model, cut into shards
(``ServerModel``), has the placement :meth:`~Placement.start` the servers, runs the stage of the
:class:`Servers` it gets (their tasks, their progress and checkpoints), and reads each server's
:func:`report` back, which :func:`combine_reports` turns into the fit's stats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from sparkdl.launch.layout import TaskLayout
from sparkdl.launch.stage import TaskFunction
from sparkdl.modes.base import Job
from sparkdl.modes.parameter_server.task import ParameterServerTask
from sparkdl.ps.positions import WorkerPositions
from sparkdl.ps.server import ParameterServer
from sparkdl.ps.server_model import ServerModel

if TYPE_CHECKING:
    from sparkdl.modes.parameter_server.mode import ParameterServerPlan


def _each_shard(parts: list[list]) -> list:
    return [item for part in parts for item in part]


#: Each server's part of a fit's stats (:func:`report`), and how those of a fit's servers combine (one server on the
#: driver, one per server task): ``max_staleness`` (the largest ``clock[w] - min(active clocks)`` a granted pull
#: saw), ``refused_connections`` (failed or refused handshakes), request and response bytes, the seconds the shards
#: spent checking pushes, applying them and reading weights (``sparkdl.ps.counters``); per shard, in shard order:
#: ``versions`` (updates applied), under sync_ps ``rounds`` and ``replayed_pushes`` (``sparkdl.ps.rules``), and
#: ``servers`` (where each shard ran: ``{"shard", "address", "pid"}``); ``workers_set_aside`` (under ssp with
#: ``min_workers``: the workers the others went on without; the clocks' server's).
SERVER_STATS: dict[str, Callable[[list], Any]] = {
    "max_staleness": max,
    "refused_connections": sum,
    "bytes_in": sum,
    "bytes_out": sum,
    "check_seconds": sum,
    "apply_seconds": sum,
    "read_seconds": sum,
    "versions": _each_shard,
    "rounds": _each_shard,
    "replayed_pushes": _each_shard,
    "servers": _each_shard,
    "workers_set_aside": _each_shard,  # only the clocks' server sets any aside
}


def report(server: ParameterServer) -> dict:
    """``server``'s part of the fit's stats (:data:`SERVER_STATS`), read now."""
    stats = server.stats()
    stats["servers"] = [
        {"shard": shard, "address": address, "pid": os.getpid()}
        for shard, address in zip(server.indices, server.addresses)
    ]
    return {name: stats[name] for name in SERVER_STATS if name in stats}


def combine_reports(reports: list[dict]) -> dict:
    """The fit's servers' stats, from each server's :func:`report` (in shard order)."""
    return {name: combine([r[name] for r in reports]) for name, combine in SERVER_STATS.items() if name in reports[0]}


@dataclasses.dataclass(frozen=True)
class ServerSetup:
    """What the run path starts the servers with."""

    server_model: ServerModel  # the driver's copy of the model, cut into the fit's shards
    secret: bytes  # the job's: every connection to a shard proves it
    encrypt: bool  # seal the connections (the session encrypts its RPC)
    restored: bool  # the shards' optimizers hold the state ``Job.start`` saved
    positions: WorkerPositions | None = None  # where the workers stood in ``Job.start`` (``checkpoints``)


@dataclasses.dataclass(frozen=True)
class Served:
    """What the servers left after the stage: each one's :func:`report` (in shard order), the epoch training
    started from (with the history before it, where that is not ``Job.start``'s), and the step checkpoints' stats
    (``{"step_checkpoints": {"saved": n}}`` where the fit saved them)."""

    reports: list[dict]
    initial_epoch: int
    resumed_history: dict[str, list[float]] | None = None
    stats: dict = dataclasses.field(default_factory=dict)


class Servers:
    """The running servers of one fit, as the run path uses them."""

    addresses: list[str] | None  # where the workers connect; None: they learn it at the stage's rendezvous
    offered: dict[str, bytes]  # payloads the tasks fetch from the driver's relay

    def task(self, worker: ParameterServerTask) -> TaskFunction:
        """What each task of the stage runs, the workers ``worker``."""
        raise NotImplementedError

    def on_event(self, rank: int, event: dict) -> None:
        """A task's progress event (from a relay thread)."""
        raise NotImplementedError

    def finish(self, results: dict[int, bytes], history: dict[str, list[float]]) -> Served:
        """After the stage, from the tasks' ``results`` (the workers' trained ``history``): what the servers left."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the shards run; chosen once from ``server_placement``."""

    barrier: ClassVar[bool] = False  # the stage starts all its tasks together

    def layout(self, num_workers: int, num_servers: int) -> TaskLayout:
        """The stage's tasks: by default a worker per shard of the rows."""
        return TaskLayout.data_parallel(num_workers)

    def start(
        self, job: Job, plan: ParameterServerPlan, setup: ServerSetup
    ) -> contextlib.AbstractContextManager[Servers]:
        """Starts the servers of ``job`` under ``plan`` (stopped when the block ends)."""
        raise NotImplementedError
