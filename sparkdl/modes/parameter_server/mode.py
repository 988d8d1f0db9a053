"""The parameter-server mode: its variants (async, hogwild, ssp, sync_ps), their plan, and the one run path of a fit.

A variant is an update rule of the server (``sparkdl.ps.rules``) and the options it takes
(:data:`VARIANTS`); ``server_placement`` chooses where the shards run (:data:`PLACEMENTS`: threads
of the driver, ``driver_servers``, or Spark tasks beside the workers, ``executor_servers``). Both are
objects, made once here from the names the user gave and carried by the :class:`ParameterServerPlan`,
whose ``run`` is the same for every variant and placement.

The job (server addresses, secret, settings) reaches the tasks in the task closure; what the tasks did
(samples, pushes, pulls, bytes) comes back in each task's returned payload, on both kinds of session: a
payload is kept for the one successful attempt of each partition, exactly what accumulators would merge,
and it needs no JVM (Spark Connect has no accumulators).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
from collections.abc import Callable, Sequence
from typing import ClassVar

from sparkdl import launch, schedule
from sparkdl.keras import serialization
from sparkdl.launch import session
from sparkdl.launch.layout import TaskLayout
from sparkdl.modes.base import Job, Mode, ModeResult, Option, Plan, Settings
from sparkdl.modes.parameter_server import placement
from sparkdl.modes.parameter_server.checkpoints import resume_positions
from sparkdl.modes.parameter_server.driver_servers import DriverServers
from sparkdl.modes.parameter_server.executor_servers import ExecutorServers
from sparkdl.modes.parameter_server.placement import Placement
from sparkdl.modes.parameter_server.task import COUNTERS, ParameterServerTask, combine_histories
from sparkdl.modes.shared_options import COMPRESSION
from sparkdl.ps import sharding
from sparkdl.ps.positions import WorkerPositions
from sparkdl.ps.rules import BoundedStaleness, Hogwild, Immediate, SyncRounds, UpdateRule
from sparkdl.ps.server import ParameterServer
from sparkdl.ps.server_model import ServerModel
from sparkdl.ps.shard_server import Shard

logger = logging.getLogger(__name__)

#: Where the shards run, by ``server_placement``.
PLACEMENTS: dict[str, Placement] = {"driver": DriverServers(), "executors": ExecutorServers()}

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
    choices=tuple(PLACEMENTS),
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One of the mode's names: what it does (``fit``'s docstring), the options it takes, and the update rule it makes
    of their values."""

    summary: str
    options: tuple[Option, ...]
    rule: Callable[[dict], UpdateRule]


_TAKES_PUSH_EVERY = (PUSH_EVERY, NUM_SERVERS, COMPRESSION, SERVER_PLACEMENT)

#: The variants, by name. sync_ps takes no push_every: its rounds already average every worker's gradient of a
#: step, and a larger ``batch_size`` is the way to fewer, larger updates. Only ssp bounds staleness.
VARIANTS = {
    "async": Variant(
        "a parameter server (on the driver, or on executors) applies each worker's pushed gradient as it arrives, "
        "under a lock, with the model's own optimizer.",
        _TAKES_PUSH_EVERY,
        lambda values: Immediate(),
    ),
    "hogwild": Variant(
        "as async, without the lock: pulls never wait, SGD's pushes apply concurrently.",
        _TAKES_PUSH_EVERY,
        lambda values: Hogwild(),
    ),
    "ssp": Variant(
        "as async, but a worker more than ``max_staleness`` pushes ahead of the slowest one waits.",
        (*_TAKES_PUSH_EVERY, MAX_STALENESS),
        lambda values: BoundedStaleness(values["max_staleness"]),
    ),
    "sync_ps": Variant(
        "the parameter server, synchronous: each step it waits for every worker's gradient, applies their mean "
        "once, and every worker pulls the same weights; sync's training without a barrier stage.",
        (NUM_SERVERS, COMPRESSION, SERVER_PLACEMENT),
        lambda values: SyncRounds(),
    ),
}


