"""Checkpoints: the model (with its optimizer state), extra arrays and the history so far, at an epoch's end or
mid-epoch.

A checkpoint directory is any location ``pyarrow.fs`` reaches: a local path, ``file://``,
``hdfs://``, ``s3://``, ``gs://``. Checkpoint ``e`` (``e`` complete epochs) is three files::

    epoch-000005.keras   the model: weights, compile settings, optimizer state (loads with keras)
    epoch-000005.npz     extra state as plain arrays (the parameter-server shards' optimizers), optional
    epoch-000005.json    epoch, history, mode, step: written last, it is what makes the checkpoint complete

A checkpoint taken ``s`` steps into epoch ``e`` (``e`` complete) is ``epoch-000005-step-000000120.*``, its ``.npz``
holding where the epoch stands (``sparkdl.position.EpochPosition``: which rows it has trained). Checkpoints are
ordered by their place, ``(epoch, steps into the next epoch)``.

Every file is written under a temporary name and then moved into place, and the ``.json`` goes
last, so a crash at any moment leaves either the previous complete checkpoint or the new one,
never half of one (on object stores, where a move is a copy, the ``.json`` still appears only
once the others are whole). The newest ``KEEP`` complete checkpoints are kept. On a local
filesystem the folders sparkdl creates are private to the user (0700) and so is every file (0600):
they hold the model and its optimizer state.

One writer, ``Checkpointer`` (on rank 0 in sync mode, on the driver otherwise), and one resume
path: the driver reads the newest checkpoint once and the mode starts from it (``modes.base.Job``);
only a sync stage that Spark retries reads again, for what its failed attempt saved. On a cluster
the directory must be storage every executor reaches (HDFS, S3, NFS).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from sparkdl.position import EpochPosition

logger = logging.getLogger(__name__)

KEEP = 3
_FORMAT = 1
# How long a step checkpoint waits, on the writer's thread, for the ends of the epochs before its own to be recorded.
HISTORY_WAIT_SECONDS = 10
_NAME = re.compile(r"^(epoch-(\d{6})(?:-step-(\d{9}))?)\.json$")
_TEMPORARY_PREFIX = ".tmp-"
_POSITION = "sparkdl/position"  # the ``.npz`` array of a step checkpoint's ``EpochPosition``


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The state after ``epoch`` complete epochs.

    ``step``: in average mode's checkpoints written before positions were, the global step the state was taken at
    when that is past the epoch's end (the state after the round that finished the epoch, up to
    ``sync_every - 1`` steps into the next one; average mode now saves that as a ``position``); None: the epoch's
    end.
    ``position``: where epoch ``epoch`` stands when the state was taken mid-epoch (a step checkpoint); None at an
    epoch's end.
    """

    epoch: int
    model_bytes: bytes
    history: dict[str, list[float]]
    mode: str
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    step: int | None = None
    position: EpochPosition | None = None

    @property
    def place(self) -> tuple[int, int]:
        """``(complete epochs, steps into the next one)``: what orders checkpoints."""
        return (self.epoch, self.position.steps if self.position is not None else 0)

    @property
    def stem(self) -> str:
        epoch, steps = self.place
        return f"epoch-{epoch:06d}" + (f"-step-{steps:09d}" if self.position is not None else "")


