"""Live training progress on the driver: a progress bar, one line per epoch, and epoch-end listeners.

Workers report through their relay connection (``keras.callbacks``): step
events at most once a second, and one event per epoch with its metrics and
throughput. :class:`ProgressMonitor` turns them into

- a ``tqdm`` progress bar (``tqdm.auto``: a widget in Jupyter, text in a terminal),
  shown where someone can see it and not written into log files;
- one line per epoch, ``epoch 3/20  loss=0.1234  accuracy=0.9600  (4210 samples/s)``,
  logged on the ``sparkdl.progress`` logger (INFO) and, where the user's logging
  configuration would not show that record, printed to stdout by sparkdl itself:
  exactly one line per epoch either way, without adding handlers or setting levels;
  a step line at most every ``STEP_LOG_SECONDS`` is logged at DEBUG;
- calls to the epoch listeners (TensorBoard, MLflow, the parameter-server
  checkpoint), once per epoch, with the metrics combined over the workers
  (``metrics.combine_logs``, the one rule every mode uses).

While a text bar is shown, the epoch lines and everything else written to the
console (the ``[rank N]`` worker output, ``print``, the root logger's console
handlers, as tqdm's ``logging_redirect_tqdm`` does) go above it: the bar is
cleared, the lines written, the bar drawn again, so that they do not garble each other.

How many workers report is the mode's (``Plan.reporting_ranks``): in sync mode rank 0
speaks for all ranks (their metrics are combined already); in the parameter-server
modes every worker reports and an epoch is complete once all of them have finished
it. Average mode reports from the driver itself.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeGuard

from sparkdl.metrics import combine_logs

logger = logging.getLogger("sparkdl.progress")

# Seconds between two step lines in the log (the bar moves with every step event).
STEP_LOG_SECONDS = 30.0

# Held by the monitor that shows a bar, which also redirects the process's console above it: fits running
# side by side (CrossValidator's `parallelism`) would stack and unwind those redirects out of order, so
# the others show their epoch lines only.
_BAR = threading.Lock()


class EpochListener(Protocol):
    def on_epoch(self, epoch: int, logs: dict[str, float], samples_per_second: float) -> None: ...

    def close(self) -> None: ...


def in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


def bar_is_visible() -> bool:
    """A bar helps in a terminal or a notebook; in a log file it is noise."""
    return in_notebook() or sys.stderr.isatty()


def format_logs(logs: dict[str, float]) -> str:
    """``loss=0.1234  accuracy=0.9600  val_loss=...``: loss first, validation metrics last, as Keras shows them."""
    names = sorted(logs, key=lambda name: (name.startswith("val_"), name.removeprefix("val_") != "loss"))
    return "  ".join(f"{name}={_format_value(logs[name])}" for name in names)


def _format_value(value: float) -> str:
    return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.4e}"


def epoch_line(epoch: int, epochs: int, logs: dict[str, float], samples_per_second: float) -> str:
    """One epoch's line (``epoch`` counts from 1)."""
    return f"epoch {epoch}/{epochs}  {format_logs(logs)}  ({samples_per_second:.0f} samples/s)"


