"""A pipeline stage's state as plain arrays: its weights and its optimizer's variables, cut from the whole model and put
back into it.

The stages travel between the driver, the stage tasks and the task that writes checkpoints as ``.npz`` bytes
(never pickled). An optimizer variable is named by what it belongs to: ``slot:<i>:<slot>`` for the slot
``<slot>`` (``momentum``, ``velocity``, ...) of the stage's ``i``-th trainable variable, ``global:<name>``
for the optimizer's own (``iteration``, ``learning_rate``). Keras names a slot after its variable's path,
and a stage's paths differ from the whole model's (another model name): the index carries across.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sparkdl.modes.pipeline.cut import StagePlan, assemble, stage_layers, stage_weights

if TYPE_CHECKING:
    import keras  # at run time imported where used: importing sparkdl must not load TensorFlow


def to_bytes(weights: Sequence[np.ndarray], optimizer_arrays: dict[str, np.ndarray], **extra: np.ndarray) -> bytes:
    """A stage's weights (in its layers' order), its optimizer's arrays (:func:`optimizer_arrays`) and ``extra``."""
    buffer = io.BytesIO()
    arrays = {f"weight:{i}": np.asarray(w) for i, w in enumerate(weights)}
    np.savez(buffer, **arrays, **optimizer_arrays, **extra)  # type: ignore[arg-type]
    return buffer.getvalue()


def from_bytes(data: bytes) -> tuple[list[np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(weights, optimizer arrays, extra arrays)`` of :func:`to_bytes`."""
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files}
    count = sum(name.startswith("weight:") for name in arrays)
    weights = [arrays.pop(f"weight:{i}") for i in range(count)]
    optimizer = {name: arrays.pop(name) for name in list(arrays) if name.startswith(("slot:", "global:"))}
    return weights, optimizer, arrays


def optimizer_arrays(optimizer: keras.optimizers.Optimizer, variables: Sequence) -> dict[str, np.ndarray]:
    """``optimizer``'s variables over ``variables`` (an unbuilt optimizer has none), by index-based name."""
    return {name: np.asarray(variable.numpy()) for name, variable in _named(optimizer, variables).items()}


def restore_optimizer(
    optimizer: keras.optimizers.Optimizer, variables: Sequence, arrays: dict[str, np.ndarray]
) -> None:
    """Builds ``optimizer`` over ``variables`` and sets the variables ``arrays`` holds (the rest keep their start)."""
    if not optimizer.built:
        optimizer.build(list(variables))
    for name, variable in _named(optimizer, variables).items():
        if name in arrays:
            variable.assign(arrays[name])


def stage_states(model: keras.Model, plan: StagePlan, stages: Sequence[int]) -> list[bytes]:
    """The parts of the whole ``model`` that ``stages`` hold: each one's weights and its variables' optimizer state
    (the optimizer's arrays read once for all of them)."""
    spans = _trainable_spans(model, plan)
    arrays = optimizer_arrays(model.optimizer, model.trainable_variables) if model.optimizer else {}
    return [
        to_bytes(stage_weights(model, plan, stage), _renumbered(arrays, *spans[stage], -spans[stage][0]))
        for stage in stages
    ]


def assemble_state(model: keras.Model, plan: StagePlan, states: Sequence[bytes]) -> list[dict[str, np.ndarray]]:
    """Puts every stage's state (in stage order) into the whole ``model``: weights and optimizer state. Returns each
    stage's extra arrays (:func:`to_bytes`'s ``extra``)."""
    parts = [from_bytes(data) for data in states]
    assemble(model, plan, [weights for weights, _, _ in parts])
    merged: dict[str, np.ndarray] = {}
    for (_, optimizer, _), (first, count) in zip(parts, _trainable_spans(model, plan)):
        merged.update(_renumbered(optimizer, 0, count, first))
    if model.optimizer is not None and merged:
        restore_optimizer(model.optimizer, model.trainable_variables, merged)
    return [extra for _, _, extra in parts]


def _named(optimizer, variables: Sequence) -> dict[str, Any]:
    prefixes = [variable.path.replace("/", "_") + "_" for variable in variables]
    named = {}
    for variable in optimizer.variables:
        name = variable.name
        owners = [i for i, prefix in enumerate(prefixes) if name.startswith(prefix)]
        if owners:
            owner = max(owners, key=lambda i: len(prefixes[i]))  # "a_kernel_" must not claim "a_kernel_2_..."
            named[f"slot:{owner}:{name[len(prefixes[owner]) :]}"] = variable
        else:
            named[f"global:{name}"] = variable
    return named


def _renumbered(arrays: dict[str, np.ndarray], first: int, count: int, shift: int) -> dict[str, np.ndarray]:
    """The arrays of trainable variables ``first..first+count-1`` (and the global ones), their index moved by ``shift``."""
    kept = {}
    for name, array in arrays.items():
        if name.startswith("slot:"):
            _, index, slot = name.split(":", 2)
            if first <= int(index) < first + count:
                kept[f"slot:{int(index) + shift}:{slot}"] = array
        else:
            kept[name] = array
    return kept


def _trainable_spans(model: keras.Model, plan: StagePlan) -> list[tuple[int, int]]:
    """For each stage, the index of its first trainable variable among ``model``'s, and how many it has."""
    counts = [
        sum(len(layer.trainable_variables) for layer in stage_layers(model, plan, s)) for s in range(plan.num_stages)
    ]
    return [(sum(counts[:stage]), count) for stage, count in enumerate(counts)]