@dataclasses.dataclass(frozen=True)
class CheckpointStore:
    """A checkpoint directory; small and picklable (only the URI travels to the tasks)."""

    uri: str

    @classmethod
    def open(cls, location: str) -> CheckpointStore:
        """On the driver, before any job: checks the location, creates the directory, clears stale temporaries.

        A plain relative path is made absolute here, because executors run in other directories.
        """
        from pyarrow import fs as pafs

        if not isinstance(location, str) or not location.strip():
            raise ValueError(
                f"Expected `checkpoint_dir` to be a path or URI (file://, hdfs://, s3://, ...). "
                f"Received: checkpoint_dir={location!r}"
            )
        uri = location if "://" in location else os.path.abspath(location)
        try:
            filesystem, path = pafs.FileSystem.from_uri(uri)
            if _is_local(filesystem):
                _make_private_dirs(path)
            else:
                filesystem.create_dir(path, recursive=True)
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... depending on the filesystem
            raise ValueError(
                f"Cannot use checkpoint_dir={location!r}: {exc}. Expected a writable directory on a "
                "filesystem pyarrow supports (local path, file://, hdfs://, s3://, gs://)."
            ) from exc
        store = cls(uri)
        store._remove_temporaries(filesystem, path)
        return store

    def latest(self, newer_than: tuple[int, int] = (-1, 0)) -> Checkpoint | None:
        """The newest complete checkpoint (of a place after ``newer_than``: ``Checkpoint.place``), or None."""
        filesystem, path = self._filesystem()
        for place, stem in sorted(self._complete(filesystem, path).items(), reverse=True):
            if place <= newer_than:
                break
            try:
                return self._read(filesystem, path, stem)
            except (OSError, ValueError, KeyError) as exc:  # removed or damaged by someone else: try the previous
                logger.warning("sparkdl: skipping unreadable checkpoint %s/%s: %s", self.uri, stem, exc)
        return None

    def read(self, place: tuple[int, int]) -> Checkpoint:
        """The checkpoint at ``place``, which another task found complete (an ``OSError`` if it is gone)."""
        filesystem, path = self._filesystem()
        stem = self._complete(filesystem, path).get(place)
        if stem is None:
            raise FileNotFoundError(f"No complete checkpoint at epoch {place[0]}, step {place[1]} in {self.uri}")
        return self._read(filesystem, path, stem)

    def save(self, checkpoint: Checkpoint) -> None:
        """Writes ``checkpoint`` (temporary names, then moves; the ``.json`` last) and prunes old ones."""
        filesystem, path = self._filesystem()
        stem = checkpoint.stem
        self._write(filesystem, path, f"{stem}.keras", checkpoint.model_bytes)
        arrays = {**checkpoint.arrays, **({_POSITION: checkpoint.position.to_vector()} if checkpoint.position else {})}
        if arrays:
            buffer = io.BytesIO()
            np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub reads **arrays as its options
            self._write(filesystem, path, f"{stem}.npz", buffer.getvalue())
        meta = {
            "format": _FORMAT,
            "epoch": checkpoint.epoch,
            "history": checkpoint.history,
            "mode": checkpoint.mode,
            "arrays": sorted(arrays),
            "step": checkpoint.step,
            "steps_into_epoch": checkpoint.place[1],
            "written": time.time(),
        }
        self._write(filesystem, path, f"{stem}.json", json.dumps(meta).encode())
        complete = self._complete(filesystem, path)
        for old in sorted(complete)[:-KEEP]:
            self._delete(filesystem, path, complete[old])

    def _filesystem(self):
        from pyarrow import fs as pafs

        return pafs.FileSystem.from_uri(self.uri)

    def _complete(self, filesystem, path) -> dict[tuple[int, int], str]:
        """The complete checkpoints' stems, by place."""
        from pyarrow import fs as pafs

        names = {os.path.basename(info.path) for info in filesystem.get_file_info(pafs.FileSelector(path))}
        return {
            (int(m.group(2)), int(m.group(3) or 0)): m.group(1)
            for name in names
            if (m := _NAME.match(name)) and f"{m.group(1)}.keras" in names
        }

    def _read(self, filesystem, path, name: str) -> Checkpoint:
        stem = f"{path}/{name}"
        with filesystem.open_input_stream(f"{stem}.json") as f:
            meta = json.loads(f.read().decode())
        if meta.get("format") != _FORMAT:
            raise ValueError(f"unknown checkpoint format {meta.get('format')!r}")
        with filesystem.open_input_stream(f"{stem}.keras") as f:
            model_bytes = f.read()
        arrays = {}
        if meta["arrays"]:
            with filesystem.open_input_stream(f"{stem}.npz") as f:
                with np.load(io.BytesIO(f.read()), allow_pickle=False) as archive:
                    arrays = {name: archive[name] for name in meta["arrays"]}
        step = meta.get("step")
        vector = arrays.pop(_POSITION, None)
        position = EpochPosition.from_vector(vector) if vector is not None else None
        return Checkpoint(
            int(meta["epoch"]),
            model_bytes,
            meta["history"],
            meta["mode"],
            arrays,
            None if step is None else int(step),
            position,
        )

    @staticmethod
    def _write(filesystem, path: str, name: str, payload: bytes) -> None:
        temporary = f"{path}/{_TEMPORARY_PREFIX}{secrets.token_hex(6)}-{name}"
        if _is_local(filesystem):  # private from its creation on, not after a chmod
            with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(payload)
        else:
            with filesystem.open_output_stream(temporary) as f:
                f.write(payload)
        filesystem.move(temporary, f"{path}/{name}")

    @staticmethod
    def _delete(filesystem, path: str, stem: str) -> None:
        for suffix in (".json", ".keras", ".npz"):  # the marker first: a half-deleted one is no longer "complete"
            try:
                filesystem.delete_file(f"{path}/{stem}{suffix}")
            except (FileNotFoundError, OSError):
                pass

    @staticmethod
    def _remove_temporaries(filesystem, path: str) -> None:
        """Leftovers of a writer that crashed mid-write (only called before a job, when no one writes)."""
        from pyarrow import fs as pafs

        for info in filesystem.get_file_info(pafs.FileSelector(path)):
            if os.path.basename(info.path).startswith(_TEMPORARY_PREFIX):
                filesystem.delete_file(info.path)


