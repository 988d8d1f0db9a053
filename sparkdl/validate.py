"""The first phase of ``sparkdl.fit``: its settings checked on the driver, before any Spark job starts.

Each check raises a ``ValueError`` that names the setting, what was expected and what was received.
The columns are checked against the schema by ``sparkdl.data.plan``, and each mode's own options by
its ``configure`` (``sparkdl.modes.registry.check_mode_options``).
"""

from __future__ import annotations

import numbers

from pyspark.sql import DataFrame

from sparkdl import _compat
from sparkdl.keras.runtime import use_tensorflow_backend


def check_callbacks(callbacks, refused: str | None) -> tuple:
    """Keras callbacks that can travel to the workers (they are pickled into the tasks); ``refused``: why the fit
    cannot run any (``Plan.refuses_callbacks``), or None."""
    if not callbacks:
        return ()
    import keras
    from pyspark import cloudpickle

    if refused is not None:
        raise ValueError(
            f"`callbacks` run inside Keras's fit on the workers, which {refused}. Use mode='sync' or a "
            f"parameter-server mode, or drop the callbacks. Received: callbacks={callbacks!r}"
        )
    if not isinstance(callbacks, (list, tuple)):
        raise ValueError(f"Expected `callbacks` to be a list of keras.callbacks.Callback. Received: {callbacks!r}")
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise ValueError(
                f"Expected `callbacks` to hold keras.callbacks.Callback instances. Received: {type(callback).__name__}"
            )
        try:
            cloudpickle.dumps(callback)
        except Exception as exc:
            raise ValueError(
                f"Callback {type(callback).__name__} cannot be sent to the workers (it must be "
                f"picklable; create resources such as files or clients in its on_train_begin): {exc}"
            ) from exc
    return tuple(callbacks)


def check_validation(validation_col, validation_split) -> None:
    """Checks the validation settings (the column itself is checked against the schema in ``data.plan``)."""
    if validation_col is not None and validation_split is not None:
        raise ValueError(
            "`validation_col` and `validation_split` are mutually exclusive: pass one of them. "
            f"Received: validation_col={validation_col!r}, validation_split={validation_split!r}"
        )
    if validation_col is not None and not isinstance(validation_col, str):
        raise ValueError(f"Expected `validation_col` to be a column name. Received: validation_col={validation_col!r}")
    if validation_split is not None and (
        isinstance(validation_split, bool)
        or not isinstance(validation_split, numbers.Real)
        or not 0 < float(validation_split) < 1
    ):
        raise ValueError(
            f"Expected `validation_split` to be a float in (0, 1). Received: validation_split={validation_split!r}"
        )


def check_settings(df, model, *, num_workers, epochs, batch_size, timeout, seed) -> None:
    """The data frame (a batch one: a stream cannot be trained on epoch after epoch), the model (compiled,
    TensorFlow backend, supported) and fit's numeric settings."""
    if not isinstance(df, DataFrame):
        raise ValueError(f"Expected `df` to be a pyspark.sql.DataFrame. Received: {type(df).__name__}")
    if df.isStreaming:
        raise ValueError(
            "Expected `df` to be a batch DataFrame: sparkdl.fit trains on a fixed set of rows, epoch after epoch, "
            "and `df` is a streaming DataFrame (df.isStreaming is True). Train on a batch DataFrame (spark.read "
            "instead of spark.readStream, e.g. over the stream's sink), or on each micro-batch with "
            "df.writeStream.foreachBatch(lambda batch, batch_id: sparkdl.fit(batch, ...)). To score a stream, use "
            "KerasModel.transform: it works on streaming DataFrames."
        )
    use_tensorflow_backend()
    import keras

    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected `model` to be a keras.Model. Received: {type(model).__name__}")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"Expected the TensorFlow Keras backend. Received: KERAS_BACKEND={keras.backend.backend()!r}")
    if not _compat.is_compiled(model) or getattr(model, "optimizer", None) is None:
        raise ValueError("Expected a compiled model: call model.compile(optimizer=..., loss=...) before sparkdl.fit.")
    _compat.check_model_supported(model)
    for name, value in (("num_workers", num_workers), ("epochs", epochs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Expected `{name}` to be a positive integer. Received: {name}={value!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"Expected `timeout` to be a positive number of seconds. Received: timeout={timeout!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"Expected `seed` to be a non-negative integer or None. Received: seed={seed!r}")
