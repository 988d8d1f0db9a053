"""``mode="sharded"``: its options and its two plans, ZeRO stage 1 (sync's replicas with 1/N of the optimizer state
each) and stage 3 (``modes.fully_sharded``: 1/N of the weights too)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from sparkdl.modes.base import Mode, Option
from sparkdl.modes.fully_sharded.driver import Zero3Plan
from sparkdl.modes.shared_options import COMPRESSION, PROFILE
from sparkdl.modes.sync import sharded
from sparkdl.modes.sync.mode import OVERLAP, SyncPlan

SHARD_WEIGHTS = Option(
    "shard_weights",
    "mode='sharded': keep only 1/N of the weights between uses too (ZeRO-3): each layer's weights are all-gathered "
    "just before its forward and its backward pass and dropped after (chain models; no callbacks)",
    kind=bool,
    default=False,
)

RESHARD_AFTER_FORWARD = Option(
    "reshard_after_forward",
    "mode='sharded', shard_weights=True: False keeps each layer's gathered weights and its forward pass's "
    "activations until its backward pass: no second gather and no forward run again, for the whole weights held "
    "during a step (1/N between steps); True gathers every layer's again for its backward pass but the last's; "
    "left out, the last layers' are kept up to 1 GiB of weights, the rest gathered again",
    kind=bool,
)


@dataclasses.dataclass(frozen=True)
class Zero1Plan(SyncPlan):
    """``mode="sharded"`` (ZeRO stage 1): sync's training with the optimizer's state and update split over the ranks
    (``sharded``): the same weights, 1/N of the optimizer's memory and work per rank. Sparkdl's collectives only."""

    shards_optimizer: ClassVar[bool] = True


class ShardedMode(Mode):
    """As sync, but each worker keeps and updates only its 1/N of the optimizer's state (ZeRO stage 1: gradients
    reduce-scattered, weights all-gathered); with ``shard_weights=True`` only 1/N of the weights too (ZeRO stage 3).
    The same weights, for an element-wise optimizer (SGD, Adam, ...: docs/large-models.md).

    ``mode="sharded"``: ZeRO stage 1 (:class:`Zero1Plan`), or with ``shard_weights=True`` stage 3
    (``modes.fully_sharded``'s ``Zero3Plan``); sparkdl's collectives only.
    """

    names = ("sharded",)

    def options(self, name: str) -> tuple[Option, ...]:
        return (COMPRESSION, OVERLAP, PROFILE, SHARD_WEIGHTS, RESHARD_AFTER_FORWARD)

    def configure(self, name: str, model, values: dict) -> Zero1Plan | Zero3Plan:
        sharded.check_model(model)
        if values["shard_weights"]:
            return Zero3Plan.configure(name, model, values)
        if values["reshard_after_forward"] is not None:
            raise ValueError(
                "Expected reshard_after_forward with shard_weights=True only: without it every rank holds the whole "
                f"weights throughout, and nothing is resharded. Received: "
                f"reshard_after_forward={values['reshard_after_forward']}"
            )
        return Zero1Plan.from_values(name, values)
