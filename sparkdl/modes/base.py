"""The one shape of a training mode: the job it is given, the result it returns, and what it declares.

| part           | what it says                                                                 |
|----------------|------------------------------------------------------------------------------|
| ``Job``        | what every mode trains with: the data, where to start, the common settings  |
| ``Settings``   | the common settings every task needs (shipped in the tasks' closures)        |
| ``Option``     | a setting only some modes take (``push_every``, ``sync_every``, ...)         |
| ``Mode``       | a mode's names, its options, whether it runs callbacks, who reports progress |
| ``ModeResult`` | the trained model, the whole history, the mode's counters                    |

``api.fit`` validates, prepares a ``Job`` and calls ``MODES[mode].run(job)``; a mode never
reads the user's arguments itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sparkdl import data, schedule
from sparkdl.checkpoint import Checkpoint, CheckpointStore
from sparkdl.data.fields import Layout
from sparkdl.progress import ProgressMonitor


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings every mode's tasks need: small and picklable, shipped in the tasks' closures."""

    layout: Layout  # the arrays Keras receives: inputs, targets, sample weights
    num_workers: int
    epochs: int
    batch_size: int
    steps_per_epoch: int  # on the driver an estimate (even partitions); the tasks use ``for_rows``'s exact count
    seed: int
    shuffle: bool = True
    custom_objects: dict | None = None
    timeout: float = 600.0
    initial_epoch: int = 0  # resumed from a checkpoint: epochs initial_epoch..epochs-1 are trained
    validate: bool = False  # rows are held out: the workers evaluate them at every epoch end
    callbacks: tuple = ()  # the user's Keras callbacks (modes with ``runs_callbacks`` only)

    @classmethod
    def for_data(
        cls, training: data.TrainingData, *, num_workers: int, epochs: int, batch_size: int, seed: int, **rest
    ) -> Settings:
        """The settings of a fit over ``training``: its layout, the steps per epoch evenly split rows would take
        (:func:`sparkdl.schedule.estimated_steps`), and validation when it holds rows out."""
        return cls(
            layout=training.layout,
            num_workers=num_workers,
            epochs=epochs,
            batch_size=batch_size,
            steps_per_epoch=schedule.estimated_steps(training.num_rows, num_workers, batch_size),
            seed=seed,
            validate=training.validation_rows > 0,
            **rest,
        )

    def for_rows(self, rows_per_worker: Sequence[int]) -> Settings:
        """These settings with the exact steps per epoch of workers holding ``rows_per_worker`` training rows."""
        return dataclasses.replace(self, steps_per_epoch=schedule.steps_per_epoch(rows_per_worker, self.batch_size))

    def batches(
        self, rows: data.Rows, rank: int, start: int | None = None, stop: int | None = None, *, fillers: bool = True
    ):
        """Rank ``rank``'s batches of global steps ``start..stop-1`` (default: the epochs left to train), as
        ``(x, y)`` or ``(x, y, sample_weight)`` tuples for Keras (see :func:`sparkdl.schedule.epoch_steps`)."""
        return rows.batches(self._parts(rows, rank, start, stop, fillers))

    def chunks(self, rows: data.Rows, rank: int, start: int, stop: int):
        """The same steps as :meth:`batches` (fillers included), as chunks of consecutive steps' rows."""
        return rows.chunks(self._parts(rows, rank, start, stop, True))

    def _parts(self, rows: data.Rows, rank: int, start: int | None, stop: int | None, fillers: bool):
        return schedule.epoch_steps(
            len(rows),
            steps=self.steps_per_epoch,
            seed=self.seed,
            rank=rank,
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
    mode: str  # the name the user chose ("async" and "ssp" are variants of one mode)
    options: Any  # the mode's own option object (``Mode.configure``)
    monitor: ProgressMonitor  # where progress goes; its epoch listeners see the combined metrics
    checkpoints: CheckpointStore | None = None


@dataclasses.dataclass(frozen=True)
class ModeResult:
    """What a mode returns: the trained model (on the driver), the history of all epochs (resumed ones
    included), the mode's counters, and the epoch its (last) attempt started from."""

    model: Any
    history: dict[str, list[float]]
    stats: dict
    initial_epoch: int


@dataclasses.dataclass(frozen=True)
class Option:
    """A setting only some modes take; ``None`` means left out (the mode's default).

    By default a whole number of at least ``minimum``; ``check`` replaces that check for other kinds.
    """

    minimum: int = 1
    required: bool = False
    check: Callable[[Any], object] | None = None  # raises on a bad value; what it returns is ignored
    meaning: str = ""  # what it sets, for the error when a required one is missing


class Mode:
    """A training mode: subclasses set the class attributes and implement ``configure`` and ``run``."""

    names: tuple[str, ...] = ()  # the names it answers to (variants of one mode share a class)
    runs_callbacks: bool = True  # whether the user's Keras callbacks run inside its workers' fit

    def options(self, name: str) -> dict[str, Option]:
        """The settings the variant ``name`` takes beyond the common ones."""
        return {}

    def configure(self, name: str, model, values: dict) -> Any:
        """The option object for ``Job.options``, from checked ``values`` (``None`` where left out)."""
        return None

    def reporting_ranks(self, num_workers: int) -> int:
        """How many workers report progress per epoch (1 when one speaks for all, or the driver reports)."""
        return 1

    def why_all_at_once(self, name: str, slots: int) -> str:
        """Why it needs a task slot per worker, for the error that says the cluster has too few."""
        return "A barrier stage needs all of its tasks running together"

    def run(self, job: Job) -> ModeResult:
        raise NotImplementedError