@dataclasses.dataclass(frozen=True)
class ParameterServerPlan(Plan):
    """async (updates applied as they arrive, under a lock), hogwild (without the lock), ssp (bounded staleness),
    sync_ps (synchronous rounds: every worker's gradient of a step in, their mean applied once, the same weights out).

    Every worker reports progress (an epoch is complete once all have finished it); the driver
    writes the checkpoints, of the servers' state, when they have.
    """

    rule: UpdateRule  # how the server turns pushes into updates: the variant's (``sparkdl.ps.rules``)
    push_every: int = 1  # steps whose gradients are averaged into one push
    num_servers: int = 1  # server shards, balanced by size
    compression: str | None = None  # pushes as "bf16"/"fp16" (``sparkdl.collective.compression``)
    placement: Placement = PLACEMENTS["driver"]  # where the shards run

    saves_step_checkpoints: ClassVar[bool] = True  # the workers ask for them (``step_requests``)
    resumes_on_other_workers: ClassVar[bool] = False  # its tasks share no collective (``checkpoints``)

    def refuses_fewer_workers(self, checkpointed: bool) -> str | None:
        """With the servers on the driver the workers are tasks Spark retries alone, and the others go on without a
        lost one (its retry resumes at its own step when a slot is free): async and hogwild wait for no worker, ssp
        sets a silent worker aside after ``timeout`` (``sparkdl.ps.staleness``); sync_ps's rounds need every
        worker, and with the servers on executors the workers and servers are one barrier stage."""
        if self.placement.barrier:
            return (
                "with server_placement='executors' its workers and servers are one barrier stage, which resumes on "
                "the workers it was taken on only"
            )
        if self.rule.synchronous:
            return "every round of sync_ps takes every worker's push of its step"
        return None

    def layout(self, num_workers: int) -> TaskLayout:
        """A worker per shard of the rows; with ``server_placement="executors"`` the server tasks after them."""
        return self.placement.layout(num_workers, self.num_servers)

    def reporting_ranks(self, num_workers: int) -> int:
        return num_workers

    def why_all_at_once(self, slots: int) -> str:
        return (
            f"In mode={self.mode!r} every worker trains against the parameter server at the same time: workers "
            "beyond the free slots would wait for one while the server waits for them, until `timeout`; with "
            "server_placement='executors' the num_servers server tasks run beside the workers, at the same time too, "
            "so the fit needs num_workers + num_servers slots (the count above), or server_placement='driver'"
        )

    def server(
        self,
        shards: Sequence[Shard],
        settings: Settings,
        *,
        host: str,
        secret: bytes,
        encrypt: bool,
        checkpointed: bool,
        first_shard: int = 0,
        controller: bool = False,
        positions: WorkerPositions | None = None,
    ) -> ParameterServer:
        """A server of ``shards`` (the first of them shard ``first_shard`` of the layout) under this plan's rule and
        compression, for the workers of ``settings``. ``checkpointed``: the driver saves the servers' state each
        time every worker has finished an epoch, which a synchronous rule's rounds of the next epoch wait for;
        ``controller``: the driver reads the state over a connection of its own (the shards run elsewhere);
        ``positions``: where the workers stood in the checkpoint the shards' state is from."""
        return ParameterServer(
            shards,
            host=host,
            secret=secret,
            rule=self.rule,
            num_workers=settings.num_workers,
            timeout=settings.timeout,
            encrypt=encrypt,
            compression=self.compression,
            epoch_steps=(lambda rows: schedule.steps_per_epoch(rows, settings.batch_size)) if checkpointed else None,
            first_shard=first_shard,
            controller=controller,
            positions=positions,
            min_workers=settings.min_workers,
        )

    def run(self, job: Job) -> ModeResult:
        """Trains against servers started from ``job.start``: its weights, and its shards' optimizer state when it was
        saved by a server of the same layout (``ServerModel``, the driver's copy of the model cut into the fit's
        shards). The placement starts the servers; the stats are the workers' counters (``task.COUNTERS``) summed
        beside the servers' (``placement.SERVER_STATS``)."""
        start = job.start
        positions = resume_positions(start, job.settings, lockstep=self.rule.synchronous, num_servers=self.num_servers)
        if positions is not None:  # each worker's next steps in the order they were taken in
            job = dataclasses.replace(
                job, settings=dataclasses.replace(job.settings, seed=positions.seed, shuffle=positions.shuffle)
            )
        settings = job.settings
        server_model = ServerModel(
            serialization.model_from_bytes(start.model_bytes, settings.custom_objects),
            self.num_servers,
            compiled=self.rule.locked,  # XLA's launch locks the variables: unlocked (hogwild) updates stay unfused
        )
        from_checkpoint = bool(start.epoch) or start.position is not None
        restored = from_checkpoint and server_model.restore_optimizers(start.arrays)
        if from_checkpoint and not restored:
            logger.info(
                "sparkdl: the checkpoint holds no optimizer state for %d server shard(s) of this model: the "
                "shards' optimizers start afresh",
                self.num_servers,
            )
        setup = placement.ServerSetup(
            server_model,
            secrets.token_bytes(32),
            session.encrypts_traffic(job.training.frame.sparkSession),
            restored,
            positions,
        )
        with self.placement.start(job, self, setup) as servers:
            worker = ParameterServerTask(
                settings=settings,
                plan=self,
                secret=setup.secret,
                addresses=servers.addresses,
                shards=server_model.spans.shards,
                encrypt=setup.encrypt,
            )
            results = launch.run_tasks(
                job.training.frame,
                job.layout,
                servers.task(worker),
                barrier=self.placement.barrier,
                timeout=settings.timeout,
                on_progress=servers.on_event,
                offered=servers.offered,
                # a lost worker's task waits for a slot while the others wait for it: it cannot end, but in a
                # rule that waits for no worker (async, hogwild) or goes on without one (ssp with min_workers)
                watch_slots=self.placement.barrier or (self.rule.waits_for_every_worker and not settings.spare_workers),
            )
            outcomes = [json.loads(results[rank]) for rank in range(settings.num_workers)]
            if settings.validate and not any(outcome["validation_rows"] for outcome in outcomes):
                # each worker judged its own rows: none could see that no partition held a row out
                logger.warning(
                    "sparkdl: no worker's partition got a validation row (%s): the history has no val_ metrics",
                    settings.rules.validation_source,
                )
            history = combine_histories(outcomes)
            served = servers.finish(results, history)
        stats = {
            **{name: sum(outcome["counters"][name] for outcome in outcomes) for name in COUNTERS},
            **placement.combine_reports(served.reports),
            **served.stats,
        }
        if any(outcome["first_step"] != outcome["initial_step"] for outcome in outcomes):
            # where the workers' last attempts started: global steps of each one's schedule, past its first epoch's
            stats["resumed_at"] = {
                "epoch": served.initial_epoch,
                "workers": [outcome["first_step"] for outcome in outcomes],
                "steps_per_epoch": [outcome["steps_per_epoch"] for outcome in outcomes],
            }
        return ModeResult(server_model.model, history, stats, served.initial_epoch, served.resumed_history)


class ParameterServerMode(Mode):
    """The parameter-server family: ``async``, ``hogwild``, ``ssp`` and ``sync_ps``, each a :class:`ParameterServerPlan`
    of the update rule and options of its :data:`VARIANTS` entry."""

    names = tuple(VARIANTS)
    summaries = {name: variant.summary for name, variant in VARIANTS.items()}

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
            PLACEMENTS[values["server_placement"]],
        )
