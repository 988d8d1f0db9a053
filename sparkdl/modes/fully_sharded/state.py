"""A rank's part of a fully sharded model, cut from the whole model, and the whole model put back from the parts.

The driver cuts each rank's part of the model it starts from (:func:`rank_part`): the rank's shard of
the trainable weights, its shard of every optimizer slot (Adam's ``momentum`` and ``velocity``, ...),
the optimizer's own variables (``iteration``, ``learning_rate``) and the non-trainable weights, whole.
It travels as ``.npz`` bytes (never pickled), so that no rank ever receives the whole model. Rank 0
gathers every rank's shards and puts them into a whole model (:func:`assemble`) for a checkpoint or
the result; a rank that resumes from a checkpoint cuts its own part of it with :func:`rank_part`.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from sparkdl.modes.fully_sharded import units
from sparkdl.modes.pipeline import cut
from sparkdl.modes.pipeline import state as stage_state
from sparkdl.modes.sync.sharded import ShardLayout

if TYPE_CHECKING:
    import keras  # at run time imported where used: importing sparkdl must not load TensorFlow

WEIGHTS = "shard"  # the rank's shard of the trainable weights
SLOT = "slot:"  # "slot:<name>": its shard of the slot <name> of every trainable variable
STATISTIC = "statistic:"  # "statistic:<unit>:<k>": the unit's k-th non-trainable weight, whole


def rank_part(model: keras.Model, plan: cut.StagePlan, layout: ShardLayout, rank: int) -> bytes:
    """Rank ``rank``'s part of the whole ``model``: its shards, the optimizer's own variables, the statistics."""
    trainables = [v for u in range(plan.num_stages) for v in units.trainables(units.unit_layers(model, plan, u))]
    optimizer = stage_state.optimizer_arrays(model.optimizer, trainables) if model.optimizer is not None else {}
    arrays = {WEIGHTS: layout.shard_of([np.asarray(v.numpy(), np.float32) for v in trainables], rank)}
    for name in slot_names(optimizer):
        keys = [f"slot:{i}:{name}" for i in range(len(trainables))]
        if any(key not in optimizer for key in keys):
            raise ValueError(f"{type(model.optimizer).__name__} holds the slot '{name}' for some variables only")
        arrays[SLOT + name] = layout.shard_of([optimizer[key] for key in keys], rank)
    arrays.update({name: value for name, value in optimizer.items() if name.startswith("global:")})
    for unit in range(plan.num_stages):
        for k, variable in enumerate(units.statistics(units.unit_layers(model, plan, unit))):
            arrays[f"{STATISTIC}{unit}:{k}"] = np.asarray(variable.numpy())
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def read_part(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of a :func:`rank_part`."""
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def slot_names(optimizer_arrays: dict[str, np.ndarray]) -> list[str]:
    """The slots an optimizer keeps per variable (``slot:<i>:<name>`` keys of ``stage_state.optimizer_arrays``)."""
    return sorted({key.split(":", 2)[2] for key in optimizer_arrays if key.startswith("slot:")})


def assemble(
    model: keras.Model,
    plan: cut.StagePlan,
    weights: Sequence[np.ndarray],
    optimizer: dict[str, np.ndarray],
    statistics: Sequence[Sequence[np.ndarray]],
) -> None:
    """Puts the whole trainable ``weights`` (chain order), the ``optimizer`` arrays (``slot:<i>:<name>``,
    ``global:<name>``) and every unit's ``statistics`` into the whole ``model``, in place."""
    layers = [units.unit_layers(model, plan, u) for u in range(plan.num_stages)]
    trainables = [v for unit in layers for v in units.trainables(unit)]
    if len(weights) != len(trainables):
        raise ValueError(f"Expected {len(trainables)} trainable weights. Received: {len(weights)}")
    for variable, value in zip(trainables, weights):
        variable.assign(np.reshape(value, tuple(variable.shape)))
    for unit, values in zip(layers, statistics):
        for variable, value in zip(units.statistics(unit), values):
            variable.assign(value)
    if model.optimizer is not None and optimizer:
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # Keras's order: a saved model reloads into it
        stage_state.restore_optimizer(model.optimizer, trainables, optimizer)
