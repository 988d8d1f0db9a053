"""The one shape of a training mode: the job it is given, the result it returns, and what it declares.

| part           | what it says                                                                 |
|----------------|------------------------------------------------------------------------------|
| ``Job``        | what every mode trains with: the data, where to start, the common settings  |
| ``Settings``   | the common settings every task needs (shipped in the tasks' closures)        |
| ``Option``     | a setting only some modes take (``push_every``, ``sync_every``, ...)         |
| ``TaskLayout`` | the tasks a mode runs: each one's role and which rows it reads               |
| ``Mode``       | a mode's names and options; ``configure`` makes the plan of one fit          |
| ``Plan``       | one variant, configured: its checks, task layout, reporting, saving, ``run`` |
| ``ModeResult`` | the trained model, the history it trained, the mode's counters               |

``api.fit`` validates, asks ``MODES[mode].configure`` for a ``Plan``, prepares a ``Job`` and calls
``plan.run(job)``; a mode never reads the user's arguments itself. A plan is a frozen dataclass of one
variant's settings (one class per variant: sync, ZeRO-1, ZeRO-3, ...); it is what its tasks receive, so an
option is declared once (``Option``) and read where it is used.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np

from sparkdl import data, schedule
from sparkdl.checkpoint import Checkpoint, Checkpointer, CheckpointInterval, CheckpointStore
from sparkdl.data.rules import RowRules
from sparkdl.launch.layout import TaskLayout
from sparkdl.position import EpochPosition, EpochRest
from sparkdl.progress import ProgressMonitor


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings every mode's tasks need: small and picklable, shipped in the tasks' closures."""

    rules: RowRules  # what the rows must satisfy; the tasks judge their rows' statistics, which give the fields read
    num_workers: int
    epochs: int
    batch_size: int
    steps_per_epoch: int  # on the driver an estimate (1 until the tasks count the rows); the tasks use ``for_rows``
    seed: int
    shuffle: bool = True
    custom_objects: dict | None = None
    timeout: float = 600.0
    initial_epoch: int = 0  # resumed from a checkpoint: epochs initial_epoch..epochs-1 are trained
    initial_position: EpochPosition | None = None  # resumed from a step checkpoint: where epoch initial_epoch stands
    checkpoint_every: CheckpointInterval | None = None  # step checkpoints (with a checkpoint directory)
    min_workers: int | None = None  # the fewest workers the fit goes on with (None: all of them)
    validate: bool = False  # rows are held out: the workers evaluate them at every epoch end
    callbacks: tuple = ()  # the user's Keras callbacks (modes with ``runs_callbacks`` only)
    by_partition: bool = False  # the rows were dealt by whole input partitions (``TaskLayout.by_partition``)

    @classmethod
    def for_data(
        cls,
        training: data.TrainingData,
        *,
        num_workers: int,
        epochs: int,
        batch_size: int,
        seed: int,
        shards: int | None = None,
        **rest,
    ) -> Settings:
        """The settings of a fit over ``training``: its rules, the steps per epoch rows evenly split into ``shards``
        (default: one per worker) would take where the driver counted them (:func:`sparkdl.schedule.estimated_steps`;
        else 1 until the tasks count them), and validation when it holds rows out."""
        checked = training.checked
        return cls(
            rules=training.rules,
            num_workers=num_workers,
            epochs=epochs,
            batch_size=batch_size,
            steps_per_epoch=schedule.estimated_steps(checked.num_rows, shards or num_workers, batch_size)
            if checked is not None
            else 1,
            seed=seed,
            validate=training.rules.holds_out,
            **rest,
        )

    @property
    def spare_workers(self) -> int:
        """How many of its workers the fit may go on without (``num_workers - min_workers``; 0 without it)."""
        return self.num_workers - (self.min_workers or self.num_workers)

    def for_rows(self, rows_per_worker: Sequence[int]) -> Settings:
        """These settings with the exact steps per epoch of workers holding ``rows_per_worker`` training rows."""
        return dataclasses.replace(self, steps_per_epoch=schedule.steps_per_epoch(rows_per_worker, self.batch_size))

    def batches(self, rows: data.Rows, start: int | None = None, stop: int | None = None, *, fillers: bool = True):
        """The batches of global steps ``start..stop-1`` (default: the epochs left to train), as
        ``(x, y)`` or ``(x, y, sample_weight)`` tuples for Keras (see :func:`sparkdl.schedule.epoch_steps`)."""
        return rows.batches(self._parts(rows, start, stop, fillers))

    def chunks(self, rows: data.Rows, start: int, stop: int):
        """The same steps as :meth:`batches` (fillers included), as chunks of consecutive steps' rows."""
        return rows.chunks(self._parts(rows, start, stop, True))

    def rest_stream(self, rows: data.Rows, rest: EpochRest):
        """The batches of the steps left of ``rest``'s epoch, as a ``tf.data.Dataset`` of those steps for Keras's
        ``fit`` (``sparkdl.keras.epoch_dataset``)."""
        from sparkdl.keras.epoch_dataset import epoch_dataset

        return epoch_dataset(
            lambda epoch: rows.chunks(rest.parts()),
            example=rows.read(np.arange(1)),
            to_keras=rows.fields.keras_batch,
            first_epoch=rest.epoch,
            steps=rest.steps_left,
        )

    def epoch_stream(self, rows: data.Rows, initial_epoch: int):
        """The training batches of ``rows`` for Keras's ``fit``, epoch after epoch from ``initial_epoch``: the steps
        of :meth:`chunks`, as a ``tf.data.Dataset`` of one epoch that each iteration moves on by an epoch
        (``sparkdl.keras.epoch_dataset``; give ``fit`` no ``steps_per_epoch``)."""
        from sparkdl.keras.epoch_dataset import epoch_dataset

        steps = self.steps_per_epoch
        return epoch_dataset(
            lambda epoch: self.chunks(rows, start=epoch * steps, stop=(epoch + 1) * steps),
            example=rows.read(np.arange(1)),
            to_keras=rows.fields.keras_batch,
            first_epoch=initial_epoch,
            steps=steps,
        )

    def _parts(self, rows: data.Rows, start: int | None, stop: int | None, fillers: bool):
        return schedule.epoch_steps(
            len(rows),
            keys=rows.keys,
            steps=self.steps_per_epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            start=self.initial_epoch * self.steps_per_epoch if start is None else start,
            stop=self.epochs * self.steps_per_epoch if stop is None else stop,
            fillers=fillers,
        )


