"""Cutting a chain Keras model into consecutive pipeline stages, each rebuilt alone from a picklable plan.

The driver plans (:func:`plan_stages`): the model's layers, in order, split into ``num_stages``
contiguous groups, balanced by parameter count or starting at the user's ``cut_points``; per stage,
its layers' classes and configs and the shape and dtype of the activation that enters it. A worker
builds its stage from the plan alone (:func:`build_stage`) with only its own layers' weights
(:func:`stage_weights`); :func:`assemble` puts the stages' trained weights back into the full model.
Only chains are cut: one input, one output, every layer taking exactly the previous layer's output.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras  # at run time imported where used: importing sparkdl must not load TensorFlow


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One stage: its layers as (class, config) in order, the activation entering it (no batch axis), its size.

    The classes travel as the model's custom objects do (``ShippedObjects``): by reference where the workers can
    import them, so custom layers rebuild as themselves, and by value where they cannot (a module beside the
    driver's script).
    """

    layers: tuple[tuple[type[keras.layers.Layer], dict[str, Any]], ...]
    input_shape: tuple[int | None, ...]
    input_dtype: str
    parameters: int
    first: int  # the position of its first layer in the model's chain: another copy of the model (a checkpoint's,
    # whose layers Keras named otherwise) is cut at the same places

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(config["name"] for _, config in self.layers)

    def __reduce__(self):
        from sparkdl.keras.shipped_objects import ShippedObjects

        classes = ShippedObjects({str(i): cls for i, (cls, _) in enumerate(self.layers)})
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "layers"}
        return _shipped_stage, (classes, tuple(config for _, config in self.layers), fields)


def _plain(value):
    """``value`` with Keras's tracked lists and dicts (a StringLookup's vocabulary) as plain ones, which unpickle in
    a process that never built the layer."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map(_plain, value)) if type(value) in (list, tuple) else list(map(_plain, value))
    return value


def _shipped_stage(classes: dict, configs: tuple[dict[str, Any], ...], fields: dict) -> StageSpec:
    """A ``StageSpec`` as it was pickled (``StageSpec.__reduce__``)."""
    return StageSpec(layers=tuple((classes[str(i)], config) for i, config in enumerate(configs)), **fields)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A model's stages, in model order."""

    stages: tuple[StageSpec, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def parameters(self) -> tuple[int, ...]:
        """Each stage's parameter count (trainable and not)."""
        return tuple(stage.parameters for stage in self.stages)


def plan_stages(
    model: keras.Model,
    num_stages: int,
    cut_points: Sequence[str] | None = None,
    purpose: str = "to cut into `num_stages`",
) -> StagePlan:
    """``model``'s layers in ``num_stages`` consecutive stages: at ``cut_points`` (each the name of the first layer
    of a new stage, in model order) when given, else balanced (the largest stage's parameter count is least).
    ``purpose``: why a chain is needed, for the error that refuses another model."""
    import keras

    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"Expected `num_stages` to be a positive integer. Received: num_stages={num_stages!r}")
    chain = chain_of(model, purpose)
    if num_stages > len(chain):
        raise ValueError(
            f"Expected `num_stages` to be at most the model's {len(chain)} layers (every stage holds at least one). "
            f"Received: num_stages={num_stages}"
        )
    names = [layer.name for layer, _ in chain]
    if cut_points is None:
        starts = balanced_starts([layer.count_params() for layer, _ in chain], num_stages)
    else:
        starts = _starts_at(names, num_stages, cut_points)
    bounds = [*starts, len(chain)]
    stages = []
    for stage, (start, end) in enumerate(zip(bounds, bounds[1:])):
        entering = chain[start][1]
        if stage > 0 and not keras.backend.is_float_dtype(entering.dtype):
            raise ValueError(
                f"Expected the activation entering stage {stage} (the output of layer '{names[start - 1]}') to be "
                f"floating point: an integer activation carries no gradient back. Received: {entering.dtype}; cut "
                "elsewhere with `cut_points`"
            )
        layers = [layer for layer, _ in chain[start:end]]
        stages.append(
            StageSpec(
                layers=tuple((layer.__class__, _plain(layer.get_config())) for layer in layers),
                input_shape=tuple(entering.shape[1:]),
                input_dtype=str(entering.dtype),
                parameters=sum(layer.count_params() for layer in layers),
                first=start,
            )
        )
    return StagePlan(tuple(stages))


def chain_of(model: keras.Model, purpose: str = "to cut into `num_stages`") -> list[tuple[keras.layers.Layer, Any]]:
    """The model's layers from input to output, each with the (symbolic) tensor entering it; refuses a non-chain,
    saying why a chain is needed (``purpose``)."""
    import keras

    try:
        inputs, outputs = model.inputs, model.outputs
    except AttributeError:
        raise ValueError(
            f"Expected a built model (give it a keras.Input). Received: model '{model.name}', not built"
        ) from None
    if len(inputs) != 1 or len(outputs) != 1:
        raise ValueError(
            f"Expected a model with one input and one output {purpose}. "
            f"Received: {len(inputs)} inputs and {len(outputs)} outputs"
        )
    chain: list[tuple[keras.layers.Layer, Any]] = []
    tensor = outputs[0]
    while True:
        operation, node_index, _ = tensor._keras_history
        if isinstance(operation, keras.layers.InputLayer):
            break
        if not isinstance(operation, keras.layers.Layer):
            raise ValueError(
                "Expected every step of the model to be a Keras layer, so that a stage rebuilds from its layers' "
                f"configs. Received: the operation '{operation.name}' ({type(operation).__name__}); wrap it in a layer"
            )
        entering = operation._inbound_nodes[node_index].input_tensors
        if len(entering) != 1:
            producers = ", ".join(f"'{t._keras_history[0].name}'" for t in entering)
            raise ValueError(
                f"Expected a chain of layers, each taking exactly the previous layer's output, {purpose}. "
                f"Received: layer '{operation.name}' merges {len(entering)} tensors (from {producers})"
            )
        if any(layer is operation for layer, _ in chain):
            raise ValueError(
                f"Expected a chain of distinct layers {purpose}. "
                f"Received: layer '{operation.name}' is called more than once (its weights are shared)"
            )
        chain.append((operation, entering[0]))
        tensor = entering[0]
    chain.reverse()
    return chain


