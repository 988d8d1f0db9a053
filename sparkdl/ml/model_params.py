"""The Params a KerasModel shares with KerasEstimator: the columns it reads and writes, and what loading it needs."""

from __future__ import annotations

from pyspark.ml.param import Param, Params
from pyspark.ml.param.shared import HasFeaturesCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol

from sparkdl.ml import custom_objects


class HasCustomObjects(Params):
    """Keras custom objects needed to load the model (saved as import paths: ``sparkdl.ml.custom_objects``)."""

    customObjects = Param(
        Params._dummy(),
        "customObjects",
        "Keras custom objects (name -> class or function) that loading the model needs",
        typeConverter=custom_objects.to_objects,
    )

    def getCustomObjects(self) -> dict:
        """Gets the Keras custom objects (the value of customObjects)."""
        return self.getOrDefault(self.customObjects)

    def setCustomObjects(self, value: dict):
        """Sets the Keras custom objects (the value of customObjects)."""
        return self._set(customObjects=value)

    def custom_objects_or_none(self):
        """The custom objects when set, for ``keras.models.load_model``."""
        return self.getOrDefault(self.customObjects) if self.isDefined(self.customObjects) else None


def column_spec(value):
    """A column name, a list of column names, or a mapping from a model input/output name to either (as ``fit``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        return {key: column_spec(v) for key, v in value.items()}
    raise TypeError(
        "Expected a column name, a non-empty list of column names, or a mapping from the model's input (or "
        f"output) names to those. Received: {value!r}"
    )


class HasOutputCols(HasFeaturesCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol, HasCustomObjects):
    """The columns a KerasModel reads and writes (Spark's usual names and defaults), and what loading it needs."""

    featuresCol = Param(
        Params._dummy(),
        "featuresCol",
        "features column name, list of number columns, or mapping from the model's input names to those",
        typeConverter=column_spec,
    )

    def setFeaturesCol(self, value: str):
        """Sets the features column (the value of featuresCol)."""
        return self._set(featuresCol=value)

    def setPredictionCol(self, value: str):
        """Sets the prediction column (the value of predictionCol)."""
        return self._set(predictionCol=value)

    def setProbabilityCol(self, value: str):
        """Sets the probability column, ``""`` for none (the value of probabilityCol)."""
        return self._set(probabilityCol=value)

    def setRawPredictionCol(self, value: str):
        """Sets the raw prediction column, ``""`` for none (the value of rawPredictionCol)."""
        return self._set(rawPredictionCol=value)
