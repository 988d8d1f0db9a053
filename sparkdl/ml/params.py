"""The Spark ML Params of KerasEstimator and KerasModel: one Param for every setting of ``sparkdl.fit``."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (
    HasLabelCol,
    HasSeed,
    HasValidationIndicatorCol,
    HasWeightCol,
)

from sparkdl.api import MODES
from sparkdl.ml import mode_option_params
from sparkdl.ml.model_params import HasOutputCols, column_spec
from sparkdl.ml.optimizer import HasOptimizerSettings

if TYPE_CHECKING:
    import keras


def _keras_model(value):
    """The model Param's type converter: a keras.Model, held in a KerasModel.

    PySpark's tuning writers (``_ValidatorSharedReadWrite``) save a grid's values as JSON, except
    Transformers, which they save with their own writer and load back: held in a KerasModel, a grid over
    ``model`` saves with a CrossValidatorModel. The KerasModel holds the very object (no copy).
    """
    from sparkdl.ml.model import KerasModel  # model.py imports this module

    if isinstance(value, KerasModel):
        return value
    import keras

    if not isinstance(value, keras.Model):
        raise TypeError(f"Expected `model` to be a keras.Model. Received: {type(value).__name__}")
    return KerasModel._holding(value)


def deprecated_validation_col(kwargs: dict) -> dict:
    """``kwargs`` with the deprecated ``validationCol`` renamed to ``validationIndicatorCol`` (with a warning)."""
    if "validationCol" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    value = kwargs.pop("validationCol")
    if "validationIndicatorCol" in kwargs:
        raise ValueError(
            "Expected one of `validationCol` (deprecated) and `validationIndicatorCol`. "
            f"Received both: {value!r} and {kwargs['validationIndicatorCol']!r}"
        )
    _warn_validation_col(stacklevel=5)  # the caller of the stage's keyword_only __init__/setParams
    if value is not None:
        kwargs["validationIndicatorCol"] = value
    return kwargs


def _warn_validation_col(stacklevel: int = 3) -> None:
    warnings.warn(
        "`validationCol` is deprecated: use `validationIndicatorCol` (Spark ML's name for the same setting).",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class KerasTrainingParams(
    HasOutputCols, HasLabelCol, HasSeed, HasValidationIndicatorCol, HasWeightCol, HasOptimizerSettings
):
    """Every training setting of :func:`sparkdl.fit`, under Spark ML's camelCase names (``weightCol`` is
    ``sample_weight_col``), and the optimizer's. The modes' own options (``pushEvery``, ``overlap``, ...)
    are made from the modes' declarations (``sparkdl.ml.mode_option_params``)."""

    labelCol = Param(
        Params._dummy(),
        "labelCol",
        "label column name, list of number columns, or mapping from the model's output names to those",
        typeConverter=column_spec,
    )

    model = Param(
        Params._dummy(), "model", "the compiled keras.Model to train (never modified)", typeConverter=_keras_model
    )
    numWorkers = Param(
        Params._dummy(), "numWorkers", "Spark tasks that train together", typeConverter=TypeConverters.toInt
    )
    mode = Param(Params._dummy(), "mode", f"training mode, one of {list(MODES)}", typeConverter=TypeConverters.toString)
    epochs = Param(Params._dummy(), "epochs", "passes over the whole DataFrame", typeConverter=TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize", "rows per worker per step", typeConverter=TypeConverters.toInt)
    shuffle = Param(
        Params._dummy(), "shuffle", "reshuffle each worker's rows every epoch", typeConverter=TypeConverters.toBoolean
    )
    validationSplit = Param(
        Params._dummy(),
        "validationSplit",
        "random fraction of rows held out for validation",
        typeConverter=TypeConverters.toFloat,
    )
    timeout = Param(
        Params._dummy(),
        "timeout",
        "seconds any single network wait may take, and the longest a fit waits for task slots",
        typeConverter=TypeConverters.toFloat,
    )
    checkpointDir = Param(
        Params._dummy(),
        "checkpointDir",
        "directory (path or URI) for per-epoch checkpoints; a fit resumes from the newest",
        typeConverter=TypeConverters.toString,
    )
    tensorboardDir = Param(
        Params._dummy(),
        "tensorboardDir",
        "directory for TensorBoard logs of per-epoch metrics",
        typeConverter=TypeConverters.toString,
    )
    logToMlflow = Param(
        Params._dummy(),
        "logToMlflow",
        "log settings and per-epoch metrics to MLflow",
        typeConverter=TypeConverters.toBoolean,
    )
    progress = Param(
        Params._dummy(),
        "progress",
        "show a progress bar and one line per epoch on the console",
        typeConverter=TypeConverters.toBoolean,
    )
    # Param name -> sparkdl.fit argument, for the settings passed only when set.
    OPTIONAL_FIT_ARGUMENTS = {
        "validationIndicatorCol": "validation_col",
        "validationSplit": "validation_split",
        "checkpointDir": "checkpoint_dir",
        "tensorboardDir": "tensorboard_dir",
        "logToMlflow": "log_to_mlflow",
        "progress": "progress",
        "customObjects": "custom_objects",
        "weightCol": "sample_weight_col",
    }
    # Names that saved stages may still use -> the Param that replaced them.
    RENAMED_PARAMS = {"validationCol": "validationIndicatorCol"}

    def __init__(self) -> None:
        mode_option_params.install(KerasTrainingParams)  # also the options of modes registered since the last stage
        super().__init__()
        self._setDefault(
            labelCol="label",
            numWorkers=2,
            mode="sync",
            epochs=1,
            batchSize=32,
            shuffle=True,
            timeout=600.0,
        )

    def fit_arguments(self) -> dict:
        """The keyword arguments of sparkdl.fit that these Params describe."""
        arguments = dict(
            features_col=self.getFeaturesCol(),
            label_col=self.getLabelCol(),
            num_workers=self.getNumWorkers(),
            mode=self.getMode(),
            epochs=self.getEpochs(),
            batch_size=self.getBatchSize(),
            shuffle=self.getShuffle(),
            seed=None if self.getSeed() is None else self.getSeed() % 2**31,  # Spark's default seed is a 64-bit hash
            timeout=self.getTimeout(),
            **mode_option_params.fit_arguments(self),
        )
        for name, argument in self.OPTIONAL_FIT_ARGUMENTS.items():
            if self.isDefined(self.getParam(name)):
                arguments[argument] = self.getOrDefault(name)
        return arguments

    def check_param_names(self, kwargs: dict) -> dict:
        """``kwargs`` of the constructor or ``setParams``, with a clear error for a name that is no Param."""
        unknown = sorted(name for name in kwargs if not self.hasParam(name))
        if unknown:
            raise ValueError(
                f"Unknown Param{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} of "
                f"{type(self).__name__}. Its Params: {sorted(p.name for p in self.params)}"
            )
        return kwargs

    def setLabelCol(self, value: str):
        """Sets the label column (the value of labelCol)."""
        return self._set(labelCol=value)

    def setWeightCol(self, value: str):
        """Sets the sample weight column, weighting each row's loss (the value of weightCol)."""
        return self._set(weightCol=value)

    def setSeed(self, value: int):
        """Sets the seed for shuffling and per-worker randomness (the value of seed)."""
        return self._set(seed=value)

    def setValidationIndicatorCol(self, value: str):
        """Sets the boolean column whose true rows are held out for validation (validationIndicatorCol)."""
        return self._set(validationIndicatorCol=value)

    def getValidationCol(self) -> str:
        """Deprecated: use :meth:`getValidationIndicatorCol`."""
        _warn_validation_col()
        return self.getValidationIndicatorCol()

    def setValidationCol(self, value: str):
        """Deprecated: use :meth:`setValidationIndicatorCol`."""
        _warn_validation_col()
        return self.setValidationIndicatorCol(value)

    def getModel(self) -> keras.Model:
        """Gets the Keras model to train (the value of model, held in a KerasModel)."""
        return self.getOrDefault(self.model)._keras_model_with(self.custom_objects_or_none())

    def setModel(self, value: keras.Model):
        """Sets the Keras model to train (the value of model)."""
        return self._set(model=value)

    def getNumWorkers(self) -> int:
        """Gets the number of Spark tasks that train together (the value of numWorkers)."""
        return self.getOrDefault(self.numWorkers)

    def setNumWorkers(self, value: int):
        """Sets the number of Spark tasks that train together (the value of numWorkers)."""
        return self._set(numWorkers=value)

    def getMode(self) -> str:
        """Gets the training mode (the value of mode)."""
        return self.getOrDefault(self.mode)

    def setMode(self, value: str):
        """Sets the training mode (the value of mode)."""
        return self._set(mode=value)

    def getEpochs(self) -> int:
        """Gets the number of passes over the DataFrame (the value of epochs)."""
        return self.getOrDefault(self.epochs)

    def setEpochs(self, value: int):
        """Sets the number of passes over the DataFrame (the value of epochs)."""
        return self._set(epochs=value)

    def getBatchSize(self) -> int:
        """Gets the rows per worker per step (the value of batchSize)."""
        return self.getOrDefault(self.batchSize)

    def setBatchSize(self, value: int):
        """Sets the rows per worker per step (the value of batchSize)."""
        return self._set(batchSize=value)

    def getShuffle(self) -> bool:
        """Gets whether each worker reshuffles its rows every epoch (the value of shuffle)."""
        return self.getOrDefault(self.shuffle)

    def setShuffle(self, value: bool):
        """Sets whether each worker reshuffles its rows every epoch (the value of shuffle)."""
        return self._set(shuffle=value)

    def getValidationSplit(self) -> float:
        """Gets the random fraction of rows held out for validation (the value of validationSplit)."""
        return self.getOrDefault(self.validationSplit)

    def setValidationSplit(self, value: float):
        """Sets the random fraction of rows held out for validation (the value of validationSplit)."""
        return self._set(validationSplit=value)

    def getTimeout(self) -> float:
        """Gets the seconds any single network wait (or the wait for task slots) may take (the value of timeout)."""
        return self.getOrDefault(self.timeout)

    def setTimeout(self, value: float):
        """Sets the seconds any single network wait (or the wait for task slots) may take (the value of timeout)."""
        return self._set(timeout=value)

    def getCheckpointDir(self) -> str:
        """Gets the directory for per-epoch checkpoints (the value of checkpointDir)."""
        return self.getOrDefault(self.checkpointDir)

    def setCheckpointDir(self, value: str):
        """Sets the directory for per-epoch checkpoints (the value of checkpointDir)."""
        return self._set(checkpointDir=value)

    def getTensorboardDir(self) -> str:
        """Gets the directory for TensorBoard logs (the value of tensorboardDir)."""
        return self.getOrDefault(self.tensorboardDir)

    def setTensorboardDir(self, value: str):
        """Sets the directory for TensorBoard logs (the value of tensorboardDir)."""
        return self._set(tensorboardDir=value)

    def getLogToMlflow(self) -> bool:
        """Gets whether settings and per-epoch metrics are logged to MLflow (the value of logToMlflow)."""
        return self.getOrDefault(self.logToMlflow)

    def setLogToMlflow(self, value: bool):
        """Sets whether settings and per-epoch metrics are logged to MLflow (the value of logToMlflow)."""
        return self._set(logToMlflow=value)

    def getProgress(self) -> bool:
        """Gets whether progress is shown on the console (the value of progress)."""
        return self.getOrDefault(self.progress)

    def setProgress(self, value: bool):
        """Sets whether progress is shown on the console (the value of progress)."""
        return self._set(progress=value)
