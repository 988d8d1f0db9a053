"""Worker-side Keras callbacks that tell the driver how training goes, and save epoch and step checkpoints.

Both stay off the hot path: the progress callback reads the clock once per
step and sends at most one small JSON event per ``interval`` seconds (plus one
per epoch) over the task's relay connection; the checkpoint callback hands the
upload to the checkpointer's background thread (``checkpoint.Checkpointer``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from sparkdl.checkpoint import Checkpointer, StepCheckpoints
from sparkdl.keras import random_state, serialization
from sparkdl.keras.optimizer_hooks import saved_form
from sparkdl.position import EpochPosition

# Seconds between two step reports of one worker (the driver's progress bar moves about this often).
STEP_REPORT_SECONDS = 1.0


def numeric_logs(logs) -> dict[str, float]:
    """The numbers among Keras's logs, as plain floats (JSON-able)."""
    return {name: float(value) for name, value in (logs or {}).items() if _is_number(value)}


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def progress_callback(
    report: Callable[[dict], None],
    *,
    steps_per_epoch: int,
    rows_per_epoch: int,
    validation_rows: int = 0,
    interval: float = STEP_REPORT_SECONDS,
):
    """Reports step progress (rate-limited) and every epoch's logs and throughput to the driver.

    ``rows_per_epoch`` are the training rows behind the reported metrics (the rank's own, or all ranks'
    when one reports for all). An epoch event carries them (``samples``, ``validation_rows``), which
    weigh the metrics when the driver combines workers (``metrics.combine_logs``).
    """
    import keras

    class ReportProgress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch
            self._epoch_started = self._reported_at = time.monotonic()
            self._reported_step = 0

        def on_train_batch_end(self, batch, logs=None):
            now = time.monotonic()
            if now - self._reported_at < interval:
                return
            step = min(batch + 1, steps_per_epoch)  # Keras numbers a call of several steps by its last
            report(
                {
                    "event": "step",
                    "epoch": self._epoch,
                    "step": step,
                    "logs": numeric_logs(logs),
                    "samples_per_second": (step - self._reported_step)
                    * rows_per_epoch
                    / steps_per_epoch
                    / (now - self._reported_at),
                }
            )
            self._reported_at, self._reported_step = now, step

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.monotonic() - self._epoch_started
            report(epoch_event(epoch, numeric_logs(logs), rows_per_epoch, validation_rows, seconds))

    return ReportProgress()


def start_event(initial_epoch: int, steps_per_epoch: int, rows: int, validation_rows: int) -> dict:
    """The progress event of training's start: the epoch it starts at, a worker's steps per epoch, and the training
    and held-out rows the reporting task knows of (every worker's, or its own where each reports for itself)."""
    return {
        "event": "start",
        "initial_epoch": initial_epoch,
        "steps_per_epoch": steps_per_epoch,
        "rows": rows,
        "validation_rows": validation_rows,
    }


def epoch_event(epoch: int, logs: dict, samples: int, validation_rows: int, seconds: float) -> dict:
    """The progress event of an epoch's end: its ``logs``, the training ``samples`` and ``validation_rows`` behind
    them (which weigh them when the driver combines workers) and the throughput of its ``seconds``."""
    return {
        "event": "epoch",
        "epoch": epoch,
        "logs": logs,
        "samples_per_second": samples / max(seconds, 1e-9),
        "samples": samples,
        "validation_rows": validation_rows,
    }


def checkpoint_callback(checkpointer: Checkpointer):
    """Saves the model with its optimizer state after every epoch, with the history so far.

    Placed after the callback that combines metrics over ranks, so that the
    saved history holds the global values.
    """
    import keras

    class SaveCheckpoint(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            checkpointer.record(numeric_logs(logs))
            with saved_form(self.model):  # saved as the user's own optimizer
                model_bytes = serialization.model_to_bytes(self.model)
            checkpointer.save(epoch + 1, model_bytes, {random_state.DRAWS: random_state.draws(self.model)})

    return SaveCheckpoint()


def step_checkpoint_callback(
    checkpoints: StepCheckpoints,
    checkpointer: Checkpointer | None,
    position_at: Callable[[int, int], EpochPosition],
    around_save: Callable[[], contextlib.AbstractContextManager] | None = None,
):
    """Saves the model with its optimizer state mid-epoch, at the steps ``checkpoints`` says, with where the epoch
    stands: ``position_at(epoch, steps)`` after ``steps`` of the fit's steps in epoch ``epoch``.

    On a writer that saves alone (the replicas are one model) it is the writer's only. Where every rank takes part in
    a save, every rank runs it: the save runs inside ``around_save()`` (collective: a sharded optimizer's state
    gathered, the replicas' average held), and the writer, the rank with a ``checkpointer``, writes it."""
    import keras

    class SaveStepCheckpoint(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            steps = batch + 1  # Keras numbers a call of several steps by its last
            if not checkpoints.due(self._epoch, steps, self.params["steps"]):
                return
            with checkpoints.saving(), around_save() if around_save is not None else contextlib.nullcontext():
                if checkpointer is not None:
                    with saved_form(self.model):
                        model_bytes = serialization.model_to_bytes(self.model)
                    draws = {random_state.DRAWS: random_state.draws(self.model)}
                    checkpointer.save(self._epoch, model_bytes, draws, position=position_at(self._epoch, steps))

    return SaveStepCheckpoint()
