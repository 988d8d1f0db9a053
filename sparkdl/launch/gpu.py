"""Which GPU(s) a task may use, decided before TensorFlow (or Horovod) sees any.

On a cluster with GPU scheduling (``spark.executor.resource.gpu.amount``,
``spark.task.resource.gpu.amount``, a discovery script; see
``conf/gpu-cluster/spark-defaults.conf``) Spark assigns each task its GPU addresses and
``TaskContext.resources()["gpu"]`` lists them. Local mode assigns nothing, so
task i takes GPU ``i mod (GPUs on the machine)``. The chosen addresses become
``CUDA_VISIBLE_DEVICES``: inside the task its GPU is device 0.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

_log = logging.getLogger(__name__)

# The GPUs this Python process saw before sparkdl first pinned any: a reused Python
# worker runs several tasks, and after the first one CUDA_VISIBLE_DEVICES holds
# that task's GPU, not the machine's.
_unpinned_gpus: list[str] | None = None


def assigned_gpus(
    resources: Mapping[str, Any], partition: int, local_mode: bool, machine_gpus: Sequence[str]
) -> list[str] | None:
    """The GPU addresses for one task; None leaves the devices as they are (no GPUs to share out).

    ``resources`` is ``TaskContext.resources()`` (name -> ResourceInformation with
    ``.addresses``); ``machine_gpus`` the GPUs this machine shows (local mode only).
    """
    gpu = resources.get("gpu")
    if gpu is not None and list(gpu.addresses):
        return [str(a) for a in gpu.addresses]
    if local_mode and machine_gpus:
        return [str(machine_gpus[partition % len(machine_gpus)])]
    return None


def machine_gpus() -> list[str]:
    """The GPUs this process could see: ``CUDA_VISIBLE_DEVICES`` if set, else what ``nvidia-smi`` lists.

    As CUDA reads that variable, ``""`` and ``"-1"`` hide every GPU, and an entry
    of ``-1`` hides the ones after it.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = []
        for entry in (d.strip() for d in visible.split(",")):
            if not entry or entry == "-1":
                break
            devices.append(entry)
        return devices
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listing.splitlines() if line.strip()]


def pin_task_gpus(resources: Mapping[str, Any], partition: int, local_mode: bool) -> list[str] | None:
    """Sets ``CUDA_VISIBLE_DEVICES`` to this task's GPUs (if there are any); returns them."""
    global _unpinned_gpus
    if local_mode and _unpinned_gpus is None:
        _unpinned_gpus = machine_gpus()
    gpus = assigned_gpus(resources, partition, local_mode, (_unpinned_gpus or []) if local_mode else [])
    if gpus is None:
        return None
    if "tensorflow" in sys.modules and os.environ.get("CUDA_VISIBLE_DEVICES") != ",".join(gpus):
        _log.warning(
            "TensorFlow was imported in this Python worker before sparkdl assigned it GPU(s) %s; it may "
            "keep the devices it saw first (set spark.python.worker.reuse=false to avoid this)",
            gpus,
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return gpus
