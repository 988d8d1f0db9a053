"""What the barrier modes whose every rank trains a whole replica share: the ranks' row counts, the model they start
from, the driver side that takes rank 0's trained model back (sync, sharded, gossip), and the bytes each rank sent.

Rank 0 speaks for all of them: it fetches the model to start from (or a newer checkpoint, when Spark
retried the stage after a failed attempt saved one), reports progress, writes the checkpoints and
returns the whole trained model with the history (``serialization.result_to_bytes``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import numpy as np

from sparkdl import _compat, schedule
from sparkdl.checkpoint import Checkpoint, CheckpointStore
from sparkdl.data import Rows
from sparkdl.keras import serialization
from sparkdl.keras.prebuilt import PrebuiltModel
from sparkdl.launch import payloads, run_tasks
from sparkdl.launch.forward import TaskReporter
from sparkdl.metrics import combine_logs
from sparkdl.modes.base import Job, ModeResult, Settings

MODEL = "model"  # the name under which the driver offers the model to start from
#: Steps Keras runs per call of its train function, unless the model or a callback says otherwise.
STEPS_PER_CALL = 16


def rows_of_ranks(comm, rows, held_out, settings: Settings) -> tuple[Settings, np.ndarray]:
    """Every rank's ``(training, held-out)`` row counts (the same array on every rank, so that every rank takes the
    same decisions with no further talk), refusing a rank without rows or a fit without held-out rows; and the
    ``settings`` for those rows (every rank: the same steps per epoch)."""
    counts = comm.allgather(np.array([len(rows), len(held_out)], np.int64))
    rows_per_rank = counts[:, 0].tolist()
    schedule.require_rows(dict(enumerate(rows_per_rank)))
    settings = settings.for_rows(rows_per_rank)
    if comm.rank == 0:
        schedule.warn_fillers(rows_per_rank, settings.steps_per_epoch)
    if settings.validate and counts[:, 1].sum() == 0:
        raise ValueError("No worker partition got a validation row: the validation set is empty.")
    return settings, counts


@dataclasses.dataclass(frozen=True)
class Validation:
    """This rank's held-out rows, and every rank's count of them (the same array on every rank).

    A rank with no held-out rows still validates, on a stand-in (one of its training rows), so
    that every rank's epoch logs hold the same keys and every rank makes the same collective
    calls; its stand-in metrics have no rows behind them, so they weigh nothing (``metrics.combine_logs``).
    """

    rows: Rows
    rows_per_rank: np.ndarray

    def keras_data(self, training: Rows, batch_size: int):
        """Keras's ``validation_data`` for this rank: its held-out rows in batches, or the stand-in."""
        from sparkdl.keras.held_out import in_batches

        return in_batches(self.rows, batch_size) if len(self.rows) else training.take(np.arange(1))


def run_steps_per_call(model, callbacks: Sequence) -> None:
    """Lets Keras run up to :data:`STEPS_PER_CALL` steps per call of its train function.

    One call per step costs a Python round trip (Keras's loop, the logs, the callbacks) that a
    small model's step does not hide. The model's own ``compile(steps_per_execution=...)`` wins
    when the user set one; so does a user callback that acts on every batch, as it would
    otherwise be called once per call only (Keras's rule for ``steps_per_execution``).
    """
    import keras

    if _compat.keras_major() < 3 or model.steps_per_execution > 1:
        return
    batch_hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
    for callback in callbacks:
        if any(getattr(type(callback), hook) is not getattr(keras.callbacks.Callback, hook) for hook in batch_hooks):
            return
    model.steps_per_execution = STEPS_PER_CALL


def combine_over_ranks(comm, logs: dict, samples: float, validation_rows: float) -> None:
    """Collective: this rank's epoch ``logs`` replaced, in place, by every rank's combined (``metrics.combine_logs``:
    training metrics weighed by each rank's ``samples``, ``val_*`` by its ``validation_rows``); every rank gathers
    the same rows, so every rank computes the same combination."""
    keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number)))
    local = np.array([logs[k] for k in keys] + [samples, validation_rows], np.float64)
    rows = comm.allgather(local)
    logs.update(
        combine_logs([dict(zip(keys, row[:-2].tolist())) for row in rows], rows[:, -2].tolist(), rows[:, -1].tolist())
    )


def starting_point(
    comm, reporter: TaskReporter, settings: Settings, checkpoints: CheckpointStore | None, history: dict, mode: str
) -> Checkpoint:
    """Rank 0 gets the model to start from and sends it to every rank (the other ranks get no history).

    The driver offers what it resumes from (``Job.start``, with its ``history``); rank 0 prefers a newer
    checkpoint, which exists only when Spark retried the stage after a lost task and the failed attempt saved more.
    """
    start = None
    if comm.rank == 0:
        if checkpoints is not None:
            start = checkpoints.latest(newer_than=settings.initial_epoch)
        if start is None:
            start = Checkpoint(settings.initial_epoch, payloads.fetch(reporter, MODEL), history, mode)
    header = comm.broadcast(np.array([start.epoch, len(start.model_bytes)] if start else [0, 0], np.int64))
    model = comm.broadcast(np.frombuffer(start.model_bytes, np.uint8) if start else np.empty(int(header[1]), np.uint8))
    return start or Checkpoint(int(header[0]), model.tobytes(), {}, mode)


def wire_bytes(comm) -> list[dict] | None:
    """Collective, at a barrier task's end: ``FitResult.stats["wire_bytes"]``, every rank's payload bytes sent
    since it connected, by transport, operation and dtype (``SparkdlCommunicator.bytes_sent``), on rank 0; None
    on the other ranks, and on a backend without these counters (Horovod's). Counted before this gather."""
    bytes_sent = getattr(comm, "bytes_sent", None)  # sparkdl's communicator counts them; Horovod's does not
    if bytes_sent is None:
        return None
    own = np.frombuffer(json.dumps(bytes_sent()).encode(), np.uint8)
    gathered = comm.gather(own, root=0)
    return [json.loads(row.tobytes()) for row in gathered] if gathered is not None else None


def run_stage(job: Job, run_task: Callable, offered: dict[str, bytes] | None = None) -> ModeResult:
    """One barrier stage of ``job``'s tasks running ``run_task(batches, reporter)``, the model to start from (and
    ``offered``) on the driver's relay; rank 0's trained model, history and stats as the mode's result."""
    # The result's Keras model is built from the start point while the stage runs (``keras.prebuilt``).
    prebuilt = PrebuiltModel(job.start.model_bytes, job.settings.custom_objects, timeout=job.settings.timeout)
    results = run_tasks(
        job.training.frame,
        job.layout,
        run_task,
        barrier=True,
        timeout=job.settings.timeout,
        on_progress=job.monitor.on_event,
        offered={**(offered or {}), MODEL: job.start.model_bytes},
    )
    model_bytes, history, initial_epoch, stats, resumed_history = serialization.result_from_bytes(results[0])
    return ModeResult(prebuilt.trained(model_bytes), history, stats, initial_epoch, resumed_history)
