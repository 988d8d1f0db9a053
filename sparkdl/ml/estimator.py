"""KerasEstimator: a Spark ML Estimator that trains a Keras model with :func:`sparkdl.fit`."""

from __future__ import annotations

from typing import Any

from pyspark import keyword_only
from pyspark.ml import Estimator

import sparkdl
from sparkdl.keras import serialization
from sparkdl.ml import custom_objects
from sparkdl.ml.model import KerasModel
from sparkdl.ml.params import KerasTrainingParams, deprecated_validation_col
from sparkdl.ml.persistence import KerasStagePersistence


class KerasEstimator(KerasTrainingParams, Estimator, KerasStagePersistence):
    """Trains a compiled Keras 3 model on a DataFrame; ``fit`` returns a :class:`KerasModel`.

    Every setting of :func:`sparkdl.fit` but ``callbacks`` is a Param (camelCase; the modes' own options,
    ``pushEvery``, ``overlap``, ..., are keyword arguments here made from the modes' declarations; ``validation_col``
    is Spark ML's ``validationIndicatorCol``, ``validationCol`` is its deprecated alias); ``fit`` calls
    ``sparkdl.fit`` itself, so every mode is available. ``learningRate`` and ``optimizerOptions``
    change the model's optimizer for the fit (``sparkdl.ml.optimizer``). ``customObjects`` is saved as
    import paths (``sparkdl.ml.custom_objects``). The Keras model passed in is never modified, so
    copies of the estimator (as CrossValidator makes) share no trained state, and a CrossValidator
    may vary any Param, ``model`` too, train its candidates in parallel and be saved. When the
    cluster's task slots cannot hold ``parallelism`` candidates at once, a candidate waits its turn for
    free slots, up to ``timeout`` (``sparkdl.launch.slots``).

    Example:
        >>> est = KerasEstimator(model=keras_model, featuresCol="scaled", labelCol="label",
        ...                      numWorkers=2, mode="sync", epochs=20, batchSize=16)
        >>> pipeline_model = Pipeline(stages=[assembler, scaler, est]).fit(train_df)
    """

    _input_kwargs: dict[str, Any]  # the keyword arguments of the call, set by pyspark's @keyword_only

    @keyword_only
    def __init__(
        self,
        *,
        model=None,
        featuresCol="features",
        labelCol="label",
        predictionCol="prediction",
        probabilityCol="probability",
        rawPredictionCol="rawPrediction",
        numWorkers=2,
        mode="sync",
        epochs=1,
        batchSize=32,
        shuffle=True,
        seed=None,
        validationIndicatorCol=None,
        validationSplit=None,
        timeout=600.0,
        checkpointDir=None,
        tensorboardDir=None,
        logToMlflow=None,
        progress=None,
        customObjects=None,
        weightCol=None,
        learningRate=None,
        optimizerOptions=None,
        validationCol=None,
        **modeOptions,
    ):
        super().__init__()
        self._set(**self.check_param_names(deprecated_validation_col(self._input_kwargs)))

    @keyword_only
    def setParams(
        self,
        *,
        model=None,
        featuresCol="features",
        labelCol="label",
        predictionCol="prediction",
        probabilityCol="probability",
        rawPredictionCol="rawPrediction",
        numWorkers=2,
        mode="sync",
        epochs=1,
        batchSize=32,
        shuffle=True,
        seed=None,
        validationIndicatorCol=None,
        validationSplit=None,
        timeout=600.0,
        checkpointDir=None,
        tensorboardDir=None,
        logToMlflow=None,
        progress=None,
        customObjects=None,
        weightCol=None,
        learningRate=None,
        optimizerOptions=None,
        validationCol=None,
        **modeOptions,
    ):
        return self._set(**self.check_param_names(deprecated_validation_col(self._input_kwargs)))

    def _fit(self, dataset) -> KerasModel:
        if not self.isDefined(self.model):
            raise ValueError("KerasEstimator needs `model`: a compiled keras.Model.")
        # Checked (and the model copied) before any Spark job: a bad optimizer setting fails here.
        model = self.with_optimizer_settings(self.getModel(), self.custom_objects_or_none())
        result = sparkdl.fit(dataset, model, **self.fit_arguments())
        trained = KerasModel._from_keras_bytes(serialization.model_to_bytes(result.model), result.history)
        return self._copyValues(trained)  # featuresCol, output columns, customObjects

    def _keras_bytes(self) -> bytes:
        if not self.isDefined(self.model):
            raise ValueError("Cannot save a KerasEstimator without `model`.")
        return serialization.model_to_bytes(self.getModel())

    def _extra_metadata(self) -> dict:
        return {}

    @classmethod
    def _from_saved(cls, keras_bytes: bytes, metadata: dict) -> KerasEstimator:
        # The model is loaded before the Params are set: it needs the saved customObjects first.
        saved = metadata["paramMap"].get("customObjects")
        objects = custom_objects.to_objects(saved) if saved is not None else None
        return cls(model=serialization.model_from_bytes(keras_bytes, objects))
