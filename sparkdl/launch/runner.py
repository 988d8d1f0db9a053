"""``sparkdl.run``: any function on N Spark barrier tasks, with a collective backend set up around it."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from pyspark import cloudpickle
from pyspark.sql import SparkSession

from sparkdl.launch import probe
from sparkdl.launch.backends import check_backend, user_backend
from sparkdl.launch.session import encrypts_traffic
from sparkdl.launch.slots import claim_slots
from sparkdl.launch.stage import run_tasks


def run(
    train_fn: Callable[..., Any],
    num_workers: int = 2,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    backend: str = "sparkdl",
    timeout: float = 600.0,
    spark: SparkSession | None = None,
) -> Any:
    """Runs ``train_fn(*args, **kwargs)`` on ``num_workers`` Spark tasks at once; returns rank 0's return value.

    ``backend="sparkdl"``: the tasks are joined by sparkdl's authenticated communicator,
    reachable through ``sparkdl.collective`` (``rank()``, ``allreduce(...)``, ...).
    ``backend="horovod"``: Horovod's Gloo rendezvous is set up, so an unchanged
    Horovod script's ``hvd.init()`` joins the job (needs the Horovod stack,
    ``conf/horovod/install.sh``).

    Each task's stdout and stderr appear on the driver as they are written,
    prefixed with ``[rank N]``. If a rank raises, the job is cancelled and the
    exception is raised here as a ``sparkdl.WorkerError`` (also an instance of
    the remote built-in type, e.g. ``ValueError``) carrying the remote
    traceback. A task that dies without raising (a lost executor) makes Spark
    retry the whole stage. ``timeout`` bounds every network wait of the setup
    and of the ring. Rank 0's return value travels back through Spark's own
    task-result channel (pickled, as every PySpark ``collect`` is); sparkdl's
    own sockets never carry pickles.

    Example:
        >>> def train(scale):
        ...     from sparkdl import collective
        ...     return collective.allreduce(np.ones(2) * scale * (collective.rank() + 1))
        >>> sparkdl.run(train, num_workers=2, args=(10,))
        array([30., 30.])
    """
    if not callable(train_fn):
        raise ValueError(f"Expected `train_fn` to be a function. Received: {type(train_fn).__name__}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"Expected `num_workers` to be a positive integer. Received: num_workers={num_workers!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"Expected `timeout` to be a positive number of seconds. Received: timeout={timeout!r}")
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs or {}, dict):
        raise ValueError("Expected `args` to be a tuple and `kwargs` a dict (the function's arguments).")
    check_backend(backend)
    spark = spark or SparkSession.getActiveSession()
    if spark is None:
        raise ValueError("sparkdl.run needs a SparkSession: create one first or pass `spark=`.")
    secret = secrets.token_bytes(32)
    encrypt = encrypts_traffic(spark)
    call_args, call_kwargs = tuple(args), dict(kwargs or {})

    def task(batches, reporter) -> bytes | None:
        for _ in batches:  # one placeholder row per task: nothing to read
            pass
        from pyspark import BarrierTaskContext

        with user_backend(backend, reporter, secret, timeout, encrypt=encrypt):
            result = train_fn(*call_args, **call_kwargs)
        return cloudpickle.dumps(result) if BarrierTaskContext.get().partitionId() == 0 else None

    placeholder = spark.range(num_workers, numPartitions=num_workers)
    with claim_slots(spark, num_workers, timeout=timeout):  # before the probe: it is the first job
        probe.check_workers(spark, num_workers, probe.startup_timeout(timeout), probe.LAUNCH_MODULES)
        results = run_tasks(placeholder, num_workers, task, barrier=True, timeout=timeout, spark_results=True)
    return cloudpickle.loads(results[0])
