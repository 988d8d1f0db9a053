"""Fully sharded data parallelism's plan (ZeRO-3), on the driver: the model cut into units, each rank's part of it
offered, rank 0's whole trained model back. ``SyncMode.configure`` makes it for ``mode="sharded", shard_weights=True``."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from sparkdl.keras import serialization
from sparkdl.modes.barrier import BarrierPlan, Ranks
from sparkdl.modes.base import Job, ModeResult
from sparkdl.modes.fully_sharded import state, task, units
from sparkdl.modes.fully_sharded.task import rank_payload
from sparkdl.modes.pipeline.cut import StagePlan
from sparkdl.modes.sync.sharded import ShardLayout

# Whole weights (bytes) kept gathered from the units' forward to their backward passes when `reshard_after_forward`
# is left out: a model this small keeps every unit's (each gathered once a step, no forward run twice), a larger one
# only its last units', and still holds 1/N of its weights between steps.
KEPT_GATHERED_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Zero3Plan(BarrierPlan):
    """``mode="sharded", shard_weights=True`` (ZeRO stage 3): each rank keeps 1/N of the weights, the optimizer state
    and the gradients; each unit's weights are all-gathered just before its forward and backward passes and dropped
    after. Rank 0 reports progress and writes the checkpoints from inside the stage, as in sync mode."""

    units: StagePlan  # the units: one trained layer each
    compile_config: dict  # the model's loss, metrics and optimizer
    compression: str | None = None  # gradients on the wire as "bf16"/"fp16"
    overlap: bool = True  # gathers run ahead of the compute, reduce-scatters behind it
    kept_gathered: int = 1  # the units, counted back from the last, whose gathered weights and tape stay to their
    # backward pass (the rest are gathered again and run forward again there)
    sharding: ShardLayout | None = None  # where each unit's weights lie in each rank's shard: set by ``run``

    runs_callbacks: ClassVar[bool] = False
    saves_step_checkpoints: ClassVar[bool] = True

    @classmethod
    def configure(cls, name: str, model, values: dict) -> Zero3Plan:
        """The plan of a fully sharded fit, refusing on the driver what it cannot run."""
        if values["profile"]:
            raise ValueError(
                "Expected profile=False with shard_weights=True: `profile` times Keras's fit steps, which a fully "
                "sharded fit does not run (its timings are in FitResult.stats['fully_sharded'] anyway). "
                "Received: profile=True"
            )
        if model.optimizer is None:
            raise ValueError("Expected a compiled model: mode='sharded' trains with the model's own optimizer.")
        planned = units.plan_units(model)
        if values["reshard_after_forward"] is None:
            kept = units.kept_gathered(model, planned, KEPT_GATHERED_BYTES)
        else:
            kept = 1 if values["reshard_after_forward"] else planned.num_stages
        return cls(name, planned, model.get_compile_config(), values["compression"], values["overlap"], kept)

    def check_fit(self, *, num_workers: int, batch_size: int, weighted: bool) -> None:
        if weighted:
            raise ValueError(
                "mode='sharded' with shard_weights=True takes no `sample_weight_col`: its ranks weigh every row alike."
            )

    def refuses_callbacks(self) -> str | None:
        return (
            "mode='sharded' with shard_weights=True does not use (its ranks run each unit on gathered weights in a "
            "training loop of their own)"
        )

    def run(self, job: Job) -> ModeResult:
        """Offers each rank its part of the model (``state.rank_part``) and ships the plan with the ranks' layout."""
        model = serialization.model_from_bytes(job.start.model_bytes, job.settings.custom_objects)
        placed = dataclasses.replace(self, sharding=units.shard_layout(model, self.units, job.settings.num_workers))
        assert placed.sharding is not None
        ranks = range(placed.sharding.ranks)
        offered = {rank_payload(r): state.rank_part(model, self.units, placed.sharding, r) for r in ranks}
        del model
        return placed.writers_result(job, offered)

    def train(self, ranks: Ranks) -> bytes | None:
        return task.train(self, ranks)
