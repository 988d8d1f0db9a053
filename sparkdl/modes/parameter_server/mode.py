"""The parameter-server mode's driver side: serve the shards while the worker tasks train.

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

from sparkdl import launch
from sparkdl.checkpoint import Checkpointer
from sparkdl.keras import serialization
from sparkdl.launch import session
from sparkdl.metrics import combine_logs
from sparkdl.modes.base import Job, Mode, ModeResult, Option
from sparkdl.modes.parameter_server.task import COUNTERS, MODEL, ParameterServerTask, run_parameter_server_task
from sparkdl.modes.shared_options import COMPRESSION
from sparkdl.ps.server import ParameterServer
from sparkdl.ps.server_model import ServerModel

logger = logging.getLogger(__name__)


PUSH_EVERY = Option("push_every", "steps whose gradients are averaged into one push", default=1)
NUM_SERVERS = Option("num_servers", "parameter-server shards, balanced by size", default=1)
MAX_STALENESS = Option(
    "max_staleness", "how many pushes a worker may run ahead of the slowest", minimum=0, required=True
)


@dataclasses.dataclass(frozen=True)
class ParameterServerOptions:
    push_every: int = 1  # steps whose gradients are averaged into one push
    num_servers: int = 1  # server shards, balanced by size
    max_staleness: int = 0  # ssp: pushes a worker may run ahead of the slowest
    compression: str | None = None  # pushes as "bf16"/"fp16" (``sparkdl.collective.compression``)


class ParameterServerMode(Mode):
    """async (updates applied as they arrive, under a lock), hogwild (without the lock), ssp (bounded staleness).

    Every worker reports progress (an epoch is complete once all have finished it); the driver
    writes the checkpoints, of the server's state, when they have.
    """

    names = ("async", "hogwild", "ssp")

    def options(self, name: str) -> tuple[Option, ...]:
        return (PUSH_EVERY, NUM_SERVERS, COMPRESSION, *((MAX_STALENESS,) if name == "ssp" else ()))

    def configure(self, name: str, model, values: dict) -> ParameterServerOptions:
        num_servers = values["num_servers"]
        variables = len(model.trainable_variables)
        if num_servers > variables:
            raise ValueError(
                f"Expected `num_servers` <= the model's {variables} trainable variables (a shard holds "
                f"whole variables). Received: num_servers={num_servers}"
            )
        return ParameterServerOptions(
            values["push_every"], num_servers, values.get("max_staleness", 0), values["compression"]
        )

    def reporting_ranks(self, num_workers: int) -> int:
        return num_workers

    def why_all_at_once(self, name: str, slots: int) -> str:
        return (
            f"In mode={name!r} every worker trains against the parameter server at the same time: workers "
            "beyond the free slots would wait for one while the server waits for them, until `timeout`"
        )

    def run(self, job: Job) -> ModeResult:
        """Trains against a server started from ``job.start``: its weights, and its shards' optimizer state when
        it was saved by a server of the same layout. With ``job.checkpoints`` the server's state is saved each
        time every worker has finished an epoch (the weights then include whatever faster workers pushed since).
        """
        settings, options = job.settings, job.options
        spark = job.training.frame.sparkSession
        server_model = ServerModel(
            serialization.model_from_bytes(job.start.model_bytes, settings.custom_objects),
            options.num_servers,
            compiled=job.mode != "hogwild",  # XLA's launch locks the variables: hogwild's updates stay unfused
        )
        if job.start.epoch and not server_model.restore_optimizers(job.start.arrays):
            logger.info(
                "sparkdl: the checkpoint holds no optimizer state for %d server shard(s) of this model: the "
                "shards' optimizers start afresh",
                options.num_servers,
            )
        secret = secrets.token_bytes(32)
        encrypt = session.encrypts_traffic(spark)
        with ParameterServer(
            server_model.shards,
            host=session.driver_host(spark),
            secret=secret,
            mode=job.mode,
            num_workers=settings.num_workers,
            max_staleness=options.max_staleness,
            timeout=settings.timeout,
            encrypt=encrypt,
            compression=options.compression,
        ) as server:
            task = ParameterServerTask(
                settings=settings,
                secret=secret,
                addresses=server.addresses,
                shards=server_model.layout.shards,
                push_every=options.push_every,
                encrypt=encrypt,
                compression=options.compression,
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
        }
        return ModeResult(server_model.model, combine_histories(outcomes), stats, job.start.epoch)


class _ServerCheckpoints:
    """An epoch listener: when every worker has finished an epoch, saves the server's state."""

    def __init__(self, checkpointer: Checkpointer, server: ParameterServer, server_model: ServerModel):
        self._checkpointer = checkpointer
        self._server = server
        self._server_model = server_model

    def on_epoch(self, epoch: int, logs: dict[str, float], samples_per_second: float) -> None:
        self._checkpointer.record(logs)
        with self._server.holding_updates():  # weights and optimizer state of one moment
            model_bytes = serialization.model_to_bytes(self._server_model.model)
            arrays = self._server_model.optimizer_arrays()
        self._checkpointer.save(epoch + 1, model_bytes, arrays)

    def close(self) -> None:
        """The checkpointer is closed by ``ParameterServerMode.run``, which raises its errors."""


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
