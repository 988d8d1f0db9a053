"""Which modes ``sparkdl.plan`` weighs, each with the ``fit`` keywords that run it and its step's cost, and why it
weighs none of the others.

A planned mode is a label (its line in the plan's table), the ``sparkdl.fit`` keywords that run it, the
counts of its step's communication (a function of :mod:`.mode_costs`, or any ``(n, nbytes) -> Cost``),
how it splits a worker's memory, how much of a step's compute it repeats, and whether it puts a server
beside each worker. Another package adds one with :func:`register_planned`. Every mode of
``sparkdl.modes.registry`` is either planned or in :data:`NOT_PLANNED` with the reason
(``tests/test_plan.py`` keeps them in step).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from sparkdl.collective.cost import Cost
from sparkdl.launch.layout import TaskLayout
from sparkdl.modes.parameter_server import stage
from sparkdl.planner import mode_costs
from sparkdl.ps import sharding


def replicated(n: int, weights: int, slots: int, largest_layers: int) -> int:
    """A worker's bytes holding every weight, optimizer slot and gradient (activations left out)."""
    return weights + slots * weights + weights


def sharded_optimizer(n: int, weights: int, slots: int, largest_layers: int) -> int:
    """ZeRO-1's: every weight and gradient, 1/N of the optimizer's slots."""
    return weights + slots * weights // n + weights


def sharded_weights(n: int, weights: int, slots: int, largest_layers: int) -> int:
    """ZeRO-3's: 1/N of everything, and the two largest layers whole while they run."""
    return weights // n + slots * weights // n + largest_layers + weights // n


def weights_gathered_in_step(n: int, weights: int, slots: int, largest_layers: int) -> int:
    """ZeRO-3's without resharding after the forward pass: 1/N of everything, and the whole weights while a step
    runs."""
    return weights // n + slots * weights // n + weights + weights // n


@dataclasses.dataclass(frozen=True)
class PlannedMode:
    """A mode the planner weighs: its ``fit`` keywords, its step's communication and how it uses a worker."""

    keywords: dict
    cost: Callable[[int, float], Cost]  # the counts of a step on n workers of the model's nbytes of gradients
    memory: Callable[[int, int, int, int], int] = replicated  # (n, weights, slots, largest layers) -> bytes
    compute_factor: float = 1.0  # a step's compute against sync's (4/3: every forward pass runs twice)
    shard_per_worker: bool = False  # one parameter-server shard beside each worker: num_servers = num_workers

    def fit_keywords(self, num_workers: int) -> dict:
        """The ``fit`` keywords of this mode on ``num_workers`` workers."""
        return {**self.keywords, "num_servers": num_workers} if self.shard_per_worker else dict(self.keywords)

    def runs(self, num_workers: int, trainable_variables: int) -> bool:
        """Whether ``fit`` takes it for a model of ``trainable_variables``: a server shard holds whole variables."""
        return not self.shard_per_worker or sharding.holds_whole_variables(num_workers, trainable_variables)

    def task_slots(self, num_workers: int) -> int:
        """The task slots its ``fit`` claims on ``num_workers`` workers: the fit's own task layout (with a shard per
        worker, a server task beside each one)."""
        if self.shard_per_worker:
            return stage.layout(num_workers, num_workers).slots
        return TaskLayout.data_parallel(num_workers).slots


#: The modes the planner weighs, by label, in the order registered.
PLANNED: dict[str, PlannedMode] = {}

#: The registered modes the planner does not weigh, each with the reason.
NOT_PLANNED: dict[str, str] = {
    "hogwild": "async's traffic exactly (the same pushes and pulls); it differs in how the shards apply them, "
    "which changes the training, not the step the planner predicts",
    "ssp": "async's traffic, plus waits for the slowest worker that depend on the workers' spread of speeds, "
    "which the probe of one worker does not measure",
    "average": "its exchange happens every `sync_every` steps through the driver's broadcast and a Spark "
    "accumulator, not per step over the links the probe measures; its step is one worker's",
    "pipeline": "model parallelism for a model that does not fit one worker: its step depends on the cut points "
    "and micro-batches, not on the per-worker memory and gradient bytes the planner weighs; the plan suggests it "
    "when nothing fits",
}


def register_planned(
    label: str,
    keywords: dict,
    cost: Callable[[int, float], Cost],
    *,
    memory: Callable[[int, int, int, int], int] = replicated,
    compute_factor: float = 1.0,
    shard_per_worker: bool = False,
) -> None:
    """Adds a mode the planner weighs under ``label``: ``keywords`` are the ``fit`` keywords that run it (``mode``
    among them), ``cost(n, nbytes)`` its step's communication counts on ``n`` workers."""
    if not isinstance(label, str) or not label:
        raise ValueError(f"Expected `label` to be a non-empty string. Received: label={label!r}")
    if label in PLANNED:
        raise ValueError(f"Planned mode label {label!r} is taken already.")
    if not isinstance(keywords, dict) or not isinstance(keywords.get("mode"), str):
        raise ValueError(f"Expected `keywords` to be fit keywords naming a `mode`. Received: keywords={keywords!r}")
    if not callable(cost) or not callable(memory):
        raise ValueError(f"Expected `cost` and `memory` to be functions. Received: cost={cost!r}, memory={memory!r}")
    PLANNED[label] = PlannedMode(dict(keywords), cost, memory, compute_factor, shard_per_worker)


def unregister_planned(label: str) -> None:
    """Removes the planned mode ``label`` (a test's, once it is done)."""
    if label not in PLANNED:
        raise ValueError(f"Expected a planned mode's label, one of {list(PLANNED)}. Received: label={label!r}")
    del PLANNED[label]


register_planned("sync", {"mode": "sync"}, mode_costs.sync)
register_planned("sharded", {"mode": "sharded"}, mode_costs.zero1, memory=sharded_optimizer)
register_planned(
    "sharded, shard_weights=True, reshard_after_forward=True",
    {"mode": "sharded", "shard_weights": True, "reshard_after_forward": True},
    mode_costs.zero3,
    memory=sharded_weights,
    compute_factor=4.0 / 3.0,  # forward + backward (twice a forward) + the forward again
)
register_planned(
    "sharded, shard_weights=True, reshard_after_forward=False",
    {"mode": "sharded", "shard_weights": True, "reshard_after_forward": False},
    functools.partial(mode_costs.zero3, reshard_after_forward=False),
    memory=weights_gathered_in_step,
)
register_planned("async", {"mode": "async"}, mode_costs.parameter_server)
register_planned(
    "async, servers on executors",
    {"mode": "async", "server_placement": "executors"},
    mode_costs.spread_ps,
    shard_per_worker=True,
)
register_planned("sync_ps", {"mode": "sync_ps"}, mode_costs.sync_ps)
register_planned("gossip", {"mode": "gossip"}, mode_costs.gossip)