def balanced_starts(sizes: Sequence[int], num_stages: int) -> list[int]:
    """The first index of each of ``num_stages`` contiguous non-empty groups of ``sizes`` whose largest sum is least
    (binary search on that sum; for ties, the earlier groups take the more)."""
    low, high = max(sizes), sum(sizes)
    while low < high:
        limit = (low + high) // 2
        if len(_fill(sizes, limit, num_stages)) <= num_stages:
            high = limit
        else:
            low = limit + 1
    return _fill(sizes, low, num_stages)


def _fill(sizes: Sequence[int], limit: int, num_stages: int) -> list[int]:
    """Greedy groups of at most ``limit`` each, opening one more whenever only enough sizes remain for one group
    each: exactly ``num_stages`` groups when ``limit`` allows them, more when it does not."""
    starts, total = [0], sizes[0]
    for i in range(1, len(sizes)):
        if total + sizes[i] > limit or len(sizes) - i == num_stages - len(starts):
            starts.append(i)
            total = 0
        total += sizes[i]
    return starts


def _starts_at(names: list[str], num_stages: int, cut_points: Sequence[str]) -> list[int]:
    if isinstance(cut_points, str) or len(cut_points) != num_stages - 1:
        count = "a string" if isinstance(cut_points, str) else f"{len(cut_points)} names"
        raise ValueError(
            f"Expected `cut_points` to be a list of {num_stages - 1} layer names (num_stages={num_stages}: each "
            f"names the first layer of a stage after the first). Received: {count}: cut_points={cut_points!r}"
        )
    unknown = [name for name in cut_points if name not in names]
    if unknown:
        raise ValueError(f"Expected `cut_points` to name layers of the model ({', '.join(names)}). Received: {unknown}")
    starts = [names.index(name) for name in cut_points]
    if any(later <= earlier for earlier, later in zip(starts, starts[1:])):
        raise ValueError(
            "Expected `cut_points` in the model's layer order, each once. "
            f"Received: cut_points={list(cut_points)!r} (model order: {', '.join(names)})"
        )
    if starts and starts[0] == 0:
        raise ValueError(
            "Expected `cut_points` to start stages after the first: stage 0 would be empty. "
            f"Received: '{names[0]}', the model's first layer"
        )
    return [0, *starts]


def build_stage(plan: StagePlan, stage: int, weights: Sequence[np.ndarray] | None = None) -> keras.Model:
    """Stage ``stage`` of ``plan`` as a model of its own, with ``weights`` (those of :func:`stage_weights`) if given."""
    import keras

    spec = plan.stages[stage]
    inputs = keras.Input(spec.input_shape, dtype=spec.input_dtype)
    layers = [cls.from_config(copy.deepcopy(config)) for cls, config in spec.layers]
    outputs = inputs
    for layer in layers:
        outputs = layer(outputs)
    model = keras.Model(inputs, outputs, name=f"stage_{stage}")
    if weights is not None:
        _set_layer_weights(layers, weights, stage)
    return model


def stage_layers(model: keras.Model, plan: StagePlan, stage: int) -> list[keras.layers.Layer]:
    """Stage ``stage``'s layers in ``model`` (the whole model, or a copy of it), by their places in its chain."""
    spec = plan.stages[stage]
    return [layer for layer, _ in chain_of(model)[spec.first : spec.first + len(spec.layers)]]


def stage_weights(model: keras.Model, plan: StagePlan, stage: int) -> list[np.ndarray]:
    """The weights of stage ``stage``'s layers in ``model`` (the full model), layer by layer in order."""
    return [w for layer in stage_layers(model, plan, stage) for w in layer.get_weights()]


def assemble(model: keras.Model, plan: StagePlan, weights_by_stage: Sequence[Sequence[np.ndarray]]) -> None:
    """Sets the full ``model``'s weights from every stage's (as :func:`stage_weights` orders them), in place."""
    if len(weights_by_stage) != plan.num_stages:
        raise ValueError(
            f"Expected the weights of {plan.num_stages} stages. Received: {len(weights_by_stage)} stages' weights"
        )
    for stage, weights in enumerate(weights_by_stage):
        _set_layer_weights(stage_layers(model, plan, stage), weights, stage)


def _set_layer_weights(layers: Sequence[keras.layers.Layer], weights: Sequence[np.ndarray], stage: int) -> None:
    expected = sum(len(layer.weights) for layer in layers)
    if len(weights) != expected:
        raise ValueError(f"Expected {expected} weight arrays for the layers of stage {stage}. Received: {len(weights)}")
    position = 0
    for layer in layers:
        layer.set_weights(weights[position : position + len(layer.weights)])
        position += len(layer.weights)
