"""A chain model cut into units, one trained layer each, and where each unit's weights lie in every rank's shard.

Fully sharded data parallelism gathers a unit's weights just before the unit runs and drops them
after, so a rank holds its 1/N of every weight plus at most two units' whole weights at a time. A
unit is one layer with trainable weights and the layers without any after it (the first unit also
those before it), planned with the pipeline's cutter (``pipeline.cut``: the same chains, the same
refusals). The units' trainable variables, in chain order, are the buckets of a
:class:`~sparkdl.modes.sync.sharded.ShardLayout`: each unit is padded to a multiple of the ranks and
cut in N equal parts, and rank r's shard is its part of every unit, in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparkdl.modes.pipeline import cut
from sparkdl.modes.sync.sharded import ShardLayout

if TYPE_CHECKING:
    import keras  # at run time imported where used: importing sparkdl must not load TensorFlow

PURPOSE = "to gather its weights layer by layer (shard_weights=True)"


def plan_units(model: keras.Model) -> cut.StagePlan:
    """``model``'s chain cut into units, each starting at a layer with trainable weights."""
    chain = cut.chain_of(model, PURPOSE)
    starts = [i for i, (layer, _) in enumerate(chain) if layer.trainable_weights]
    if not starts:
        raise ValueError(f"Expected a model with trainable weights to shard. Received: model '{model.name}' has none")
    names = [layer.name for layer, _ in chain]
    return cut.plan_stages(model, len(starts), [names[i] for i in starts[1:]], PURPOSE)


def unit_layers(model: keras.Model, plan: cut.StagePlan, unit: int) -> list[keras.layers.Layer]:
    """Unit ``unit``'s layers in ``model``: the whole model, or a copy of it."""
    return cut.stage_layers(model, plan, unit)


def own_layers(unit_model: keras.Model) -> list[keras.layers.Layer]:
    """A unit's layers in the unit's own model (``cut.build_stage``'s)."""
    return [layer for layer, _ in cut.chain_of(unit_model, PURPOSE)]


def trainables(layers) -> list[Any]:
    """The trainable variables of ``layers``, in chain order: the order of the shards and of the optimizer's slots."""
    return [variable for layer in layers for variable in layer.trainable_variables]


def statistics(layers) -> list[Any]:
    """The non-trainable weights of ``layers`` (BatchNorm's moving statistics, frozen layers'), in chain order: every
    rank holds them whole. A seed generator's state is not among them (Keras's ``weights`` leave it out)."""
    return [variable for layer in layers for variable in layer.non_trainable_weights]


def shard_layout(model: keras.Model, plan: cut.StagePlan, ranks: int) -> ShardLayout:
    """Where each unit's trainable variables (of the whole ``model``, in chain order) lie in ``ranks`` shards."""
    buckets: list[tuple[int, ...]] = []
    sizes: list[int] = []
    for unit in range(plan.num_stages):
        own = _variable_sizes(model, plan, unit)
        buckets.append(tuple(range(len(sizes), len(sizes) + len(own))))
        sizes += own
    return ShardLayout(tuple(buckets), tuple(sizes), ranks)


def kept_gathered(model: keras.Model, plan: cut.StagePlan, budget_bytes: int) -> int:
    """How many units, counted back from the last, keep their gathered weights from their forward pass to their
    backward pass within ``budget_bytes`` of whole weights (float32) held at once: at least the last unit, which runs
    its backward pass right after its forward pass and holds its weights in between anyway. The units needed first
    by the backward pass are the ones kept (DeepSpeed's ZeRO-3 keeps parameters gathered for reuse up to its
    ``stage3_max_live_parameters`` likewise)."""
    kept, held = 0, 0
    for unit in reversed(range(plan.num_stages)):
        held += 4 * sum(_variable_sizes(model, plan, unit))
        if kept and held > budget_bytes:
            break
        kept += 1
    return kept


def _variable_sizes(model: keras.Model, plan: cut.StagePlan, unit: int) -> list[int]:
    """The values in each of unit ``unit``'s trainable variables, in chain order."""
    return [_size(variable) for variable in trainables(unit_layers(model, plan, unit))]


def _size(variable) -> int:
    size = 1
    for dimension in variable.shape:
        size *= int(dimension)
    return size
