"""Fully sharded data parallelism on the driver: the model cut into units, each rank's part of it offered, rank 0's
whole trained model back. ``mode="sharded", shard_weights=True`` (``modes.sync.mode``) runs it."""

from __future__ import annotations

import dataclasses
import secrets

from sparkdl.keras import serialization
from sparkdl.launch.session import encrypts_traffic
from sparkdl.modes import whole_replicas
from sparkdl.modes.base import Job, ModeResult
from sparkdl.modes.fully_sharded import state, units
from sparkdl.modes.fully_sharded.task import FullyShardedTask, rank_payload, run_fully_sharded_task
from sparkdl.modes.pipeline.cut import StagePlan

#: Why a fully sharded fit runs no Keras callbacks, for the error that refuses them.
NO_CALLBACKS = (
    "mode='sharded' with shard_weights=True does not use (its ranks run each unit on gathered weights in a "
    "training loop of their own)"
)


@dataclasses.dataclass(frozen=True)
class FullyShardedOptions:
    plan: StagePlan  # the units: one trained layer each
    compile_config: dict  # the model's loss, metrics and optimizer
    compression: str | None
    overlap: bool


def configure(model, values: dict) -> FullyShardedOptions:
    """The options of a fully sharded fit, refusing on the driver what it cannot run."""
    if values["profile"]:
        raise ValueError(
            "Expected profile=False with shard_weights=True: `profile` times Keras's fit steps, which a fully sharded "
            "fit does not run (its timings are in FitResult.stats['fully_sharded'] anyway). Received: profile=True"
        )
    if model.optimizer is None:
        raise ValueError("Expected a compiled model: mode='sharded' trains with the model's own optimizer.")
    return FullyShardedOptions(
        units.plan_units(model), model.get_compile_config(), values["compression"], values["overlap"]
    )


def check_fit(*, weighted: bool) -> None:
    if weighted:
        raise ValueError(
            "mode='sharded' with shard_weights=True takes no `sample_weight_col`: its ranks weigh every row alike."
        )


def run(job: Job) -> ModeResult:
    options: FullyShardedOptions = job.options
    model = serialization.model_from_bytes(job.start.model_bytes, job.settings.custom_objects)
    layout = units.shard_layout(model, options.plan, job.settings.num_workers)
    offered = {rank_payload(r): state.rank_part(model, options.plan, layout, r) for r in range(layout.ranks)}
    del model
    task = FullyShardedTask(
        settings=job.settings,
        secret=secrets.token_bytes(32),
        plan=options.plan,
        layout=layout,
        compile_config=options.compile_config,
        compression=options.compression,
        overlap=options.overlap,
        checkpoints=job.checkpoints,
        start_history=job.start.history,
        encrypt=encrypts_traffic(job.training.frame.sparkSession),
    )
    return whole_replicas.run_stage(
        job, lambda batches, reporter: run_fully_sharded_task(batches, reporter, task), offered
    )