@dataclasses.dataclass(frozen=True)
class Job:
    """What a mode trains with: the common settings, and the mode's own options beside them.

    ``start`` is where training starts: epoch 0 and the user's model (serialized once, on the
    driver), or the newest checkpoint of ``checkpoints`` (read once, on the driver).
    """

    training: data.TrainingData
    start: Checkpoint
    settings: Settings
    plan: Plan  # what ``Mode.configure`` made of the mode's options; its ``mode`` is the name the user chose
    monitor: ProgressMonitor  # where progress goes; its epoch listeners see the combined metrics
    layout: TaskLayout  # the tasks to run (``Plan.layout``): ``launch.run_tasks`` takes it as it is
    checkpoints: CheckpointStore | None = None  # where checkpoints go, for modes whose tasks save them
    checkpointer: Checkpointer | None = None  # opened by ``fit`` for modes that save on the driver


@dataclasses.dataclass(frozen=True)
class ModeResult:
    """What a mode returns: the trained model (on the driver), the history of the epochs it trained, the
    mode's counters, and the epoch its (last) attempt started from.

    ``fit`` puts the history before ``initial_epoch`` in front: ``Job.start``'s, or ``resumed_history``
    where the mode resumed from a newer checkpoint than that (a sync stage Spark retried).
    """

    model: Any
    history: dict[str, list[float]]
    stats: dict
    initial_epoch: int
    resumed_history: dict[str, list[float]] | None = None


@dataclasses.dataclass(frozen=True)
class Option:
    """A setting only some modes take, declared once as data.

    ``sparkdl.fit``'s keyword, the estimator's Param (``camel_name``), and the jobs' flag (``flag``) and
    config key are all made from it (``modes.registry.declared_options``), so a new option is one
    declaration. ``None`` always means left out: the mode then uses ``default``.
    """

    name: str  # the keyword of sparkdl.fit, and the config key of the jobs
    meaning: str  # one line, for help texts, Param docs and the error of a missing required option
    kind: type = int  # int, float, bool, str, or list: a list of strings (the jobs' flag: comma-separated)
    default: Any = None  # what the mode uses when it is left out (None: the mode decides, see ``meaning``)
    minimum: int = 1  # for int: the least value taken
    choices: tuple[str, ...] = ()  # for str: the values taken
    required: bool = False
    check: Callable[[Any], object] | None = None  # its own check on the driver, run first; raises on a bad value

    @property
    def camel_name(self) -> str:
        """The Spark ML Param's name: ``push_every`` -> ``pushEvery``."""
        head, *rest = self.name.split("_")
        return head + "".join(part.title() for part in rest)

    @property
    def flag(self) -> str:
        """The jobs' command-line flag: ``push_every`` -> ``--push-every``."""
        return "--" + self.name.replace("_", "-")

    def expected(self) -> str:
        """What a value must be, in words (for errors and help texts)."""
        if self.kind is bool:
            return "True or False"
        if self.kind is str:
            return " or ".join(map(repr, self.choices)) if self.choices else "a string"
        if self.kind is list:
            return "a list of strings"
        if self.kind is float:
            return "a number"
        return (
            "a non-negative integer"
            if self.minimum == 0
            else "a positive integer"
            if self.minimum == 1
            else (f"an integer >= {self.minimum}")
        )

    def accepts(self, value) -> bool:
        """Whether ``value`` (not None) has the option's kind and lies within its bounds or choices."""
        if self.kind is bool:
            return isinstance(value, bool)
        if isinstance(value, bool):
            return False
        if self.kind is str:
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if self.kind is list:
            return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) and v for v in value)
        if self.kind is float:
            return isinstance(value, (int, float))
        return isinstance(value, int) and value >= self.minimum


