"""sparkdl: train Keras 3 models on data that lives in Apache Spark.

Public API: :func:`fit` and :class:`FitResult` (training on a DataFrame), :func:`plan` (which mode, batch
size and number of workers, predicted from a short probe on the cluster), :func:`run` (any
function on N barrier tasks, with sparkdl's ring or Horovod) and :class:`WorkerError`
(a worker's exception, re-raised on the driver); ``sparkdl.collective`` inside ``run``;
``sparkdl.ml`` (the Spark ML stages). For jobs and notebooks that check early: :data:`MODES`
and :func:`check_mode_options` (``fit``'s modes and the settings each takes),
:func:`features_column` (the features as ``fit`` reads them), :func:`check_executors` (the
executors' Python, checked and warmed before ``fit``) and :data:`WORKER_DAEMON` (the value of
``spark.python.daemon.module`` that starts Python workers with TensorFlow loaded).
"""

from sparkdl._tf_log import quiet_tensorflow

quiet_tensorflow()  # before anything imports TensorFlow: on the driver, and in the tasks that unpickle sparkdl code

from sparkdl.api import MODES, FitResult, check_mode_options, fit
from sparkdl.data import features_column
from sparkdl.launch import WorkerError
from sparkdl.launch.probe import WorkerEnvironmentError, check_executors
from sparkdl.launch.runner import run
from sparkdl.launch.worker_python import WORKER_DAEMON
from sparkdl.planner.recommend import plan

__all__ = [
    "fit",
    "FitResult",
    "plan",
    "run",
    "WorkerError",
    "MODES",
    "check_mode_options",
    "features_column",
    "check_executors",
    "WorkerEnvironmentError",
    "WORKER_DAEMON",
]
__version__ = "0.1.0"
