"""The driver side of the parameter-server modes: serve the shards while the worker tasks train.

The job (model, server addresses, secret) reaches the tasks as a broadcast on a
classic session, in the task closure under Spark Connect (``launch.session.ship``).
What the tasks did (samples, pushes, pulls, bytes) comes back in each task's
returned payload, on both kinds of session: a payload is kept for the one
successful attempt of each partition, exactly what accumulators would merge, and
it needs no JVM (Spark Connect has no accumulators). The server binds to the
driver's address only (``launch.session.driver_host``) and is stopped, its ports
released, when training returns or raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from typing import Optional, Sequence

from pyspark.sql import SparkSession

from sparkdl import launch
from sparkdl.checkpoint import BackgroundWriter, Checkpoint, CheckpointStore
from sparkdl.data import TrainingData
from sparkdl.launch import session
from sparkdl.progress import ProgressMonitor, combine_worker_logs
from sparkdl.ps.server import ParameterServer
from sparkdl.ps.server_model import ServerModel
from sparkdl.ps.worker import COUNTERS, AsyncJob, run_async_task
from sparkdl.train import serialization
from sparkdl.train.reporting import merge_histories

logger = logging.getLogger(__name__)


def run_parameter_server(
    spark: SparkSession, training: TrainingData, *, model_bytes: bytes, mode: str, num_workers: int,
    num_servers: int, epochs: int, batch_size: int, steps_per_epoch: int, push_every: int, max_staleness: int,
    seed: int, shuffle: bool, timeout: float, custom_objects, monitor: ProgressMonitor,
    resumed: Optional[Checkpoint] = None, checkpoints: Optional[CheckpointStore] = None, callbacks: Sequence = (),
) -> tuple[bytes, dict[str, list[float]], dict]:
    """Trains in ``mode`` ("async", "hogwild" or "ssp"); returns the trained ``.keras`` bytes, history and stats.

    With ``resumed`` the server starts from that checkpoint's weights (and its shards'
    optimizer state, when it was saved by a server of the same layout) and the workers at its
    epoch. With ``checkpoints`` the server's state is saved each time every worker has
    finished an epoch (the weights then include whatever faster workers pushed since).
    """
    if resumed is not None:
        model_bytes = resumed.model_bytes
    server_model = ServerModel(serialization.model_from_bytes(model_bytes, custom_objects), num_servers)
    if resumed is not None and not server_model.restore_optimizers(resumed.arrays):
        logger.info("sparkdl: the checkpoint holds no optimizer state for %d server shard(s) of this model: the "
                    "shards' optimizers start afresh", num_servers)
    initial_epoch = resumed.epoch if resumed is not None else 0
    earlier_history = resumed.history if resumed is not None else {}
    host = session.driver_host(spark)
    secret = secrets.token_bytes(32)
    with ParameterServer(server_model.shards, host=host, secret=secret, mode=mode, num_workers=num_workers,
                         max_staleness=max_staleness, timeout=timeout) as server:
        job = session.ship(spark, AsyncJob(
            model_bytes=model_bytes, secret=secret, addresses=server.addresses, shards=server_model.layout.shards,
            shapes=training.shapes, epochs=epochs, batch_size=batch_size,
            steps_per_epoch=steps_per_epoch, push_every=push_every, seed=seed, shuffle=shuffle, timeout=timeout,
            custom_objects=custom_objects, initial_epoch=initial_epoch, callbacks=tuple(callbacks),
        ), size=len(model_bytes), what="the model")
        with BackgroundWriter(checkpoints) if checkpoints else contextlib.nullcontext() as writer:
            if writer is not None:
                monitor.add_listener(_ServerCheckpoints(writer, server, server_model, mode, earlier_history))
            try:
                results = launch.run_tasks(
                    training.frame, num_workers,
                    lambda batches, reporter: run_async_task(batches, reporter, job.value),
                    barrier=False, timeout=timeout, on_progress=monitor.on_event)
            finally:
                job.destroy()
        server_stats = server.stats()
    outcomes = [json.loads(payload) for payload in results.values()]
    stats = {**{name: sum(outcome["counters"][name] for outcome in outcomes) for name in COUNTERS},
             **{name: server_stats[name] for name in ("max_staleness", "versions", "refused_connections")}}
    history = merge_histories(earlier_history, combine_histories(outcomes))
    return serialization.model_to_bytes(server_model.model), history, stats


class _ServerCheckpoints:
    """An epoch listener: when every worker has finished an epoch, saves the server's state."""

    def __init__(self, writer: BackgroundWriter, server: ParameterServer, server_model: ServerModel, mode: str,
                 earlier_history: dict[str, list[float]]):
        self.writer = writer
        self._server = server
        self._server_model = server_model
        self._mode = mode
        self._history = {name: list(values) for name, values in earlier_history.items()}

    def on_epoch(self, epoch: int, logs: dict[str, float], samples_per_second: float) -> None:
        for name, value in logs.items():
            self._history.setdefault(name, []).append(value)
        with self._server.holding_updates():  # weights and optimizer state of one moment
            model_bytes = serialization.model_to_bytes(self._server_model.model)
            arrays = self._server_model.optimizer_arrays()
        self.writer.save(Checkpoint(epoch + 1, model_bytes, {k: list(v) for k, v in self._history.items()},
                                    self._mode, arrays))

    def close(self) -> None:
        """The writer is closed by ``run_parameter_server``, which raises its errors."""


def combine_histories(results: list[dict]) -> dict[str, list[float]]:
    """One history from the workers' ``{"history": ..., "validation_rows": n}`` results.

    Training metrics are the plain mean over workers (every worker runs the same steps);
    ``val_*`` metrics are weighted by each worker's held-out rows, so they are the metrics over
    all held-out rows (workers without held-out rows report none and weigh nothing).
    """
    epochs = max((len(values) for result in results for values in result["history"].values()), default=0)
    history: dict[str, list[float]] = {}
    for epoch in range(epochs):
        logs = [{name: values[epoch] for name, values in r["history"].items() if epoch < len(values)} for r in results]
        for name, value in combine_worker_logs(logs, [r["validation_rows"] for r in results]).items():
            history.setdefault(name, []).append(value)
    return history
