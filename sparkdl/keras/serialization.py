"""Moving models, weights and histories between the driver and the workers.

Models travel as Keras ``.keras`` archives and histories as JSON, packed in an
``.npz`` archive read with ``allow_pickle=False``: nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
from collections.abc import Iterator, Mapping

import numpy as np

from sparkdl import _compat, scratch
from sparkdl.keras import shipped_objects

# Concurrent fits (CrossValidator's `parallelism`) save the same model from several threads: building its
# optimizer's slots on first save is not safe to run twice at once, so saves take turns.
_SAVING = threading.Lock()


def model_to_bytes(model) -> bytes:
    """The model, its compile settings and optimizer state as ``.keras`` bytes."""
    with _SAVING, scratch.directory() as tmp:
        # Saved unbuilt, the optimizer's slots could not be matched on load and Keras warns on every worker.
        _compat.build_optimizer(model.optimizer, model.trainable_variables)
        path = os.path.join(tmp, "model.keras")
        _compat.save_model(model, path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: Mapping | None = None, *, setting: str = "custom_objects"):
    """The model in ``.keras`` archive ``data``, compiled. The custom objects it needs are taken from
    ``custom_objects``, Keras's registry or their modules (``shipped_objects``); one found nowhere is a ``ValueError``
    naming it and ``setting``."""
    import keras

    objects = shipped_objects.for_archive(data, custom_objects, setting=setting)
    with archive_file(data) as path:
        return keras.models.load_model(path, custom_objects=objects, compile=True)


@contextlib.contextmanager
def archive_file(data: bytes) -> Iterator[str]:
    """The path of a private ``.keras`` file holding ``data`` for the ``with`` block (Keras 2 reads archives by path
    only), removed after it, or by the next task should this process be killed meanwhile (``sparkdl.scratch``)."""
    with scratch.directory() as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        yield path


def result_to_bytes(
    model_bytes: bytes,
    history: dict[str, list[float]],
    initial_epoch: int,
    stats: dict | None = None,
    resumed_history: dict[str, list[float]] | None = None,
) -> bytes:
    """Rank 0's answer: the trained ``.keras`` archive (with optimizer state), the history of the epochs it
    trained, the epoch training (re)started from, the mode's counters (JSON-able), and the history before
    that epoch when it resumed from a checkpoint the driver did not offer (``modes.base.ModeResult``)."""
    buffer = io.BytesIO()
    np.savez(
        buffer,
        model=np.frombuffer(model_bytes, np.uint8),
        history=np.frombuffer(json.dumps(history).encode(), np.uint8),
        initial_epoch=np.array(initial_epoch, np.int64),
        stats=np.frombuffer(json.dumps(stats or {}).encode(), np.uint8),
        resumed_history=np.frombuffer(json.dumps(resumed_history).encode(), np.uint8),
    )
    return buffer.getvalue()


def result_from_bytes(data: bytes) -> tuple[bytes, dict[str, list[float]], int, dict, dict | None]:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return (
            archive["model"].tobytes(),
            json.loads(archive["history"].tobytes().decode()),
            int(archive["initial_epoch"]),
            json.loads(archive["stats"].tobytes().decode()),
            json.loads(archive["resumed_history"].tobytes().decode()),
        )