_PlanT = TypeVar("_PlanT", bound="Plan")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One variant of a mode, configured for one fit: subclasses add their settings as fields and implement ``run``.

    The defaults suit a data-parallel mode whose driver writes the checkpoints and whose workers run the
    user's Keras callbacks; a variant overrides what differs.
    """

    mode: str  # the name the user chose ("async" and "ssp" are variants of one mode)

    runs_callbacks: ClassVar[bool] = True  # whether the user's Keras callbacks run inside its workers' fit
    # Who writes the checkpoints: "driver" (``fit`` opens ``Job.checkpointer`` and closes it after ``run``,
    # raising its errors) or "tasks" (a task writes them to ``Job.checkpoints``, as sync's rank 0 does, so
    # that a stage Spark retries resumes from what its failed attempt saved).
    saves_checkpoints: ClassVar[str] = "driver"
    # Whether the plan also saves step checkpoints (``checkpoint_every``) and resumes mid-epoch from one
    # (``sparkdl.position``).
    saves_step_checkpoints: ClassVar[bool] = False
    # Whether it resumes a step checkpoint on another number of workers too (its ranks find the epoch's untrained
    # rows with collectives: ``sparkdl.position.EpochRest.resume``), as ``min_workers`` needs.
    resumes_on_other_workers: ClassVar[bool] = True
    # Whether its tasks may read the rows' Parquet files themselves (``launch.parquet_files``): its stage reads the
    # rows once, in ``launch.run_tasks``.
    reads_rows_in_its_stage: ClassVar[bool] = True

    @classmethod
    def from_values(cls: type[_PlanT], name: str, values: dict) -> _PlanT:
        """The plan of variant ``name`` whose fields take the checked option ``values`` of the same names (an option
        without a field of its own, such as one that chose the plan's class, is left out)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(name, **{option: value for option, value in values.items() if option in names})

    def check_fit(self, *, num_workers: int, batch_size: int, weighted: bool) -> None:
        """Refuses, on the driver before any Spark job, a fit this plan cannot run: ``num_workers`` workers,
        ``batch_size`` rows per step, a sample weight column (``weighted``). By default every fit is fine."""

    def layout(self, num_workers: int) -> TaskLayout:
        """The tasks of a fit with ``num_workers``; by default one worker per shard of the rows."""
        return TaskLayout.data_parallel(num_workers)

    def refuses_fewer_workers(self, checkpointed: bool) -> str | None:
        """Why a fit of this plan cannot go on with fewer workers than it started with (``min_workers``), for the
        error; None when it can. By default it can where it resumes a step checkpoint on other workers: a lost
        executor's slots that do not come back end the stage, and the fit starts again from its newest checkpoint
        (``checkpointed``: it has a checkpoint directory) on the workers left."""
        if not (self.saves_step_checkpoints and self.resumes_on_other_workers):
            return "it resumes a step checkpoint on the workers it was taken on only"
        if not checkpointed:
            return "it goes on with fewer workers from its newest step checkpoint, and has no checkpoint_dir"
        return None

    def refuses_callbacks(self) -> str | None:
        """Why this plan cannot run the user's Keras callbacks, for the error (None when it runs them)."""
        return (
            None
            if self.runs_callbacks
            else f"mode={self.mode!r} does not use it (its workers run a training loop of their own)"
        )

    def reporting_ranks(self, num_workers: int) -> int:
        """How many workers report progress per epoch (1 when one speaks for all, or the driver reports)."""
        return 1

    def why_all_at_once(self, slots: int) -> str:
        """Why it needs a task slot per worker, for the error that says the cluster has too few."""
        return "A barrier stage needs all of its tasks running together"

    def run(self, job: Job) -> ModeResult:
        raise NotImplementedError


class Mode:
    """A training mode: its names and options, and ``configure``, which makes the ``Plan`` of one fit."""

    names: tuple[str, ...] = ()  # the names it answers to (variants of one mode share a class)
    summaries: dict[str, str] = {}  # each name's one-paragraph summary, for ``fit``'s docstring (default: the class's)

    def summary(self, name: str) -> str:
        """What variant ``name`` does, in a paragraph (``sparkdl.fit``'s docstring lists every mode's)."""
        if name in self.summaries:
            return self.summaries[name]
        return " ".join(inspect.cleandoc(type(self).__doc__ or name).split("\n\n")[0].split())

    def options(self, name: str) -> tuple[Option, ...]:
        """The settings the variant ``name`` takes beyond the common ones."""
        return ()

    def configure(self, name: str, model, values: dict) -> Plan:
        """The plan of a fit of variant ``name`` of ``model``, from checked ``values`` (an option's ``default`` where
        left out); raises on the driver what the variant cannot run."""
        raise NotImplementedError
