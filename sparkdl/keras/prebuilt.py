"""The trained model's Keras object, built on the driver while the tasks train: the result then only fills in variables.

Loading a ``.keras`` archive builds the model from its config (every layer and every variable
created: most of the work) and then reads the variables in. A fit's trained model has the config
of the model it started from unless something changed it while training (a callback that
unfreezes layers), so the driver builds the model from the start point's archive in a background
thread while the stage runs, and reads the trained archive's variables (the optimizer's too) into
it: what ``keras.models.load_model`` would have given, without building it after the stage. An
archive whose config differs from the start point's, a build that failed or has not finished
within ``timeout``, and the Horovod stack's Keras 2 are loaded whole, as before.
"""

from __future__ import annotations

import io
import threading
import zipfile
from collections.abc import Mapping

from sparkdl import _compat
from sparkdl.keras import serialization

_CONFIG = "config.json"  # the model's config inside a .keras archive


class PrebuiltModel:
    """Builds the model of ``.keras`` archive ``start`` in a background thread; :meth:`trained` gives the trained one."""

    def __init__(self, start: bytes, custom_objects: Mapping | None, *, timeout: float):
        self._config = _config(start)
        self._custom_objects = custom_objects
        self._timeout = timeout
        self._model = None
        self._thread = threading.Thread(target=self._build, args=(start,), name="sparkdl-prebuild", daemon=True)
        self._thread.start()

    def _build(self, start: bytes) -> None:
        try:
            self._model = serialization.model_from_bytes(start, self._custom_objects)
        except Exception:  # noqa: BLE001 -- the trained archive is then loaded whole, which reports what is wrong
            self._model = None

    def trained(self, data: bytes):
        """The model in trained ``.keras`` archive ``data``: the prebuilt model holding its variables, where it has
        the same config, else ``data`` loaded whole."""
        self._thread.join(self._timeout)
        model = None if self._thread.is_alive() else self._model
        if model is None or _compat.keras_major() < 3 or _config(data) != self._config:
            return serialization.model_from_bytes(data, self._custom_objects)
        with serialization.archive_file(data) as path:
            model.load_weights(path)  # every layer's variables and the optimizer's, as load_model reads them
        return model


def _config(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return archive.read(_CONFIG)
