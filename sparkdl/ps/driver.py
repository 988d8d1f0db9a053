"""The driver side of the parameter-server modes: serve the shards while the worker tasks train.

Spark's own primitives carry what they suit: a broadcast ships the job (model,
server addresses, secret) to the tasks, and accumulators count what the tasks
did. The server binds to the driver's address only and is stopped, its ports
released, when training returns or raises.
"""

from __future__ import annotations

import json
import secrets

import numpy as np
from pyspark.sql import SparkSession

from sparkdl import launch
from sparkdl.data import TrainingData
from sparkdl.ps.server import ParameterServer
from sparkdl.ps.server_model import ServerModel
from sparkdl.ps.worker import AsyncJob, TaskCounters, run_async_task
from sparkdl.train import serialization


def run_parameter_server(
    spark: SparkSession, training: TrainingData, *, model_bytes: bytes, mode: str, num_workers: int,
    num_servers: int, epochs: int, batch_size: int, steps_per_epoch: int, push_every: int, max_staleness: int,
    seed: int, shuffle: bool, timeout: float, custom_objects,
) -> tuple[bytes, dict[str, list[float]], dict]:
    """Trains in ``mode`` ("async", "hogwild" or "ssp"); returns the trained ``.keras`` bytes, history and stats."""
    sc = spark.sparkContext
    server_model = ServerModel(serialization.model_from_bytes(model_bytes, custom_objects), num_servers)
    host = sc.getConf().get("spark.driver.host")
    secret = secrets.token_bytes(32)
    counters = TaskCounters.create(sc)
    with ParameterServer(server_model.shards, host=host, secret=secret, mode=mode, num_workers=num_workers,
                         max_staleness=max_staleness, timeout=timeout) as server:
        job = sc.broadcast(AsyncJob(
            model_bytes=model_bytes, secret=secret, addresses=server.addresses, shards=server_model.layout.shards,
            shapes=training.shapes, epochs=epochs, batch_size=batch_size,
            steps_per_epoch=steps_per_epoch, push_every=push_every, seed=seed, shuffle=shuffle, timeout=timeout,
            custom_objects=custom_objects,
        ))
        try:
            results = launch.run_tasks(training.frame, num_workers,
                                       lambda batches: run_async_task(batches, job.value, counters), barrier=False,
                                       timeout=timeout)
        finally:
            job.destroy()
        server_stats = server.stats()
    stats = {**counters.values(), "max_staleness": server_stats["max_staleness"],
             "versions": server_stats["versions"], "refused_connections": server_stats["refused_connections"]}
    history = combine_histories([json.loads(payload) for payload in results.values()])
    return serialization.model_to_bytes(server_model.model), history, stats


def combine_histories(results: list[dict]) -> dict[str, list[float]]:
    """One history from the workers' ``{"history": ..., "validation_rows": n}`` results.

    Training metrics are the plain mean over workers (every worker runs the same steps);
    ``val_*`` metrics are weighted by each worker's held-out rows, so they are the metrics over
    all held-out rows (workers without held-out rows report none and weigh nothing).
    """
    names = list(dict.fromkeys(name for result in results for name in result["history"]))
    history = {}
    for name in names:
        having = [r for r in results if name in r["history"]]
        values = np.array([r["history"][name] for r in having], np.float64)
        if name.startswith("val_"):
            weights = np.array([r["validation_rows"] for r in having], np.float64)
        else:
            weights = np.ones(len(having))
        history[name] = (weights @ values / weights.sum()).tolist()
    return history
