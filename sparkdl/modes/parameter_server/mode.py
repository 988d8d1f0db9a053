"""The parameter-server mode's driver side: serve the shards while the worker tasks train.

This module is the driver placement (``server_placement="driver"``, the default): the shards are
threads of the driver. With ``server_placement="executors"`` they are Spark tasks beside the
workers instead (``placement``, ``executors``, ``server_task``).

The job (server addresses, secret, settings) reaches the tasks in the task closure. The
model to start from is offered on the driver's relay and every task fetches it there
(``launch.payloads``), as sync mode's rank 0 does, so it never passes through a JVM's
heap or a Spark Connect message, whatever its size. What the tasks did (samples,
pushes, pulls, bytes) comes back in each task's returned payload, on both kinds of
session: a payload is kept for the one successful attempt of each partition, exactly
what accumulators would merge, and it needs no JVM (Spark Connect has no
accumulators). The server binds to the driver's address only
(``launch.session.driver_host``) and is stopped, its ports released, when training
returns or raises.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
from collections.abc import Callable

from sparkdl import launch, schedule
from sparkdl.checkpoint import Checkpointer
from sparkdl.keras import serialization
from sparkdl.launch import session
from sparkdl.launch.layout import TaskLayout
from sparkdl.modes.base import Job, Mode, ModeResult, Option, Plan
from sparkdl.modes.parameter_server import executors, placement
from sparkdl.modes.parameter_server.task import (
    COUNTERS,
    MODEL,
    ParameterServerTask,
    combine_histories,
    run_parameter_server_task,
)
from sparkdl.modes.shared_options import COMPRESSION
from sparkdl.ps import sharding
from sparkdl.ps.rules import BoundedStaleness, Hogwild, Immediate, SyncRounds, UpdateRule
from sparkdl.ps.server import ParameterServer
from sparkdl.ps.server_model import ServerModel

logger = logging.getLogger(__name__)


PUSH_EVERY = Option("push_every", "steps whose gradients are averaged into one push", default=1)
NUM_SERVERS = Option("num_servers", "parameter-server shards, balanced by size", default=1)
MAX_STALENESS = Option(
    "max_staleness", "how many pushes a worker may run ahead of the slowest", minimum=0, required=True
)
SERVER_PLACEMENT = Option(
    "server_placement",
    "where the server shards run: 'driver' (threads of the driver) or 'executors' (a Spark task each, beside the "
    "workers in one barrier stage: num_workers + num_servers task slots)",
    kind=str,
    default="driver",
    choices=placement.PLACEMENTS,
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One of the mode's names: the options it takes, and the update rule it makes of their values."""

    options: tuple[Option, ...]
    rule: Callable[[dict], UpdateRule]


_TAKES_PUSH_EVERY = (PUSH_EVERY, NUM_SERVERS, COMPRESSION, SERVER_PLACEMENT)

#: The variants, by name. sync_ps takes no push_every (its rounds already average every worker's gradient of a
#: step); only ssp bounds staleness.
VARIANTS = {
    "async": Variant(_TAKES_PUSH_EVERY, lambda values: Immediate()),
    "hogwild": Variant(_TAKES_PUSH_EVERY, lambda values: Hogwild()),
    "ssp": Variant((*_TAKES_PUSH_EVERY, MAX_STALENESS), lambda values: BoundedStaleness(values["max_staleness"])),
    "sync_ps": Variant((NUM_SERVERS, COMPRESSION, SERVER_PLACEMENT), lambda values: SyncRounds()),
}


