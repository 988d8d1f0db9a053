"""TensorFlow's start-up lines, silenced before TensorFlow loads: on the driver and in every task.

Loading TensorFlow's C++ runtime writes INFO lines straight to the process's
stderr: absl's "All log messages before absl::InitializeLog() is called are
written to STDERR" preamble, the CPU-feature notice (``cpu_feature_guard``),
the oneDNN notice on CPUs where oneDNN is on, and CUDA probing lines on
machines without a GPU. They come once per process that imports TensorFlow:
the driver, and every Python worker a training task runs in (on the driver's
console in local mode, relayed as ``[rank N]`` lines on a cluster). The level
is read from the environment when the runtime first logs, so it must be set
before ``import tensorflow`` (or ``import keras``) in that process.

sparkdl sets ``TF_CPP_MIN_LOG_LEVEL=1`` (C++ INFO lines off; warnings and
errors stay) when it is imported, which is also what happens first in every
task (the task's code is unpickled by importing sparkdl), and again at the
start of each task; a level already in the environment always wins. TensorFlow
2.21 logs its oneDNN notice at import whatever the level (docs/output.md).
"""

from __future__ import annotations

import os

_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
# 0 all, 1 no INFO, 2 no WARNING, 3 no ERROR: 1 drops exactly the start-up notices, which are INFO lines.
_LEVEL = "1"


def quiet_tensorflow() -> None:
    """Hides TensorFlow's start-up INFO lines in this process, unless its environment sets a level."""
    os.environ.setdefault(_VARIABLE, _LEVEL)
