"""Vectorized batch inference: a Keras model applied to a DataFrame as a lazy column transformation.

``predict`` appends prediction columns to a DataFrame. The features are turned into one
``array<float>`` column on the JVM (``sparkdl.data.features_array``, as in training) and reach
Python as Arrow record batches through a scalar-iterator Arrow UDF: each batch becomes one float32
numpy array without any per-row Python objects, the model runs on the whole batch in one call (at
most ``batch_size`` rows at a time), and the results go back as Arrow arrays built from the numpy
buffers. Only the features column travels to Python; every other column stays on the JVM. This
module is the driver's side; what the tasks run is ``sparkdl.ml.scoring``.

The model bytes travel once per executor as a file Spark's file server streams from the driver's
disk (``SparkContext.addFile``, named by the SHA-256 of the bytes: no JVM heap holds the model, so
its size is not bounded by ``spark.driver.memory``); under Spark Connect, in the UDF's closure, within
Connect's gRPC message limit (``launch.session.ship_file``). Each Python worker process
deserializes a model once, keyed by the SHA-256 of its bytes, and keeps it for later tasks and
later ``predict`` calls with the same bytes (Python workers are reused,
``spark.python.worker.reuse=true``, Spark's default).

Why not ``pyspark.ml.functions.predict_batch_udf``: it goes through pandas (one numpy object per
row in, ``np.vstack`` per batch, one Python object per output row back), and its model cache is
keyed by a fresh UUID per UDF, so a second ``predict`` call would load the model again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator

import pyarrow as pa
from pyspark.ml.functions import array_to_vector
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sparkdl.data import model_io
from sparkdl.data.batch_shapes import InputColumn
from sparkdl.data.columns import IMAGE
from sparkdl.data.plan import ColumnSpec, input_fields
from sparkdl.keras import shipped_objects
from sparkdl.launch import probe, session
from sparkdl.ml.scoring import (
    ARRAY,
    BINARY,
    MULTICLASS,
    OUTPUTS,
    REGRESSION,
    STRING_OUTPUTS,
    ModelInfo,
    TaskSpec,
    one_value,
    predict_batches,
)

_CLASSIFIER_TYPE = "struct<prediction: double, probability: array<double>>"
_RETURN_TYPES = {MULTICLASS: _CLASSIFIER_TYPE, BINARY: _CLASSIFIER_TYPE, REGRESSION: "double", ARRAY: "array<double>"}


def predict(
    df: DataFrame,
    model_bytes: bytes,
    *,
    features_col: ColumnSpec,
    prediction_col: str,
    probability_col: str | None = "probability",
    raw_prediction_col: str | None = "rawPrediction",
    custom_objects: dict | None = None,
    batch_size: int = 10_000,
) -> DataFrame:
    """``df`` with prediction columns appended (all input columns kept), lazily (a normal transformation).

    ``model_bytes`` is a ``.keras`` archive (what ``model.save(path)`` writes, read as bytes);
    ``features_col`` is what ``sparkdl.fit`` takes: a number, Vector, (nested) array or image column,
    a list of number columns, or for a model with several inputs a mapping from input name to those.
    Each row is fitted to its input's shape and dtype by the rule training uses (``sparkdl.data.shapes``).
    ``batch_size`` bounds the rows of one model call; the default, Spark's default Arrow batch
    (``spark.sql.execution.arrow.maxRecordsPerBatch``, 10,000 rows), runs each batch in one call.

    What is appended depends on the model's output, decided once here on the driver:

    * a classifier (last activation softmax over more than one unit, or a single sigmoid unit):
      ``prediction_col`` is the class index as a double (argmax; for a sigmoid 1.0 where p > 0.5),
      ``probability_col`` the class probabilities as an ML ``DenseVector`` (``[1 - p, p]`` for a
      sigmoid) and ``raw_prediction_col`` the same probabilities again as a Vector (the model's
      pre-activation scores are not kept; for argmax and for ranking by the last element, which is
      what Spark's evaluators use, probabilities serve equally well). Either can be switched off
      with ``None``. Spark ML's ``MulticlassClassificationEvaluator`` and
      ``BinaryClassificationEvaluator`` run on the output with their default column names when
      ``prediction_col="prediction"``.
    * a single output value (regression): ``prediction_col`` is that value as a double.
    * one output of several values (several units without softmax, sequences):
      ``prediction_col`` is an ``array<double>`` holding the row's values, flattened in row-major order.
    * several outputs: ``prediction_col`` is a struct with one field per output, named as the
      model names it (``model.output_names``): a double for an output of one value per row, else an
      ``array<double>``. Select one with ``F.col("prediction.total")``.

    Raises ``ValueError`` before any Spark job for a missing or unsupported features column, a
    mapping that does not name the model's inputs, a float column for an integer input, a column
    list whose length does not fit its input, output columns that already exist, and bad settings.
    ``transform`` starts no job of its own, so a row of the wrong shape, a null, NaN or infinite
    value, or an integer a float input would round fails the task that reads it, with a message
    naming the column and the expected shape; Spark raises it from the action.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"Expected `batch_size` to be a positive integer. Received: {batch_size!r}")
    if isinstance(model_bytes, (bytearray, memoryview)):
        model_bytes = bytes(model_bytes)
    if not isinstance(model_bytes, bytes) or not model_bytes:
        raise ValueError(
            "Expected `model_bytes` to be a non-empty `.keras` archive as bytes "
            f"(what model.save('model.keras') writes, read back as bytes). Received: {type(model_bytes).__name__}"
        )
    digest = hashlib.sha256(model_bytes).hexdigest()
    custom_objects = shipped_objects.for_archive(model_bytes, custom_objects)  # what the tasks cannot find themselves
    info = _driver_model_info(digest, model_bytes, custom_objects)
    planned = input_fields(df, info.inputs, features_col)  # the columns, matched to the inputs as fit does
    classifier = info.kind in (MULTICLASS, BINARY)
    outputs: dict[str, str | None] = {"prediction_col": prediction_col}
    if classifier:
        outputs.update(probability_col=probability_col, raw_prediction_col=raw_prediction_col)
    columns = _check_output_columns(df, outputs)

    probe.check_workers(df.sparkSession, 1, timeout=120.0)  # before the UDF: it fixes the workers' Python
    spec = TaskSpec(
        digest=digest,
        model=_shipped_model(df.sparkSession, digest, model_bytes),
        custom_objects=custom_objects,
        info=info,
        inputs=tuple(
            InputColumn(p.port, tuple(s.name for s in p.sources), p.setting, p.sources[0].kind == IMAGE)
            for p in planned
            if p.port is not None
        ),
        named=len(planned) > 1,
        batch_size=batch_size,
        # A classifier whose Vector columns are both switched off returns its class index only.
        probabilities=classifier and len(columns) > 1,
    )
    from pyspark.sql.functions import arrow_udf  # PySpark 4.1+

    def predict_udf(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        return predict_batches(spec, batches)

    return_type = _RETURN_TYPES.get(info.kind) if spec.probabilities or not classifier else "double"
    if info.kind == OUTPUTS:  # one field per output, by its name
        fields = (f"`{p.name}`: {'double' if one_value(p) else 'array<double>'}" for p in info.outputs)
        return_type = f"struct<{', '.join(fields)}>"
    # A scalar-iterator UDF, from the type hints (pyspark's overloads do not cover a return type given as a string).
    udf = arrow_udf(predict_udf, return_type)  # type: ignore[call-overload]
    scratch = _unused_name(df, "_sparkdl_prediction")
    result = df.withColumn(scratch, udf(F.struct(*(p.nested().alias(f"i{i}") for i, p in enumerate(planned)))))
    scored = F.col(scratch)
    if not spec.probabilities:
        return result.withColumn(prediction_col, scored).drop(scratch)
    new_columns = {prediction_col: scored.getField("prediction")}
    vector_cols = [columns[s] for s in ("probability_col", "raw_prediction_col") if columns.get(s)]
    if vector_cols:
        new_columns[vector_cols[0]] = array_to_vector(scored.getField("probability"))
    result = result.withColumns(new_columns).drop(scratch)
    if len(vector_cols) == 2:
        # A copy of the first Vector column: array_to_vector runs once per row, not twice.
        result = result.withColumn(vector_cols[1], F.col(vector_cols[0]))
    return result


def model_info(model) -> ModelInfo:
    """Inspects a loaded Keras model: its one input's shape, and which kind of predictions it makes."""
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError) as e:
        raise ValueError(
            "predict needs a model with known inputs and outputs (a Sequential model starting with "
            f"keras.Input, or a functional model). Received: {type(model).__name__} ({e})"
        ) from None
    if not inputs or not outputs:
        raise ValueError(f"predict needs a built model with known inputs and outputs. Received: {type(model).__name__}")
    ports, heads = tuple(model_io.inputs(model)), tuple(model_io.outputs(model))
    texts = [head.describe() for head in heads if head.is_text]
    if texts:
        raise ValueError(STRING_OUTPUTS.format(outputs=texts))
    if len(outputs) != 1:
        return ModelInfo(OUTPUTS, ports, heads)
    output_shape = tuple(outputs[0].shape[1:])
    activation = _final_activation(outputs[0])
    if len(output_shape) == 1 and output_shape[0] is not None and output_shape[0] > 1 and activation == "softmax":
        return ModelInfo(MULTICLASS, ports, heads)
    if output_shape in ((), (1,)):
        return ModelInfo(BINARY if activation == "sigmoid" else REGRESSION, ports, heads)
    return ModelInfo(ARRAY, ports, heads)