@dataclasses.dataclass(frozen=True)
class ParameterServerPlan(Plan):
    """async (updates applied as they arrive, under a lock), hogwild (without the lock), ssp (bounded staleness),
    sync_ps (synchronous rounds: every worker's gradient of a step in, their mean applied once, the same weights out).

    Every worker reports progress (an epoch is complete once all have finished it); the driver
    writes the checkpoints, of the server's state, when they have.

    ``placement`` says where the shards run: threads of the driver (here), or Spark tasks beside the
    workers in one barrier stage (``executors``), whose state the driver reads for its checkpoints.
    """

    rule: UpdateRule  # how the server turns pushes into updates: the variant's (``sparkdl.ps.rules``)
    push_every: int = 1  # steps whose gradients are averaged into one push
    num_servers: int = 1  # server shards, balanced by size
    compression: str | None = None  # pushes as "bf16"/"fp16" (``sparkdl.collective.compression``)
    placement: str = "driver"  # where the shards run: threads of the driver, or Spark tasks beside the workers

    def layout(self, num_workers: int) -> TaskLayout:
        """A worker per shard of the rows; with ``server_placement="executors"`` the server tasks after them."""
        if self.placement == "executors":
            return placement.layout(num_workers, self.num_servers)
        return TaskLayout.data_parallel(num_workers)

    def reporting_ranks(self, num_workers: int) -> int:
        return num_workers

    def why_all_at_once(self, slots: int) -> str:
        return (
            f"In mode={self.mode!r} every worker trains against the parameter server at the same time: workers "
            "beyond the free slots would wait for one while the server waits for them, until `timeout`; with "
            "server_placement='executors' the num_servers server tasks run beside the workers, at the same time too, "
            "so the fit needs num_workers + num_servers slots (the count above), or server_placement='driver'"
        )

    def run(self, job: Job) -> ModeResult:
        """Trains against a server started from ``job.start``: its weights, and its shards' optimizer state when
        it was saved by a server of the same layout. With ``job.checkpoints`` the server's state is saved each
        time every worker has finished an epoch (the weights then include whatever faster workers pushed since;
        under sync_ps none: the next epoch's first update waits for the save).
        """
        settings = job.settings
        if self.placement == "executors":
            return executors.run(job, self)
        spark = job.training.frame.sparkSession
        server_model = ServerModel(
            serialization.model_from_bytes(job.start.model_bytes, settings.custom_objects),
            self.num_servers,
            compiled=self.rule.locked,  # XLA's launch locks the variables: unlocked (hogwild) updates stay unfused
        )
        if job.start.epoch and not server_model.restore_optimizers(job.start.arrays):
            logger.info(
                "sparkdl: the checkpoint holds no optimizer state for %d server shard(s) of this model: the "
                "shards' optimizers start afresh",
                self.num_servers,
            )
        secret = secrets.token_bytes(32)
        encrypt = session.encrypts_traffic(spark)
        saving = job.checkpointer is not None
        with ParameterServer(
            server_model.shards,
            host=session.driver_host(spark),
            secret=secret,
            rule=self.rule,
            num_workers=settings.num_workers,
            timeout=settings.timeout,
            encrypt=encrypt,
            compression=self.compression,
            epoch_steps=((lambda rows: schedule.steps_per_epoch(rows, settings.batch_size)) if saving else None),
        ) as server:
            task = ParameterServerTask(
                settings=settings,
                secret=secret,
                addresses=server.addresses,
                shards=server_model.spans.shards,
                push_every=self.push_every,
                encrypt=encrypt,
                compression=self.compression,
                rule=self.rule,
            )
            if job.checkpointer is not None:
                job.monitor.add_listener(_ServerCheckpoints(job.checkpointer, server, server_model))
            results = launch.run_tasks(
                job.training.frame,
                job.layout,
                lambda batches, reporter: run_parameter_server_task(batches, reporter, task),
                barrier=False,
                timeout=settings.timeout,
                on_progress=job.monitor.on_event,
                offered={MODEL: job.start.model_bytes},
            )
            server_stats = server.stats()
        outcomes = [json.loads(payload) for payload in results.values()]
        stats = {
            **{name: sum(outcome["counters"][name] for outcome in outcomes) for name in COUNTERS},
            **{
                name: server_stats[name]
                for name in (
                    "max_staleness",
                    "versions",
                    "refused_connections",
                    "bytes_in",
                    "bytes_out",
                    "check_seconds",
                    "apply_seconds",
                    "read_seconds",
                )
            },
            **{name: server_stats[name] for name in ("rounds", "replayed_pushes") if name in server_stats},
        }
        return ModeResult(server_model.model, combine_histories(outcomes), stats, job.start.epoch)


class ParameterServerMode(Mode):
    """The parameter-server family: ``async``, ``hogwild``, ``ssp`` and ``sync_ps``, each a :class:`ParameterServerPlan`.

    sync_ps takes no ``push_every``: its rounds already average every worker's gradient of a step, and a
    larger ``batch_size`` is the way to fewer, larger updates.
    """

    names = tuple(VARIANTS)
    summaries = {
        "async": "a parameter server (on the driver, or on executors) applies each worker's pushed gradient as it "
        "arrives, under a lock, with the model's own optimizer.",
        "hogwild": "as async, without the lock.",
        "ssp": "as async, but a worker more than ``max_staleness`` pushes ahead of the slowest one waits.",
        "sync_ps": "the parameter server, synchronous: each step it waits for every worker's gradient, applies their "
        "mean once, and every worker pulls the same weights; sync's training without a barrier stage.",
    }

    def options(self, name: str) -> tuple[Option, ...]:
        return VARIANTS[name].options

    def configure(self, name: str, model, values: dict) -> ParameterServerPlan:
        num_servers = values["num_servers"]
        variables = len(model.trainable_variables)
        if not sharding.holds_whole_variables(num_servers, variables):
            raise ValueError(
                f"Expected `num_servers` <= the model's {variables} trainable variables (a shard holds "
                f"whole variables). Received: num_servers={num_servers}"
            )
        return ParameterServerPlan(
            name,
            VARIANTS[name].rule(values),
            values.get("push_every", 1),
            num_servers,
            values["compression"],
            values["server_placement"],
        )


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
        """The checkpointer is closed by ``fit`` once ``ParameterServerPlan.run`` returns, which raises its errors."""
