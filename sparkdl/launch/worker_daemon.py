"""Spark's Python worker daemon with TensorFlow loaded once, so that the workers it forks start with it.

Spark starts one Python daemon per executor and forks every Python worker from it
(``pyspark.daemon``). Each worker that trains or scores imports TensorFlow (with Keras),
which costs several seconds of CPU per process: on a small machine, more than the whole
training of a small model. With this module as the daemon, TensorFlow is imported once,
before the first fork; every worker inherits it, copy-on-write.

    spark.python.daemon.module  sparkdl.launch.worker_daemon

(a static setting: give it when the session starts; ``jobs/`` set it for local masters).
Only the import happens before the fork: TensorFlow starts no threads and initializes no
device until first used, so each worker still sizes its own thread pools and, on GPU
machines, must see only its own GPU: where ``nvidia-smi`` is found nothing is preloaded,
as sparkdl pins a task's GPU before TensorFlow first loads in it. A failed import is left
to the tasks to report (the environment check names what is missing); the daemon starts
regardless.

The imported objects (about 430,000 with TensorFlow) are then frozen (``gc.freeze``, the
pre-fork pattern the ``gc`` module documents), so that no garbage collection in a worker walks
them: PySpark's workers collect after every task, 0.2 s of CPU each with them in the heap,
2 to 10 ms without (measured after a small Keras fit).
"""

from __future__ import annotations

import gc
import os
import shutil
import sys


def preload_tensorflow() -> bool:
    """Imports Keras and TensorFlow into this process (CPU machines only); True if they loaded."""
    if shutil.which("nvidia-smi") is not None:
        return False
    from sparkdl.keras.runtime import use_tensorflow_backend

    use_tensorflow_backend()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    # The daemon's stdout is its channel to the JVM (its port goes there): nothing else may be written to it.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        import keras  # noqa: F401 -- imports TensorFlow, Keras's backend here
        import tensorflow  # noqa: F401
    except Exception:  # noqa: BLE001 -- the tasks import it again and report what is missing
        return False
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    return True


if __name__ == "__main__":
    preload_tensorflow()
    # No gc.collect() first: after these imports it freed nothing and took 0.17 s, on a session's first fit's path.
    gc.freeze()  # what is alive now lives as long as the daemon: no worker's collection need walk it
    from pyspark import daemon

    daemon.manager()
