"""KerasModel: the fitted Spark ML Model, scoring DataFrames with vectorized batch inference."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pyspark import keyword_only
from pyspark.ml import Model

from sparkdl.keras import serialization
from sparkdl.ml.inference import predict
from sparkdl.ml.model_params import HasOutputCols
from sparkdl.ml.persistence import KerasStagePersistence

if TYPE_CHECKING:
    import keras


class KerasModel(HasOutputCols, Model, KerasStagePersistence):
    """Adds ``predictionCol`` (and, for classifiers, ``probabilityCol`` and ``rawPredictionCol`` Vectors).

    ``history`` holds the per-epoch training (and validation) metrics of the
    fit that made it; ``keras_model`` the trained ``keras.Model``. Setting an
    output column to ``""`` leaves it out. Saved with ``write().save(path)``
    as Spark ML metadata plus a ``model.keras`` file. A model with custom layers needs ``customObjects``
    (saved as import paths, ``sparkdl.ml.custom_objects``).
    """

    _input_kwargs: dict[str, Any]  # the keyword arguments of the call, set by pyspark's @keyword_only

    @keyword_only
    def __init__(
        self,
        *,
        featuresCol="features",
        predictionCol="prediction",
        probabilityCol="probability",
        rawPredictionCol="rawPrediction",
        customObjects=None,
    ):
        super().__init__()
        self._set(**self._input_kwargs)
        self._model_bytes: bytes | None = None
        self._keras_model = None
        self.history: dict[str, list[float]] = {}

    @classmethod
    def from_keras(cls, model: keras.Model | str | os.PathLike, **params) -> KerasModel:
        """A KerasModel that scores with a model trained elsewhere (``sparkdl.fit``, plain Keras, ``jobs/train.py``).

        ``model`` is a compiled ``keras.Model`` or the path of a ``.keras`` file; ``params`` are
        KerasModel's Params. ``history`` is left empty::

            scorer = KerasModel.from_keras("output/model.keras", featuresCol="features")
            scored = scorer.transform(df)  # df plus prediction, probability, rawPrediction
        """
        if isinstance(model, (str, os.PathLike)):
            if not os.path.isfile(model):
                raise FileNotFoundError(
                    f"Expected `model` to be the path of a `.keras` file. "
                    f"Received: {os.fspath(model)!r}, which is not a file."
                )
            with open(model, "rb") as f:
                return cls._from_keras_bytes(f.read(), {}, **params)
        import keras

        if not isinstance(model, keras.Model):
            raise ValueError(
                f"Expected `model` to be a keras.Model or the path of a `.keras` file. Received: {type(model).__name__}"
            )
        if getattr(model, "optimizer", None) is None:
            raise ValueError(
                "Expected `model` to be compiled: call model.compile(...) first, or pass the path of its `.keras` file."
            )
        return cls._from_keras_bytes(serialization.model_to_bytes(model), {}, **params)

    @classmethod
    def _from_keras_bytes(cls, keras_bytes: bytes, history: dict, **params) -> KerasModel:
        model = cls(**params)
        model._model_bytes = keras_bytes
        model.history = history
        return model

    @classmethod
    def _holding(cls, model: keras.Model) -> KerasModel:
        """Holds ``model`` itself, serialized only when saved or scoring (KerasEstimator's ``model`` Param)."""
        holder = cls()
        holder._keras_model = model
        return holder

    @property
    def keras_model(self):
        """The trained keras.Model, loaded on first use."""
        return self._keras_model_with(self.custom_objects_or_none())

    def _keras_model_with(self, custom_objects: dict | None):
        """The keras.Model; loading it, the first time, with ``custom_objects`` (a KerasEstimator's)."""
        if self._keras_model is None:
            self._keras_model = serialization.model_from_bytes(self._keras_bytes(), custom_objects)
        return self._keras_model

    def _transform(self, dataset):
        return predict(
            dataset,
            self._keras_bytes(),
            features_col=self.getFeaturesCol(),
            prediction_col=self.getPredictionCol(),
            probability_col=self.getProbabilityCol() or None,
            raw_prediction_col=self.getRawPredictionCol() or None,
            custom_objects=self.custom_objects_or_none(),
        )

    def copy(self, extra=None) -> KerasModel:
        copied = super().copy(extra)
        if self._model_bytes is not None:
            copied._keras_model = None  # the bytes are immutable and shared; a loaded Keras model is not
        return copied

    def _keras_bytes(self) -> bytes:
        if self._model_bytes is not None:
            return self._model_bytes
        if self._keras_model is not None:  # a held model, as it is now
            return serialization.model_to_bytes(self._keras_model)
        raise ValueError("This KerasModel holds no trained model: get one from KerasEstimator.fit or KerasModel.load.")

    def _extra_metadata(self) -> dict:
        return {"history": self.history}

    @classmethod
    def _from_saved(cls, keras_bytes: bytes, metadata: dict) -> KerasModel:
        return cls._from_keras_bytes(keras_bytes, metadata.get("history", {}))
