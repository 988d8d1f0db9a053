"""Pipeline mode's driver side: the model cut into stages, one barrier task per stage and replica, the stages'
trained state put back into one model.

``num_workers = data_replicas * num_stages`` tasks, laid out as Keras's ``DeviceMesh`` with the axes
``("batch", "model")``: task ``t`` is stage ``t % num_stages`` of replica ``t // num_stages``. Each
replica's first stage reads the features of one shard of the rows and its last stage the labels of
the same shard (the layout gives both the same rows in the same order); middle stages read nothing.
Each stage task gets only its own layers' weights and optimizer state (``state.stage_states``), offered
by the driver, and returns them; the driver assembles the trained model.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from sparkdl.keras import serialization
from sparkdl.launch.layout import Task, TaskLayout
from sparkdl.modes.barrier import BarrierPlan, Ranks
from sparkdl.modes.base import Job, Mode, ModeResult, Option
from sparkdl.modes.pipeline import cut, schedules, state, task
from sparkdl.modes.pipeline.task import read_report, stage_payload
from sparkdl.modes.shared_options import PROFILE


def _check_cut_points(value) -> None:
    if isinstance(value, str):  # a string is a sequence of strings too: it would cut at single letters
        raise ValueError(
            f"Expected `cut_points` to be a list of layer names, e.g. ['dense_2', 'dense_4']. Received: cut_points={value!r}"
        )


NUM_STAGES = Option("num_stages", "consecutive stages the model is cut into, one task each", minimum=2, required=True)
MICRO_BATCHES = Option("micro_batches", "parts of each batch that flow through the stages one after another", default=4)
SCHEDULE = Option(
    "schedule",
    "the order of a step's passes on each stage: GPipe's (every forward, then every backward) or 1F1B's (one forward "
    "and one backward in turn: the same bubble, fewer micro-batches' activations held at once)",
    kind=str,
    default="gpipe",
    choices=tuple(schedules.SCHEDULES),
)
CUT_POINTS = Option(
    "cut_points",
    "the names of the layers that start stages 2, 3, ... (default: stages balanced by parameters)",
    kind=list,
    check=_check_cut_points,
)


@dataclasses.dataclass(frozen=True)
class PipelinePlan(BarrierPlan):
    """Every step's micro-batches flow forward through the stages and their gradients back, in GPipe's or 1F1B's
    order (``schedules``); each stage then applies its own optimizer to its own layers (``engine.PipelineStage``).

    The last stage of replica 0 speaks for all: it reports progress, and writes the checkpoints (the
    stages of replica 0 send it their state), from inside the stage, so that a stage Spark retries resumes
    from what the failed attempt saved.
    """

    stages: cut.StagePlan  # the stages: layers, boundary shapes, parameters
    micro_batches: int
    schedule: str  # schedules.SCHEDULES's name of the order of a step's passes
    compile_config: dict  # the model's compile settings: each stage's optimizer, the last stage's loss and metrics
    profile: bool = False  # each stage records its micro-batches' events (FitResult.stats["pipeline"]["timeline"])

    runs_callbacks: ClassVar[bool] = False  # its stages run their own loop (``epoch.StageEpochs``), not Keras's fit
    saves_step_checkpoints: ClassVar[bool] = True

    def check_fit(self, *, num_workers: int, batch_size: int, weighted: bool) -> None:
        stages = self.stages.num_stages
        if num_workers % stages:
            raise ValueError(
                f"Expected `num_workers` to be a multiple of num_stages={stages} (data replicas x stages). "
                f"Received: num_workers={num_workers}"
            )
        if self.micro_batches > batch_size:
            raise ValueError(
                f"Expected `micro_batches` to be at most batch_size={batch_size} (a micro-batch holds at least a "
                f"row). Received: micro_batches={self.micro_batches}"
            )
        if weighted:
            raise ValueError("mode='pipeline' takes no `sample_weight_col`: its stages weigh every row alike.")

    def layout(self, num_workers: int) -> TaskLayout:
        stages = self.stages.num_stages
        return TaskLayout(
            tuple(
                Task(
                    f"replica {t // stages} stage {t % stages}", t // stages if t % stages in (0, stages - 1) else None
                )
                for t in range(num_workers)
            )
        )

    def shard_ranks(self, size: int) -> range:
        return range(0, size, self.stages.num_stages)  # each replica's first stage reads its shard

    def shard_of(self, rank: int, size: int) -> int:
        return rank // self.stages.num_stages  # every stage of a replica walks its shard's steps

    def writer(self, size: int) -> int:
        return self.stages.num_stages - 1  # the last stage of replica 0

    def train(self, ranks: Ranks) -> bytes | None:
        return task.train(self, ranks)

    def run(self, job: Job) -> ModeResult:
        """Offers each stage its weights and optimizer state; assembles replica 0's stages' trained state."""
        model = serialization.model_from_bytes(job.start.model_bytes, job.settings.custom_objects)
        stages = range(self.stages.num_stages)
        offered = {stage_payload(s): part for s, part in zip(stages, state.stage_states(model, self.stages, stages))}
        results = self.run_stage(job, offered)
        trained = [results[s] for s in stages]  # replica 0's stages
        extras = state.assemble_state(model, self.stages, trained)
        history, stats, initial_epoch, resumed = read_report(extras[-1])
        return ModeResult(model, history, stats, initial_epoch, resumed)


class PipelineMode(Mode):
    """The model cut into ``num_stages`` consecutive stages, one task each (GPipe, or 1F1B with ``schedule="1f1b"``):
    each batch's micro-batches flow forward through the stages and their gradients back; for a model too large for one worker, with ``num_workers /
    num_stages`` data-parallel replicas.

    ``mode="pipeline"``: :class:`PipelinePlan`.
    """

    names = ("pipeline",)

    def options(self, name: str) -> tuple[Option, ...]:
        return (NUM_STAGES, MICRO_BATCHES, SCHEDULE, CUT_POINTS, PROFILE)

    def configure(self, name: str, model, values: dict) -> PipelinePlan:
        points = values["cut_points"]
        stages = cut.plan_stages(model, values["num_stages"], None if points is None else list(points))
        if model.optimizer is None:
            raise ValueError("Expected a compiled model: mode='pipeline' trains with the model's own optimizer.")
        return PipelinePlan(
            name, stages, values["micro_batches"], values["schedule"], model.get_compile_config(), values["profile"]
        )
