"""Epoch checkpoints: the model (with its optimizer state), extra arrays and the history so far.

A checkpoint directory is any location ``pyarrow.fs`` reaches: a local path, ``file://``,
``hdfs://``, ``s3://``, ``gs://``. Checkpoint ``e`` (``e`` complete epochs) is three files::

    epoch-000005.keras   the model: weights, compile settings, optimizer state (loads with keras)
    epoch-000005.npz     extra state as plain arrays (the parameter-server shards' optimizers), optional
    epoch-000005.json    epoch, history, mode, step: written last, it is what makes the checkpoint complete

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
import dataclasses
import io
import json
import logging
import os
import re
import secrets
import time

import numpy as np

logger = logging.getLogger(__name__)

KEEP = 3
_FORMAT = 1
_NAME = re.compile(r"^epoch-(\d{6})\.json$")
_TEMPORARY_PREFIX = ".tmp-"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The state after ``epoch`` complete epochs.

    ``step``: the global step the state was taken at when that is past the epoch's end (average
    mode saves the state after the round that finished the epoch, up to ``sync_every - 1`` steps
    into the next one); None (and in checkpoints written before it existed): the epoch's end.
    """

    epoch: int
    model_bytes: bytes
    history: dict[str, list[float]]
    mode: str
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    step: int | None = None


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

    def latest(self, newer_than: int = -1) -> Checkpoint | None:
        """The newest complete checkpoint (of more than ``newer_than`` epochs), or None."""
        filesystem, path = self._filesystem()
        for epoch in sorted((e for e in self._complete_epochs(filesystem, path) if e > newer_than), reverse=True):
            try:
                return self._read(filesystem, path, epoch)
            except (OSError, ValueError, KeyError) as exc:  # removed or damaged by someone else: try the previous
                logger.warning("sparkdl: skipping unreadable checkpoint %s/epoch-%06d: %s", self.uri, epoch, exc)
        return None

    def read(self, epoch: int) -> Checkpoint:
        """Checkpoint ``epoch``, which another task found complete (an ``OSError`` if it is gone)."""
        filesystem, path = self._filesystem()
        return self._read(filesystem, path, epoch)

    def save(self, checkpoint: Checkpoint) -> None:
        """Writes ``checkpoint`` (temporary names, then moves; the ``.json`` last) and prunes old ones."""
        filesystem, path = self._filesystem()
        stem = f"epoch-{checkpoint.epoch:06d}"
        self._write(filesystem, path, f"{stem}.keras", checkpoint.model_bytes)
        if checkpoint.arrays:
            buffer = io.BytesIO()
            np.savez(buffer, **checkpoint.arrays)  # type: ignore[arg-type]  # numpy's stub reads **arrays as its options
            self._write(filesystem, path, f"{stem}.npz", buffer.getvalue())
        meta = {
            "format": _FORMAT,
            "epoch": checkpoint.epoch,
            "history": checkpoint.history,
            "mode": checkpoint.mode,
            "arrays": sorted(checkpoint.arrays),
            "step": checkpoint.step,
            "written": time.time(),
        }
        self._write(filesystem, path, f"{stem}.json", json.dumps(meta).encode())
        for old in sorted(self._complete_epochs(filesystem, path))[:-KEEP]:
            self._delete(filesystem, path, old)

    def _filesystem(self):
        from pyarrow import fs as pafs

        return pafs.FileSystem.from_uri(self.uri)

    def _complete_epochs(self, filesystem, path) -> list[int]:
        from pyarrow import fs as pafs

        names = {os.path.basename(info.path) for info in filesystem.get_file_info(pafs.FileSelector(path))}
        return [int(m.group(1)) for name in names if (m := _NAME.match(name)) and f"epoch-{m.group(1)}.keras" in names]

    def _read(self, filesystem, path, epoch: int) -> Checkpoint:
        stem = f"{path}/epoch-{epoch:06d}"
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
        return Checkpoint(
            int(meta["epoch"]), model_bytes, meta["history"], meta["mode"], arrays, None if step is None else int(step)
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
    def _delete(filesystem, path: str, epoch: int) -> None:
        for suffix in (".json", ".keras", ".npz"):  # the marker first: a half-deleted one is no longer "complete"
            try:
                filesystem.delete_file(f"{path}/epoch-{epoch:06d}{suffix}")
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

    def save(self, checkpoint: Checkpoint) -> None:
        self._wait()
        self._pending = self._pool.submit(self._store.save, checkpoint)

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

    def record(self, logs: dict[str, float], *, epoch: int | None = None) -> None:
        """Adds a finished epoch's ``logs``; with ``epoch`` (from 0) they are that epoch's, and whatever was recorded
        for it or later before (by a stage attempt that failed and was retried from an earlier epoch) is dropped."""
        if epoch is not None:
            for values in self._history.values():
                del values[epoch:]
        for name, value in logs.items():
            self._history.setdefault(name, []).append(value)

    def save(
        self, epoch: int, model_bytes: bytes, arrays: dict[str, np.ndarray] | None = None, *, step: int | None = None
    ) -> None:
        history = {name: list(values) for name, values in self._history.items()}
        self._writer.save(Checkpoint(epoch, model_bytes, history, self._mode, arrays or {}, step))

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self._writer.__exit__(*exc_info)
