"""Spark ML stages: KerasEstimator (trains with sparkdl.fit) and KerasModel (vectorized scoring)."""

from sparkdl.ml.estimator import KerasEstimator
from sparkdl.ml.model import KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
