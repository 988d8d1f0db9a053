"""The exception a worker's failure becomes on the driver."""

from __future__ import annotations

import builtins
import functools
from collections.abc import Sequence

from sparkdl.data.rules import RowCheckError
from sparkdl.launch.relay_frames import ErrorReport


class WorkerError(Exception):
    """A rank's function raised; carries that rank, the remote exception type and its traceback.

    When the remote exception is a built-in one (``ValueError``, ``KeyError``,
    ...), the raised error is also an instance of it, so ``except ValueError``
    on the driver catches a ``ValueError`` raised in a worker.
    """

    def __init__(self, message: str, *, rank: int, type_name: str, remote_traceback: str):
        super().__init__(message)
        self.rank = rank
        self.type_name = type_name
        self.remote_traceback = remote_traceback


def worker_error(report: ErrorReport, others: Sequence[ErrorReport] = ()) -> Exception:
    """The driver-side exception for ``report`` (and a line per other rank that failed after it); the rows' checks'
    :class:`~sparkdl.data.rules.RowCheckError` as itself, its message alone (every rank raises the same)."""
    if report.type_name == f"{RowCheckError.__module__}.{RowCheckError.__qualname__}":
        return RowCheckError(report.message)
    message = f"rank {report.rank} raised {report.type_name}: {report.message}"
    followers = [f"rank {o.rank}: {o.type_name}: {o.message}" for o in others if o is not report]
    if followers:
        message += "\n\nThen, on other ranks:\n  " + "\n  ".join(followers)
    message += f"\n\nRemote traceback (rank {report.rank}):\n{report.traceback.rstrip()}"
    return _error_class(report.type_name)(
        message, rank=report.rank, type_name=report.type_name, remote_traceback=report.traceback
    )


@functools.cache
def _error_class(type_name: str) -> type:
    builtin = getattr(builtins, type_name, None)
    if not (isinstance(builtin, type) and issubclass(builtin, Exception)) or issubclass(builtin, WorkerError):
        return WorkerError
    try:
        return type(type_name, (WorkerError, builtin), {"__module__": __name__})
    except TypeError:  # a built-in whose instance layout cannot be combined (e.g. some OSError subclasses)
        return WorkerError


class InputLost(RuntimeError):
    """Inside a task: reading its input rows from Spark failed (the stream of Arrow batches ended unreadable, as when
    the shuffle blocks it reads were on an executor that was lost). Spark's to handle, not the task's own error: the
    JVM side of the task fails with Spark's fetch failure, and Spark recomputes the lost blocks and runs the task
    again, so it neither cancels the job nor becomes the fit's error."""


class ResultLost(RuntimeError):
    """A barrier stage's rank whose result the driver needs was run again alone after the stage's other ranks had
    finished (Spark resubmits only the partitions whose output it lost: an executor lost at the stage's end), and
    its attempt that trained with them had not returned its result to the driver; a rank cannot train alone."""


class SlotsLost(RuntimeError):
    """A stage that needs all its tasks at once lost task slots (an executor that did not come back) and could not
    run again with all of them within the fit's ``timeout``: ``needed`` slots, ``available`` now, ``hosts`` those
    whose executors went away (empty where Spark does not say), ``ranks`` the stage's ranks that ran there;
    ``reports``: what the ranks raised meanwhile (their waits for the lost ones), a line each."""

    def __init__(
        self,
        needed: int,
        available: int,
        seconds: float,
        hosts: Sequence[str] = (),
        ranks: Sequence[int] = (),
        reports: Sequence[ErrorReport] = (),
    ):
        where = f" on {', '.join(hosts)}" if hosts else ""
        if ranks:
            where += f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ran there)"
        message = (
            f"Expected {needed} task slots for the training stage. Received: the cluster has had {available} since "
            f"an executor was lost{where}, for {seconds:.0f}s (timeout), so the stage cannot run again with all its "
            f"tasks. Give the cluster its executors back, or, where the mode can, let the fit go on with fewer "
            f"workers: min_workers={available} or less (docs/checkpoints.md)."
        )
        lines = list(dict.fromkeys(f"rank {report.rank}: {report.summary}" for report in reports))
        if lines:
            message += "\n\nMeanwhile, on the ranks:\n  " + "\n  ".join(lines[:_REPORTED_LINES])
        super().__init__(message)
        self.needed, self.available, self.seconds = needed, available, seconds
        self.hosts, self.ranks, self.reports = list(hosts), list(ranks), list(reports)

    def seen_by(self, reports: Sequence[ErrorReport]) -> SlotsLost:
        """This error with what the ranks raised meanwhile."""
        return SlotsLost(self.needed, self.available, self.seconds, self.hosts, self.ranks, reports)


_REPORTED_LINES = 6  # of the ranks' errors, in a SlotsLost
