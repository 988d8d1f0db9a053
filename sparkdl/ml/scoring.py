"""What each Spark task of a ``predict`` runs: Arrow batches of features in, the model's outputs out.

The driver side (``sparkdl.ml.inference``) decides the model's kind and input shape once and sends
a :class:`TaskSpec`; here each Python worker process loads the model once per model (keyed by the
SHA-256 of its bytes) and traces its predict step once (``sparkdl.ml.batch_call``), checks every
batch's values and runs the model on each Arrow batch in one call (in equal pieces when the batch has
more than ``batch_size`` rows).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from sparkdl.data.batch_shapes import InputColumn
from sparkdl.data.model_io import Port
from sparkdl.ml.batch_call import BatchCall

MULTICLASS = "multiclass"  # softmax over >1 units: prediction = argmax, probability = the softmax
BINARY = "binary"  # one sigmoid unit p: prediction = 1.0 if p > 0.5, probability = [1 - p, p]
REGRESSION = "regression"  # one output value: prediction = that value
ARRAY = "array"  # one output of several values: prediction = the row's values, flattened, as array<double>
OUTPUTS = "outputs"  # several outputs: prediction = a struct with a field per output name (double, or array<double>)
STRING_OUTPUTS = (
    "predict writes numbers (double and array<double> columns), but the model's output(s) {outputs} give strings. "
    "Score a model whose outputs are numbers (without a final StringLookup(invert=True), say) and map indices back to "
    "strings in Spark (pyspark.ml.feature.IndexToString)."
)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the driver learns from the model once: its inputs, and how to read its output."""

    kind: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...] = ()


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What every task needs; small apart from the model (the name of a file Spark ships, on a classic session)."""

    digest: str
    model: Any  # the .keras bytes as ``.value``: a launch.session.SparkFile (classic) or in the closure (Connect)
    custom_objects: dict | None
    info: ModelInfo
    inputs: tuple[InputColumn, ...]  # what feeds each model input, in the order of the UDF's struct fields
    named: bool  # the model takes a dict by input name (it has several inputs)
    batch_size: int
    probabilities: bool  # classifiers: return the struct with the probabilities, not only the class index


_LOCK = threading.Lock()
_MODELS: OrderedDict[str, BatchCall] = OrderedDict()  # sha256 of the .keras bytes -> the loaded keras.Model's call
_MODEL_CACHE_SIZE = 3


def _cached_model(spec: TaskSpec) -> BatchCall:
    with _LOCK:
        model = _MODELS.get(spec.digest)
        if model is not None:
            _MODELS.move_to_end(spec.digest)
            return model
        from sparkdl.keras import serialization
        from sparkdl.keras.runtime import limit_threads_to_task_cpus, use_tensorflow_backend

        use_tensorflow_backend()
        limit_threads_to_task_cpus()  # takes effect if this process has not started TensorFlow yet
        model = BatchCall(serialization.model_from_bytes(spec.model.value, spec.custom_objects))
        _MODELS[spec.digest] = model
        while len(_MODELS) > _MODEL_CACHE_SIZE:
            _MODELS.popitem(last=False)
        return model


def predict_batches(spec: TaskSpec, batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
    model = None
    for column in batches:
        x = _features(column, spec)  # first: bad data fails the task without loading TensorFlow
        rows = len(column)
        if model is None:
            model = _cached_model(spec)
        yield _to_arrow(_run_model(model, x, rows, spec), spec.info, rows, spec.probabilities)


def _run_model(model: BatchCall, x, n: int, spec: TaskSpec) -> list[np.ndarray]:
    """The model's outputs for ``x`` (``n`` rows: one array, or a dict by input name): one float64 array of
    shape (rows, values per row) per output, in the order of ``spec.info.outputs``."""
    if n == 0:
        return [np.empty((0, 0), np.float64) for _ in spec.info.outputs or (None,)]
    # Equal chunks: an Arrow batch of 10,000 rows runs as 3 x 3,334, not 4,096 + 4,096 + 1,808.
    pieces = -(-n // spec.batch_size)
    step = -(-n // pieces)
    names = [port.name for port in spec.info.outputs]
    ports = tuple(feed.port for feed in spec.inputs)
    chunks = [_outputs(model(_rows(x, i, i + step), ports), min(step, n - i), names) for i in range(0, n, step)]
    return [parts[0] if len(parts) == 1 else np.concatenate(parts) for parts in zip(*chunks)]


def _outputs(out, rows: int, names: list[str]) -> list[np.ndarray]:
    if isinstance(out, dict):
        out = [out[name] for name in names]
    if not isinstance(out, (list, tuple)):
        out = [out]
    arrays = [np.asarray(o) for o in out]
    if any(
        a.dtype.kind in "OSU" for a in arrays
    ):  # Keras may declare a string output as numbers (StringLookup(invert))
        raise ValueError(STRING_OUTPUTS.format(outputs=names or "its output"))
    return [a.astype(np.float64, copy=False).reshape(rows, -1) for a in arrays]


def _to_arrow(ys: list[np.ndarray], info: ModelInfo, rows: int, probabilities: bool = True) -> pa.Array:
    kind, y = info.kind, ys[0]
    if kind == OUTPUTS:
        return pa.StructArray.from_arrays(
            [_values_array(part, rows, port) for part, port in zip(ys, info.outputs)],
            names=[port.name for port in info.outputs],
        )
    if kind == REGRESSION:
        return pa.array(y.reshape(rows))
    if kind == ARRAY:
        return _list_array(y.reshape(rows, -1))
    if kind == BINARY:
        p = y.reshape(rows)
        probability = np.stack([1.0 - p, p], axis=1)
        prediction = (p > 0.5).astype(np.float64)
    else:
        probability = y.reshape(rows, -1)
        prediction = probability.argmax(axis=1).astype(np.float64)
    if not probabilities:
        return pa.array(prediction)
    return pa.StructArray.from_arrays(
        [pa.array(prediction), _list_array(probability)], names=["prediction", "probability"]
    )


def one_value(port: Port) -> bool:
    """Whether an output gives one value per row (a double) rather than several (an array<double>)."""
    return port.shape in ((), (1,))


def _values_array(y: np.ndarray, rows: int, port: Port) -> pa.Array:
    return pa.array(y.reshape(rows)) if one_value(port) else _list_array(y.reshape(rows, -1))


def _list_array(values: np.ndarray) -> pa.Array:
    """A (rows, width) array as an Arrow list<double> array, sharing the numpy buffer."""
    rows, width = values.shape
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(values).reshape(-1)))


def _rows(x, start: int, stop: int):
    if isinstance(x, dict):
        return {key: value[start:stop] for key, value in x.items()}
    return x[start:stop]


def _features(column: pa.Array, spec: TaskSpec):
    """One batch of the UDF's struct column as the model's input: one array, or a dict by input name."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    arrays = [feed.to_numpy(column.field(i)) for i, feed in enumerate(spec.inputs)]
    if spec.named:
        return {feed.port.name: array for feed, array in zip(spec.inputs, arrays)}
    return arrays[0]
