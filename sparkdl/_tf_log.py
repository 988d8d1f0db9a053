"""TensorFlow's start-up lines, kept off the console: on the driver and in every task.

Loading TensorFlow's C++ runtime writes INFO lines straight to the process's stderr: absl's "All log
messages before absl::InitializeLog() is called are written to STDERR" preamble, the CPU-feature notice
(``cpu_feature_guard``), the oneDNN notice on CPUs where oneDNN is on, and CUDA probing lines on machines
without a GPU. They come once per process that imports TensorFlow: the driver, and every Python worker a
training task runs in (on the driver's console in local mode, relayed as ``[rank N]`` lines on a cluster).

Two things keep them off, both set up when sparkdl is imported (which is also what happens first in every
task: the task's code is unpickled by importing sparkdl), so sparkdl must be imported before TensorFlow:

- ``TF_CPP_MIN_LOG_LEVEL=1`` (C++ INFO lines off; warnings and errors stay), read by the runtime when it
  first logs. A level already in the environment always wins.
- TensorFlow 2.21 writes its oneDNN notice, and absl's preamble before it, twice (two of its libraries log on
  their own) whatever that level says. So the first ``import tensorflow`` (``import keras`` imports it) runs
  with the process's stderr (file descriptor 2, where C++ writes) going to a scratch file; when it is done,
  everything written there but the start-up lines is written to stderr as it came. With
  ``TF_CPP_MIN_LOG_LEVEL=0`` (TensorFlow's own knob for its INFO lines) nothing is filtered.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import tempfile
from collections.abc import Iterator

_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
# 0 all, 1 no INFO, 2 no WARNING, 3 no ERROR: 1 drops exactly the start-up notices, which are INFO lines.
_LEVEL = "1"
# What TensorFlow's start-up lines hold (each is one line of stderr); nothing else written during the import matches.
START_UP_LINES = (
    b"absl::InitializeLog() is called",
    b"oneDNN custom operations are on",
    b"cpu_feature_guard.cc",
    b"rebuild TensorFlow with the appropriate compiler flags",  # the CPU-feature notice's second line
    b"Unable to register cuDNN factory",
    b"Unable to register cuFFT factory",
    b"Unable to register cuBLAS factory",
    b"Could not find cuda drivers",
)


def quiet_tensorflow() -> None:
    """Hides TensorFlow's start-up lines in this process (module docstring), unless its environment sets a level."""
    os.environ.setdefault(_VARIABLE, _LEVEL)
    if "tensorflow" not in sys.modules and not any(isinstance(f, _QuietImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietImport())


class _QuietImport(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` as the other finders do, and has its first import run with its start-up lines filtered."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "tensorflow":
            return None
        sys.meta_path.remove(self)  # once: later imports find the module in sys.modules anyway
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or os.environ.get(_VARIABLE) == "0":
            return spec
        spec.loader = _FilteringLoader(spec.loader)
        return spec


class _FilteringLoader(importlib.abc.Loader):
    """Runs the real loader with stderr filtered, then leaves the module pointing at the real loader."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self._loader
        with _filtered_stderr():
            self._loader.exec_module(module)


@contextlib.contextmanager
def _filtered_stderr() -> Iterator[None]:
    """File descriptor 2 goes to a scratch file while the block runs; then all of it but the start-up lines to fd 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                captured.seek(0)
                kept = [line for line in captured.read().splitlines(True) if not _start_up(line)]
                _write_all(2, b"".join(kept))
    finally:
        os.close(saved)


def _start_up(line: bytes) -> bool:
    return any(notice in line for notice in START_UP_LINES)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
