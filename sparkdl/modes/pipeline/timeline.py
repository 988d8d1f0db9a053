"""What ``profile=True`` records on each pipeline stage: when each micro-batch's forward and backward pass start and
end, read in the stage's own process, so that how the stages overlap can be seen in the order of real events.

A stage keeps the events of its last :data:`KEPT_STEPS` training steps (a fixed amount, however long the fit);
without ``profile`` it keeps none. Times are ``time.monotonic()`` seconds, read in the stage's task: on Linux
one clock (``CLOCK_MONOTONIC``) for every process of a host, so the events of stages on one host compare
directly; stages on different hosts read different clocks.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

EVENTS = ("forward_start", "forward_end", "backward_start", "backward_end")
FORWARD_START, FORWARD_END, BACKWARD_START, BACKWARD_END = range(len(EVENTS))
KEPT_STEPS = 8


class StageTimeline:
    """One stage's events over its last :data:`KEPT_STEPS` training steps."""

    def __init__(self) -> None:
        self._steps: deque[list[tuple[float, int, int, int]]] = deque(maxlen=KEPT_STEPS)
        self._step = -1

    def begin_step(self) -> None:
        self._step += 1
        self._steps.append([])

    def mark(self, event: int, micro_batch: int) -> None:
        """``event`` (one of :data:`EVENTS`, by index) of ``micro_batch`` in the current step, now."""
        self._steps[-1].append((time.monotonic(), self._step, micro_batch, event))

    def array(self) -> np.ndarray:
        """The kept events as rows ``(time, step, micro-batch, event)``, in the order they happened."""
        rows = [row for step in self._steps for row in step]
        return np.array(rows, np.float64).reshape(len(rows), 4)


def events(stage_arrays: list[np.ndarray]) -> list[dict]:
    """``FitResult.stats["pipeline"]["timeline"]``: every stage's events (its :meth:`StageTimeline.array`, by
    stage), each ``{"stage", "step", "micro_batch", "event", "time"}``, ordered by time."""
    rows = [
        {"stage": stage, "step": int(step), "micro_batch": int(m), "event": EVENTS[int(event)], "time": float(when)}
        for stage, array in enumerate(stage_arrays)
        for when, step, m, event in array.tolist()
    ]
    return sorted(rows, key=lambda row: row["time"])