def _logging_shows(record_logger: logging.Logger, level: int) -> bool:
    """Whether a record at ``level`` would reach a handler of the user's logging configuration."""
    if not record_logger.isEnabledFor(level):
        return False
    current: logging.Logger | None = record_logger
    while current is not None:
        if any(level >= handler.level for handler in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def _is_console_handler(handler: logging.Handler) -> TypeGuard[logging.StreamHandler]:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


class ProgressMonitor:
    """Collects the workers' progress events (from relay threads) and shows them.

    ``reporting_ranks`` is how many workers report per epoch (1 in sync mode).
    ``console``: show progress on the console (the bar where one can be seen, and
    the epoch lines unless the user's logging shows them); without it the epoch
    lines are only logged. ``watch(rank, event)`` sees every worker event first (``fit``
    times its phases with it). Use it as a context manager: while it is open and a text
    bar is shown, other console output goes above the bar.
    """

    def __init__(
        self,
        *,
        epochs: int,
        steps_per_epoch: int,
        reporting_ranks: int,
        initial_epoch: int = 0,
        console: bool = False,
        listeners: Sequence[EpochListener] = (),
        description: str = "sparkdl",
        watch: Callable[[int, dict], None] | None = None,
    ):
        self._epochs = epochs
        self._watch = watch
        self._steps_per_epoch = steps_per_epoch  # the driver's estimate, then the largest a worker reported
        self._reported_steps: dict[int, int] = {}  # rank -> its steps per epoch (workers report them when they start)
        self._reported_rows: dict[int, tuple[int, int]] = {}  # rank -> the (training, held-out) rows it counted
        self._reporting_ranks = reporting_ranks
        self._listeners = list(listeners)
        self._lock = threading.Lock()
        self._epoch_reports: dict[int, dict[int, dict]] = {}  # epoch -> rank -> epoch event
        self._finished_epochs: set[int] = set()
        self._positions: dict[int, int] = {}  # rank -> global steps done
        self._rates: dict[int, float] = {}  # rank -> latest samples/s
        self._step_logged_at = time.monotonic()
        self._console = console
        self._stdout = sys.stdout  # where sparkdl's own lines go, also while the console is redirected above a bar
        self._redirects = contextlib.ExitStack()
        self._bar = None
        self._bar_held = console and bar_is_visible() and _BAR.acquire(blocking=False)
        if self._bar_held:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=epochs * steps_per_epoch,
                initial=initial_epoch * steps_per_epoch,
                desc=description,
                unit="step",
                dynamic_ncols=True,
                leave=True,
            )

    # -- from the workers (relay threads) ---------------------------------------------------

    def on_event(self, rank: int, event: dict) -> None:
        if self._watch is not None:
            self._watch(rank, event)
        kind = event.get("event")
        if kind == "start":
            if "steps_per_epoch" in event:
                self.steps_known(rank, int(event["steps_per_epoch"]))
            if "rows" in event:
                self.rows_known(rank, int(event["rows"]), int(event["validation_rows"]))
            self._start(rank, int(event["initial_epoch"]))
        elif kind == "step":
            self.step(rank, int(event["epoch"]), int(event["step"]), event["logs"], float(event["samples_per_second"]))
        elif kind == "epoch":
            self._worker_epoch(rank, event)

    # -- from the driver (and the above) -----------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        """The steps per epoch the workers reported (the most any ran), else the driver's estimate."""
        return max(self._reported_steps.values(), default=self._steps_per_epoch)

    def steps_known(self, rank: int, steps: int) -> None:
        """Worker ``rank`` runs ``steps`` steps per epoch (known once it has counted its rows)."""
        with self._lock:
            self._reported_steps[rank] = steps
            self._steps_per_epoch = max(self._reported_steps.values())
            if self._bar is not None:
                self._bar.reset(total=self._epochs * self._steps_per_epoch)

    def rows_known(self, rank: int, rows: int, validation_rows: int) -> None:
        """Reporting rank ``rank`` counted ``rows`` training and ``validation_rows`` held-out rows (all of the fit's
        in a mode whose reporting rank knows them all, its own where each worker reports)."""
        with self._lock:
            self._reported_rows[rank] = (rows, validation_rows)

    @property
    def counted_rows(self) -> tuple[int, int]:
        """The fit's ``(training, held-out)`` rows as the reporting ranks counted them ((0, 0) before any did)."""
        with self._lock:
            counted = list(self._reported_rows.values())
        return sum(r for r, _ in counted), sum(v for _, v in counted)

    def step(self, rank: int, epoch: int, step: int, logs: dict[str, float], samples_per_second: float) -> None:
        """A worker (or, in average mode, the driver: rank 0) is ``step`` steps into ``epoch``."""
        with self._lock:
            self._positions[rank] = epoch * self._steps_per_epoch + step * self._steps_per_epoch // self._steps_of(rank)
            self._rates[rank] = samples_per_second
            position, rate = self._position(), sum(self._rates.values())
            self._update_bar(position, logs, rate)
            if time.monotonic() - self._step_logged_at >= STEP_LOG_SECONDS:
                self._step_logged_at = time.monotonic()
                logger.debug(
                    "epoch %d/%d step %d/%d  %s  (%.0f samples/s)",
                    epoch + 1,
                    self._epochs,
                    position - epoch * self._steps_per_epoch,
                    self._steps_per_epoch,
                    format_logs(logs),
                    rate,
                )

    def epoch_end(self, epoch: int, logs: dict[str, float], samples_per_second: float) -> None:
        """``epoch`` is finished everywhere; ``logs`` are its metrics over all workers."""
        with self._lock:
            if epoch in self._finished_epochs:
                return  # a retried task finishing an epoch again
            self._finished_epochs.add(epoch)
            self._update_bar(max(self._position(), (epoch + 1) * self._steps_per_epoch), logs, samples_per_second)
        self._epoch_line(epoch_line(epoch + 1, self._epochs, logs, samples_per_second))
        for listener in self._listeners:
            try:
                listener.on_epoch(epoch, logs, samples_per_second)
            except Exception:  # a listener failing (a full disk, MLflow down) must not stop training
                logger.exception("sparkdl: %s failed at epoch %d", type(listener).__name__, epoch + 1)

    def add_listener(self, listener: EpochListener) -> None:
        self._listeners.append(listener)

    def close(self) -> None:
        self._redirects.close()
        if self._bar is not None and self._bar_held:
            self._bar_held = False
            self._bar.close()
            _BAR.release()
        for listener in self._listeners:
            try:
                listener.close()
            except Exception:
                logger.exception("sparkdl: closing %s failed", type(listener).__name__)

    def __enter__(self) -> ProgressMonitor:
        if self._bar is not None and not in_notebook():  # a widget is drawn apart from the text: nothing to garble
            for handler in logging.root.handlers:  # the user's console logging, as tqdm's logging_redirect_tqdm
                if _is_console_handler(handler):
                    original = handler.setStream(_AboveBar(handler.stream, self._bar))
                    self._redirects.callback(handler.setStream, original)
            self._stdout = self._redirects.enter_context(contextlib.redirect_stdout(_AboveBar(sys.stdout, self._bar)))
            self._redirects.enter_context(contextlib.redirect_stderr(_AboveBar(sys.stderr, self._bar)))
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _epoch_line(self, line: str) -> None:
        """Logged; and printed by sparkdl where the user's logging would not show it (one line either way)."""
        printed_by_logging = _logging_shows(logger, logging.INFO)
        logger.info("%s", line)
        if not self._console or printed_by_logging:
            return
        print(line, file=self._stdout, flush=True)  # above the bar while one is shown in a terminal

    def _start(self, rank: int, initial_epoch: int) -> None:
        with self._lock:
            self._positions[rank] = initial_epoch * self._steps_per_epoch
            if self._bar is not None:
                self._bar.reset(total=self._epochs * self._steps_per_epoch)
                self._bar.update(self._position())
        if initial_epoch:
            logger.info("rank %d resumes at epoch %d/%d from a checkpoint", rank, initial_epoch + 1, self._epochs)

    def _worker_epoch(self, rank: int, event: dict) -> None:
        epoch = int(event["epoch"])
        with self._lock:
            self._positions[rank] = (epoch + 1) * self._steps_per_epoch
            reports = self._epoch_reports.setdefault(epoch, {})
            if event.get("skipped"):  # a worker that resumed past the epoch: its earlier attempt's report is the one
                reports.setdefault(rank, event)
            else:
                reports[rank] = event
            if len(reports) < self._reporting_ranks:
                return
            del self._epoch_reports[epoch]
        logs = combine_logs(
            [r["logs"] for r in reports.values()],
            [r.get("samples", 1) for r in reports.values()],
            [r.get("validation_rows", 0) for r in reports.values()],
        )
        self.epoch_end(epoch, logs, sum(float(r["samples_per_second"]) for r in reports.values()))

    def _steps_of(self, rank: int) -> int:
        return self._reported_steps.get(rank, self._steps_per_epoch)

    def _position(self) -> int:
        """Global steps done: the mean over reporting workers (in sync mode, rank 0's)."""
        return sum(self._positions.values()) // max(len(self._positions), 1)

    def _update_bar(self, position: int, logs: dict[str, float], samples_per_second: float) -> None:
        if self._bar is None:
            return
        self._bar.update(max(position - self._bar.n, 0))
        self._bar.set_postfix_str(f"{format_logs(logs)} {samples_per_second:.0f} samples/s", refresh=True)


class _AboveBar:
    """A console stream whose lines go above a text progress bar: the bar is cleared, the lines written,
    the bar drawn again, all under tqdm's lock (the bar's own updates take it too)."""

    def __init__(self, stream, bar):
        self._stream = stream
        self._bar = bar
        self._partial = ""

    def write(self, text: str) -> int:
        with self._bar.get_lock():
            *lines, self._partial = (self._partial + text).split("\n")
            if lines:
                self._bar.clear(nolock=True)
                self._stream.write("".join(line + "\n" for line in lines))
                self._stream.flush()
                self._bar.refresh(nolock=True)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)
