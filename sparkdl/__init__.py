"""sparkdl: train Keras 3 models on data that lives in Apache Spark.

Public API: :func:`fit` and :class:`FitResult`.
"""

from sparkdl.api import FitResult, fit

__all__ = ["fit", "FitResult"]
__version__ = "0.1.0"
