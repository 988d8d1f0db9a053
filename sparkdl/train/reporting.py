"""Worker-side Keras callbacks that tell the driver how training goes, and save epoch checkpoints.

Both stay off the hot path: the progress callback reads the clock once per
step and sends at most one small JSON event per ``interval`` seconds (plus one
per epoch) over the task's relay connection; the checkpoint callback hands the
upload to a background thread (``checkpoint.BackgroundWriter``).
"""

from __future__ import annotations

import time
from typing import Callable

from sparkdl.checkpoint import BackgroundWriter, Checkpoint
from sparkdl.train import serialization
from sparkdl.train.optimizer_hooks import unhooked

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


def merge_histories(earlier: dict[str, list[float]], later: dict[str, list[float]]) -> dict[str, list[float]]:
    """The history of epochs resumed from a checkpoint followed by this run's."""
    return {name: list(earlier.get(name, [])) + list(values) for name, values in later.items()}


def progress_callback(report: Callable[[dict], None], *, steps_per_epoch: int, batch_size: int,
                      validation_rows: int = 0, interval: float = STEP_REPORT_SECONDS):
    """Reports step progress (rate-limited) and every epoch's logs and throughput to the driver."""
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
            step = batch + 1
            report({"event": "step", "epoch": self._epoch, "step": step, "logs": numeric_logs(logs),
                    "samples_per_second": (step - self._reported_step) * batch_size / (now - self._reported_at)})
            self._reported_at, self._reported_step = now, step

        def on_epoch_end(self, epoch, logs=None):
            seconds = max(time.monotonic() - self._epoch_started, 1e-9)
            report({"event": "epoch", "epoch": epoch, "logs": numeric_logs(logs),
                    "samples_per_second": steps_per_epoch * batch_size / seconds,
                    "validation_rows": validation_rows})

    return ReportProgress()


def checkpoint_callback(writer: BackgroundWriter, earlier_history: dict[str, list[float]], mode: str):
    """Saves the model with its optimizer state after every epoch, with the history so far.

    Placed after the callback that averages metrics over ranks, so that the
    saved history holds the global values.
    """
    import keras

    class SaveCheckpoint(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._history = {name: list(values) for name, values in earlier_history.items()}

        def on_epoch_end(self, epoch, logs=None):
            for name, value in numeric_logs(logs).items():
                self._history.setdefault(name, []).append(value)
            with unhooked(self.model.optimizer):  # saved as the user's own optimizer class
                model_bytes = serialization.model_to_bytes(self.model)
            writer.save(Checkpoint(epoch + 1, model_bytes, {k: list(v) for k, v in self._history.items()}, mode))

    return SaveCheckpoint()
