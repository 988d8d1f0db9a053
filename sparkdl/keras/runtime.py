"""The Keras runtime of a process that trains: the TensorFlow backend chosen, and a task's thread limits."""

from __future__ import annotations

import os


def use_tensorflow_backend() -> None:
    """Selects Keras's TensorFlow backend, unless the user chose one; call it before anything imports Keras."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def limit_threads_to_task_cpus() -> None:
    """Keeps N tasks on one machine from each spawning a thread per core (oversubscription)."""
    import tensorflow as tf

    from sparkdl.launch.task_context import current_task

    cpus = current_task().cpus()
    try:
        tf.config.threading.set_intra_op_parallelism_threads(cpus)
        tf.config.threading.set_inter_op_parallelism_threads(cpus)
    except RuntimeError:
        pass  # TensorFlow already initialised by an earlier task in this reused Python worker
