"""The faults a cluster meets, injected into the emulated hosts while a fit trains.

Each fault is a :class:`Fault`: a name, a description and ``inject(cluster, host, stop)``, which breaks host ``host``
and keeps it broken until its duration has passed or ``stop`` is set, then repairs what it broke (a fault "for good"
repairs nothing). :class:`Injection` runs one in a thread of its own, started when the fit's training has begun (the
first line of training progress, :class:`TrainingStarted`) and a moment after, so that it strikes in the middle of a
step; leaving the ``with`` block stops it (a link comes back, a stopped process goes on) and waits for it.

    with TrainingStarted() as started, Injection(link_down(5), cluster, host=1, when=started.event) as injected:
        result = sparkdl.fit(...)
    injected.struck  # when it struck (time.monotonic()), None if it did not
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from hostnet.spark_cluster import SparkCluster


@dataclasses.dataclass(frozen=True)
class Fault:
    """``inject`` raises LookupError when the host holds nothing it could strike (no executor, no Python worker)."""

    name: str
    description: str
    inject: Callable[[SparkCluster, int, threading.Event], str]  # (cluster, host, stop) -> what it did
    for_good: bool = False  # the host stays broken after the fit: the cluster cannot be used again


def link_down(seconds: float) -> Fault:
    def inject(cluster: SparkCluster, host: int, stop: threading.Event) -> str:
        cluster.network.link(host, up=False)
        down = time.monotonic()
        try:
            stop.wait(seconds)
        finally:
            cluster.network.link(host, up=True)
        return f"host {host}'s link down, up again after {time.monotonic() - down:.1f} s"

    return Fault(f"link down {seconds:g} s", f"host's link to the switch down for {seconds:g} s, then up", inject)


def packet_loss(fraction: float, seconds: float) -> Fault:
    def inject(cluster: SparkCluster, host: int, stop: threading.Event) -> str:
        delay, _ = cluster.network.impairment
        cluster.network.impair(delay=delay, loss=fraction)
        began = time.monotonic()
        try:
            stop.wait(seconds)
        finally:
            cluster.network.impair(delay=delay)
        return f"{fraction:.0%} of the packets arriving at every host dropped for {time.monotonic() - began:.1f} s"

    name = f"{fraction:.0%} loss {seconds:g} s"
    return Fault(name, f"{fraction:.0%} of every host's arriving packets dropped for {seconds:g} s", inject)


def partition() -> Fault:
    def inject(cluster: SparkCluster, host: int, stop: threading.Event) -> str:
        cluster.network.link(host, up=False)
        return f"host {host} cut off for good"

    return Fault("partition", "host's link down for good: the host is cut off", inject, for_good=True)


def kill_executor() -> Fault:
    def inject(cluster: SparkCluster, host: int, stop: threading.Event) -> str:
        pid = cluster.executor_pid(host)
        if pid is None:
            raise LookupError(f"host {host} runs no executor: nothing killed")
        os.kill(pid, signal.SIGKILL)
        return f"host {host}'s executor JVM (pid {pid}) killed with SIGKILL"

    return Fault("executor SIGKILL", "host's executor JVM killed with SIGKILL", inject)


def stop_worker(seconds: float) -> Fault:
    def inject(cluster: SparkCluster, host: int, stop: threading.Event) -> str:
        deadline = time.monotonic() + 10  # the host's task may start a moment after another host's reported
        while not (workers := cluster.python_workers(host)):
            if stop.is_set() or time.monotonic() > deadline:
                raise LookupError(f"host {host} runs no Python worker: nothing stopped")
        pid = workers[0]
        os.kill(pid, signal.SIGSTOP)
        began = time.monotonic()
        try:
            stop.wait(seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return (
            f"host {host}'s busiest Python worker (pid {pid}) stopped, continued after {time.monotonic() - began:.1f} s"
        )

    return Fault(
        f"worker SIGSTOP {seconds:g} s",
        f"host's busiest Python worker stopped for {seconds:g} s, then continued",
        inject,
    )


#: No fault at all: the clean fits that the faulted ones are compared with run through the same trial.
NO_FAULT = Fault("none", "no fault", lambda cluster, host, stop: "nothing")

#: The faults of issue 42, in the order a benchmark runs them (the one for good last).
FAULTS = (link_down(5), packet_loss(0.01, 60), kill_executor(), stop_worker(60), partition())


class TrainingStarted(logging.Handler):
    """Set once sparkdl's progress logger (``sparkdl.progress``) reports training: a rank resuming from a checkpoint
    or an epoch's end. As a context manager it listens, at INFO, from entry to exit."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.event = threading.Event()
        self.epoch_ends: list[float] = []  # time.monotonic() of each epoch line

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("epoch "):
            self.epoch_ends.append(time.monotonic())
        if message.startswith("epoch ") or "resumes at epoch" in message:
            self.event.set()

    def __enter__(self) -> TrainingStarted:
        progress = logging.getLogger("sparkdl.progress")
        self._level = progress.level
        progress.setLevel(logging.INFO)
        progress.addHandler(self)
        return self

    def __exit__(self, *exc_info) -> None:
        progress = logging.getLogger("sparkdl.progress")
        progress.removeHandler(self)
        progress.setLevel(self._level)

    def epoch_seconds(self) -> float | None:
        """The median time between two consecutive epoch lines (None with fewer than two)."""
        gaps = sorted(b - a for a, b in zip(self.epoch_ends, self.epoch_ends[1:]))
        return gaps[len(gaps) // 2] if gaps else None


class Injection:
    """Injects ``fault`` into host ``host`` of ``cluster`` from a thread, ``after`` seconds past ``when`` (an event:
    training has started); stops it at the end of the ``with`` block. ``struck``: when it struck (``time.monotonic()``;
    None if it did not); ``done``: what it did; ``error``: why it failed, if it did."""

    def __init__(self, fault: Fault, cluster: SparkCluster, *, host: int, when: threading.Event, after: float = 0.5):
        self.fault, self.cluster, self.host, self.when, self.after = fault, cluster, host, when, after
        self.struck: float | None = None
        self.done = ""
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fault {fault.name}", daemon=True)

    def _run(self) -> None:
        while not self.when.wait(0.1):
            if self._stop.is_set():
                return
        if self._stop.wait(self.after):
            return
        self.struck = time.monotonic()
        try:
            self.done = self.fault.inject(self.cluster, self.host, self._stop)
        except LookupError as nothing:  # nothing to strike there: the fit went on unharmed
            self.struck, self.done = None, str(nothing)
        except BaseException as error:  # reported by the caller: a fault that could not be injected proves nothing
            self.error = error

    def __enter__(self) -> Injection:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
