"""sparkdl: train Keras 3 models on data that lives in Apache Spark.

Public API: :func:`fit` and :class:`FitResult` (training on a DataFrame), :func:`run` (any
function on N barrier tasks, with sparkdl's ring or Horovod) and :class:`WorkerError`
(a worker's exception, re-raised on the driver); ``sparkdl.collective`` inside ``run``.
"""

from sparkdl._tf_log import quiet_tensorflow

quiet_tensorflow()  # before anything imports TensorFlow: on the driver, and in the tasks that unpickle sparkdl code

from sparkdl.api import FitResult, fit
from sparkdl.launch import WorkerError
from sparkdl.launch.runner import run

__all__ = ["fit", "FitResult", "run", "WorkerError"]
__version__ = "0.1.0"
