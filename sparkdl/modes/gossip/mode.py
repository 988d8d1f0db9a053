"""Gossip mode's driver side: its options and plan, one barrier stage of ``num_workers`` tasks, rank 0's averaged model back."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from sparkdl.modes.barrier import BarrierPlan, Ranks
from sparkdl.modes.base import Mode, Option
from sparkdl.modes.gossip import peers, task

GOSSIP_EVERY = Option(
    "gossip_every", "local steps between two averagings of a worker's weights with its peers", default=1
)
PEERS = Option(
    "peers",
    "whom a worker averages with: 'ring' (its two ring neighbours, 1/3 each) or 'random' (one peer per round, "
    "from a seeded pairing of the workers)",
    kind=str,
    default=peers.RING,
    choices=peers.PEERS,
)


@dataclasses.dataclass(frozen=True)
class GossipPlan(BarrierPlan):
    """Decentralized data parallelism (D-PSGD): every worker trains its own replica with the model's own optimizer
    and, every ``gossip_every`` steps, averages its weights with its peers' only; no server, no global allreduce
    per step. The result is the average of the replicas.

    Rank 0 reports progress (the metrics are combined over ranks at each epoch end) and writes the
    checkpoints, of the replicas' average (at epoch ends, and mid-epoch at the steps every rank agrees on), from
    inside the stage, so that a stage Spark retries after losing a task resumes from what the failed attempt saved.
    """

    gossip_every: int = 1  # local steps between two rounds
    peers: str = peers.RING  # "ring" or "random" (``peers``)

    saves_step_checkpoints: ClassVar[bool] = True

    def train(self, ranks: Ranks) -> bytes | None:
        return task.train(self, ranks)


class GossipMode(Mode):
    """Decentralized (D-PSGD): every ``gossip_every`` steps each worker averages its weights with its peers' (its ring
    neighbours, or one random peer); no server, no global allreduce per step; the result is the replicas' average.

    ``mode="gossip"``: :class:`GossipPlan`.
    """

    names = ("gossip",)

    def options(self, name: str) -> tuple[Option, ...]:
        return (GOSSIP_EVERY, PEERS)

    def configure(self, name: str, model, values: dict) -> GossipPlan:
        if model.optimizer is None:
            raise ValueError("Expected a compiled model: mode='gossip' trains with the model's own optimizer.")
        return GossipPlan.from_values(name, values)
