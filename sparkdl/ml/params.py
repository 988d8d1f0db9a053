"""The Spark ML Params of KerasEstimator and KerasModel: one Param for every setting of ``sparkdl.fit``."""

from __future__ import annotations

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (
    HasFeaturesCol,
    HasLabelCol,
    HasPredictionCol,
    HasProbabilityCol,
    HasRawPredictionCol,
    HasSeed,
)

from sparkdl.api import MODES


def _keras_model(value):
    import keras

    if not isinstance(value, keras.Model):
        raise TypeError(f"Expected `model` to be a keras.Model. Received: {type(value).__name__}")
    return value


class HasOutputCols(HasFeaturesCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol):
    """The columns a KerasModel reads and writes (Spark's usual names and defaults)."""


class KerasTrainingParams(HasOutputCols, HasLabelCol, HasSeed):
    """Every training setting of :func:`sparkdl.fit`, under Spark ML's camelCase names."""

    model = Param(Params._dummy(), "model", "the compiled keras.Model to train (never modified)",
                  typeConverter=_keras_model)
    numWorkers = Param(Params._dummy(), "numWorkers", "Spark tasks that train together",
                       typeConverter=TypeConverters.toInt)
    mode = Param(Params._dummy(), "mode", f"training mode, one of {list(MODES)}",
                 typeConverter=TypeConverters.toString)
    epochs = Param(Params._dummy(), "epochs", "passes over the whole DataFrame", typeConverter=TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize", "rows per worker per step", typeConverter=TypeConverters.toInt)
    shuffle = Param(Params._dummy(), "shuffle", "reshuffle each worker's rows every epoch",
                    typeConverter=TypeConverters.toBoolean)
    pushEvery = Param(Params._dummy(), "pushEvery", "async/hogwild/ssp: steps whose gradients make one push",
                      typeConverter=TypeConverters.toInt)
    maxStaleness = Param(Params._dummy(), "maxStaleness", "ssp: pushes a worker may run ahead of the slowest",
                         typeConverter=TypeConverters.toInt)
    numServers = Param(Params._dummy(), "numServers", "async/hogwild/ssp: parameter-server shards",
                       typeConverter=TypeConverters.toInt)
    syncEvery = Param(Params._dummy(), "syncEvery", "average: local steps between two averagings",
                      typeConverter=TypeConverters.toInt)
    validationCol = Param(Params._dummy(), "validationCol", "boolean column marking rows held out for validation",
                          typeConverter=TypeConverters.toString)
    validationSplit = Param(Params._dummy(), "validationSplit", "random fraction of rows held out for validation",
                            typeConverter=TypeConverters.toFloat)
    timeout = Param(Params._dummy(), "timeout", "seconds any single network wait may take",
                    typeConverter=TypeConverters.toFloat)
    checkpointDir = Param(Params._dummy(), "checkpointDir",
                          "directory (path or URI) for per-epoch checkpoints; a fit resumes from the newest",
                          typeConverter=TypeConverters.toString)
    tensorboardDir = Param(Params._dummy(), "tensorboardDir", "directory for TensorBoard logs of per-epoch metrics",
                           typeConverter=TypeConverters.toString)
    logToMlflow = Param(Params._dummy(), "logToMlflow", "log settings and per-epoch metrics to MLflow",
                        typeConverter=TypeConverters.toBoolean)
    progress = Param(Params._dummy(), "progress", "show a progress bar and one line per epoch on the console",
                     typeConverter=TypeConverters.toBoolean)

    # Param name -> sparkdl.fit argument, for the settings passed only when set.
    OPTIONAL_FIT_ARGUMENTS = {
        "pushEvery": "push_every", "maxStaleness": "max_staleness", "numServers": "num_servers",
        "syncEvery": "sync_every", "validationCol": "validation_col", "validationSplit": "validation_split",
        "checkpointDir": "checkpoint_dir", "tensorboardDir": "tensorboard_dir", "logToMlflow": "log_to_mlflow",
        "progress": "progress",
    }

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(labelCol="label", numWorkers=2, mode="sync", epochs=1, batchSize=32, shuffle=True,
                         timeout=600.0)

    def fit_arguments(self) -> dict:
        """The keyword arguments of sparkdl.fit that these Params describe."""
        arguments = dict(
            features_col=self.getFeaturesCol(), label_col=self.getLabelCol(),
            num_workers=self.getOrDefault(self.numWorkers), mode=self.getOrDefault(self.mode),
            epochs=self.getOrDefault(self.epochs), batch_size=self.getOrDefault(self.batchSize),
            shuffle=self.getOrDefault(self.shuffle),
            seed=None if self.getSeed() is None else self.getSeed() % 2**31,  # Spark's default seed is a 64-bit hash
            timeout=self.getOrDefault(self.timeout),
        )
        for name, argument in self.OPTIONAL_FIT_ARGUMENTS.items():
            if self.isDefined(self.getParam(name)):
                arguments[argument] = self.getOrDefault(name)
        return arguments


def _add_accessors(cls, names: list[str]) -> None:
    """PySpark ML's getX/setX pair for each Param (setters return self, for chaining)."""
    for name in names:
        suffix = name[0].upper() + name[1:]
        setattr(cls, f"get{suffix}", lambda self, _name=name: self.getOrDefault(_name))
        setattr(cls, f"set{suffix}", lambda self, value, _name=name: self._set(**{_name: value}))


_add_accessors(KerasTrainingParams, ["model", "numWorkers", "mode", "epochs", "batchSize", "shuffle", "pushEvery",
                                     "maxStaleness", "numServers", "syncEvery", "validationCol", "validationSplit",
                                     "timeout", "checkpointDir", "tensorboardDir", "logToMlflow", "progress"])
_add_accessors(HasOutputCols, ["featuresCol", "predictionCol", "probabilityCol", "rawPredictionCol"])
_add_accessors(KerasTrainingParams, ["labelCol", "seed"])