def _make_private_dirs(path: str) -> None:
    """Creates ``path`` and its missing parents as 0700 (``os.makedirs`` gives the mode to the last one only)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # made by someone else meanwhile
            pass


def _is_local(filesystem) -> bool:
    from pyarrow import fs as pafs

    return isinstance(filesystem, pafs.LocalFileSystem)


class BackgroundWriter:
    """Saves checkpoints on a thread so that training does not wait for storage.

    One save at a time: a new save first waits for the previous one. A failed
    save is raised by the next ``save`` or by ``close``: losing checkpoints
    silently would defeat their purpose.
    """

    def __init__(self, store: CheckpointStore):
        self._store = store
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-checkpoint")
        self._pending: concurrent.futures.Future | None = None

    def save(self, checkpoint: Checkpoint | Callable[[], Checkpoint]) -> None:
        """Saves ``checkpoint``, or the one a callable makes on the writer's thread."""
        self._wait()
        made = checkpoint if callable(checkpoint) else lambda: checkpoint
        self._pending = self._pool.submit(lambda: self._store.save(made()))

    def close(self) -> None:
        """Waits for the last save; raises its error."""
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # training failed already: that error is the one to raise
            self.close()
        except Exception:
            logger.exception("sparkdl: the last checkpoint of a failed job could not be written")


class Checkpointer:
    """The one checkpoint writer of every mode: keeps the history so far and saves in the background.

    Starts from ``start`` (its history: the epochs a resumed fit already trained); ``record``
    adds a finished epoch's metrics (combined over workers), ``save`` writes the state after
    ``epoch`` complete epochs with the history recorded so far. Errors as ``BackgroundWriter``'s.
    """

    def __init__(self, store: CheckpointStore, start: Checkpoint, mode: str):
        self._writer = BackgroundWriter(store)
        self._mode = mode
        self._history = {name: list(values) for name, values in start.history.items()}
        self._epochs = start.epoch  # the epochs whose ends the history holds
        self._recorded = threading.Condition()  # guards the history and its epochs; notified at each record

    def record(self, logs: dict[str, float], *, epoch: int | None = None) -> None:
        """Adds a finished epoch's ``logs``; with ``epoch`` (from 0) they are that epoch's, and whatever was recorded
        for it or later before (by a stage attempt that failed and was retried from an earlier epoch) is dropped."""
        with self._recorded:
            if epoch is not None:
                for values in self._history.values():
                    del values[epoch:]
            for name, value in logs.items():
                self._history.setdefault(name, []).append(value)
            self._epochs = (self._epochs if epoch is None else epoch) + 1
            self._recorded.notify_all()

    def _history_of(self, epochs: int, *, wait: float) -> dict[str, list[float]]:
        """The history of the first ``epochs`` epochs, once it holds them or after ``wait`` seconds: where a mode's
        state is saved by other threads than its epochs' ends travel on (the parameter servers' pushes, the workers'
        reports), a step checkpoint into epoch ``epochs`` may be due before the last of those ends has arrived."""
        with self._recorded:
            if not self._recorded.wait_for(lambda: self._epochs >= epochs, wait):
                logger.warning(
                    "sparkdl: the step checkpoint into epoch %d holds the history of fewer epochs: the end of an "
                    "earlier one had not reached the driver within %d s",
                    epochs,
                    wait,
                )
            return {name: list(values[:epochs]) for name, values in self._history.items()}

    def save(
        self,
        epoch: int,
        model_bytes: bytes,
        arrays: dict[str, np.ndarray] | None = None,
        *,
        position: EpochPosition | None = None,
    ) -> None:
        """Saves the state after ``epoch`` complete epochs, or ``position`` into the next one (a step checkpoint: its
        history, of the ``epoch`` epochs before, is taken on the writer's thread once it holds them)."""
        if position is None:
            with self._recorded:
                history = {name: list(values) for name, values in self._history.items()}
            self._writer.save(Checkpoint(epoch, model_bytes, history, self._mode, arrays or {}))
            return

        def made() -> Checkpoint:
            history = self._history_of(epoch, wait=HISTORY_WAIT_SECONDS)
            return Checkpoint(epoch, model_bytes, history, self._mode, arrays or {}, position=position)

        self._writer.save(made)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self._writer.__exit__(*exc_info)


