"""Where a fit's time goes: named phases timed on the driver and inside the tasks, on one timeline.

The driver names its own phases as they end (``settings``, ``checks``, ...). A task names its own
(``read``, ``connect``, ``train``, ...) with ``TaskReporter.phase`` and reports them, just before it
uploads its result, over its relay connection (``sparkdl.launch.stage``). Only durations travel,
never clock readings: the driver places a task's phases on its own clock so that they end when
their report arrives, and the gap before them (the stage's launch: Spark's scheduling, the
Python worker, the task's closure) needs no clock shared between machines. A task that names no
phase is reported as one phase, ``task``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

PHASES_EVENT = "phases"  # the progress event a task's phases travel in: {"event": "phases", "phases": {...}}
LAUNCH = "launch"  # the name of the gap before a placed task's phases


class Phases:
    """Wall-clock seconds of consecutive phases: each ``end(name)`` names the time since the previous one.

    A name ended again grows by the time since (an average fit's rounds, a retried stage).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = time.perf_counter()
        self._seconds: dict[str, float] = {}

    def end(self, name: str) -> None:
        """Ends the running phase, naming it ``name``."""
        with self._lock:
            now = time.perf_counter()
            self._add(name, now - self._last)
            self._last = now

    def place(self, task_phases: Mapping[str, float]) -> None:
        """Ends the running phase as ``launch`` where a task's ``task_phases``, just reported, began, and
        adds them: they end now."""
        with self._lock:
            now = time.perf_counter()
            seconds = {str(name): max(0.0, float(value)) for name, value in task_phases.items()}
            self._add(LAUNCH, now - sum(seconds.values()) - self._last)
            for name, value in seconds.items():
                self._add(name, value)
            self._last = now

    def watch(self, rank: int, event: Mapping) -> None:
        """A listener of the tasks' progress events: places rank 0's phases (the rank that gets the model and
        returns the result in sync mode; in every mode, the first rank)."""
        if rank == 0 and event.get("event") == PHASES_EVENT:
            self.place(event["phases"])

    def seconds(self) -> dict[str, float]:
        """Each phase's seconds, in the order the phases first ended."""
        with self._lock:
            return dict(self._seconds)

    def event(self, unnamed: str = "task") -> dict:
        """The progress event that reports these phases (a task's); without any, the time so far as ``unnamed``."""
        if not self._seconds:
            self.end(unnamed)
        return {"event": PHASES_EVENT, "phases": self.seconds()}

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.seconds().items())

    def _add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + max(0.0, seconds)