_DRIVER_INFO: OrderedDict[str, ModelInfo] = OrderedDict()
_DRIVER_CACHE_SIZE = 4


def _driver_model_info(digest: str, model_bytes: bytes, custom_objects: dict | None) -> ModelInfo:
    if digest not in _DRIVER_INFO:
        from sparkdl.keras import serialization
        from sparkdl.keras.runtime import use_tensorflow_backend

        use_tensorflow_backend()
        try:
            model = serialization.model_from_bytes(model_bytes, custom_objects)
        except Exception as e:
            raise ValueError(f"`model_bytes` could not be loaded as a Keras model: {type(e).__name__}: {e}") from e
        _DRIVER_INFO[digest] = model_info(model)
        while len(_DRIVER_INFO) > _DRIVER_CACHE_SIZE:
            _DRIVER_INFO.popitem(last=False)
    _DRIVER_INFO.move_to_end(digest)
    return _DRIVER_INFO[digest]


def _shipped_model(spark, digest: str, model_bytes: bytes):
    """The model for the UDF's tasks: one file per model and session, which every ``predict`` with the same
    bytes shares, kept for as long as the session runs (a DataFrame is evaluated lazily, at any later time)."""
    return session.ship_file(spark, model_bytes, digest, suffix=".keras", what="the model")


def _check_output_columns(df: DataFrame, outputs: dict) -> dict:
    chosen: dict[str, str] = {}
    for setting, name in outputs.items():
        if name is None and setting != "prediction_col":
            continue
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"Expected `{setting}` to be a non-empty column name{' or None' if setting != 'prediction_col' else ''}. Received: {name!r}"
            )
        if name in df.columns:
            raise ValueError(
                f"Output column {name!r} (`{setting}`) already exists in the DataFrame: choose another name."
            )
        if name in chosen.values():
            raise ValueError(f"`{setting}` names the column {name!r}, which another output column already uses.")
        chosen[setting] = name
    return chosen


def _unused_name(df: DataFrame, base: str) -> str:
    name, i = base, 0
    while name in df.columns:
        i += 1
        name = f"{base}_{i}"
    return name


def _final_activation(output) -> str | None:
    """The name of the activation that produces ``output`` (``softmax``, ``sigmoid``, ...), if any."""
    history = getattr(output, "_keras_history", None)
    layer = getattr(history, "operation", None) if history is not None else None
    if layer is None:
        return None
    import keras

    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None) if callable(activation) else None