@dataclasses.dataclass(frozen=True)
class CheckpointInterval:
    """How often a fit saves a step checkpoint beside its epoch checkpoints: every ``steps`` steps, or every
    ``seconds`` of training (at the first step that ends after it), whichever is set."""

    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, value) -> CheckpointInterval:
        """``checkpoint_every``: a number of steps (an int >= 1) or a time (``"30s"``, ``"10min"``, ``"2h"``)."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return cls(steps=value)
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", value) if isinstance(value, str) else None
        if match and match.group(2) in _TIME_UNITS and float(match.group(1)) > 0:
            return cls(seconds=float(match.group(1)) * _TIME_UNITS[match.group(2)])
        raise ValueError(
            "Expected `checkpoint_every` to be a number of steps (an int >= 1) or a time such as '30s', '10min' or "
            f"'2h'. Received: checkpoint_every={value!r}"
        )

    def due(self, steps_since: int, seconds_since: float) -> bool:
        """Whether a checkpoint is due ``steps_since`` steps and ``seconds_since`` seconds after the last one."""
        if self.steps is not None:
            return steps_since >= self.steps
        assert self.seconds is not None
        return seconds_since >= self.seconds


class StepCheckpoints:
    """The steps a fit takes its step checkpoints at (every ``interval``), and what taking them cost.

    The ranks that take part in a save (a sharded optimizer's state gathered, the replicas averaged, a model's parts
    assembled) must take it at the same steps: every so many steps they count alike; every so long each would read
    its own clock, so ``agree`` (with a time interval only: every rank, at the first step it asks after every
    ``AGREE_STEPS`` steps, which every rank counts alike) makes the writer's decision theirs (a broadcast of one
    byte), so that a rank waits for the writer once in so many steps, not at every one."""

    AGREE_STEPS = 16

    def __init__(self, interval: CheckpointInterval, agree: Callable[[bool], bool] | None = None):
        self.interval, self._agree = interval, agree
        self._saved, self._seconds = 0, 0.0
        self._since, self._last = 0, time.monotonic()
        self._asked_at = 0  # the value of ``_since`` when the ranks last agreed
        self._epoch: int | None = None
        self._steps = 0  # this run's steps into epoch ``_epoch`` so far

    def due(self, epoch: int, steps: int, planned: int) -> bool:
        """Whether a step checkpoint is due after ``steps`` of the ``planned`` steps this run trains of epoch
        ``epoch``; never after the last of them (the epoch's own checkpoint follows)."""
        if epoch != self._epoch:
            self._epoch, self._steps = epoch, 0
        self._since, self._steps = self._since + steps - self._steps, steps
        if steps >= planned:
            return False
        due = self.interval.due(self._since, time.monotonic() - self._last)
        if self._agree is None or self.interval.seconds is None:
            return due
        if self._since < self._asked_at + self.AGREE_STEPS:
            return False
        self._asked_at = self._since
        return self._agree(due)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around a save: its seconds (what training waited for it) counted, the interval started again after it."""
        started = time.perf_counter()
        yield
        self._saved, self._seconds = self._saved + 1, self._seconds + time.perf_counter() - started
        self._since, self._last, self._asked_at = 0, time.monotonic(), 0

    def stats(self) -> dict:
        """``FitResult.stats["step_checkpoints"]``: the checkpoints saved and the seconds training waited for them (the
        storage is written in the background)."""
        return {"saved": self._saved, "seconds": round(self._seconds, 4)}


_TIME_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
DEFAULT_INTERVAL = "10min"  # fit's checkpoint_every: what a fault costs at most, against what checkpoints cost
