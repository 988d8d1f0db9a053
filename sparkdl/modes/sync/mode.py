"""Sync mode's plan and options: one barrier stage of ``num_workers`` tasks whose replicas stay one model, rank 0's
trained model back; ``mode="sharded"`` (``modes.sharded``) is its training with the state split over the ranks."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

from sparkdl.launch.backends import BACKENDS, check_backend, trainer_communicator
from sparkdl.launch.forward import TaskReporter
from sparkdl.modes.barrier import BarrierPlan, BarrierTask, Ranks
from sparkdl.modes.base import Mode, Option
from sparkdl.modes.shared_options import COMPRESSION, PROFILE
from sparkdl.modes.sync import task

BACKEND = Option(
    "backend",
    "whose collectives average the gradients: 'sparkdl' (its own communicator) or 'horovod' (needs the Horovod stack)",
    kind=str,
    default="sparkdl",
    choices=BACKENDS,
    check=check_backend,
)
OVERLAP = Option("overlap", "average gradient buckets of about 4 MB while backprop still runs", kind=bool, default=True)


@dataclasses.dataclass(frozen=True)
class SyncPlan(BarrierPlan):
    """``mode="sync"``: minibatch SGD at the global batch ``num_workers * batch_size``; the replicas stay one model.

    Rank 0 speaks for all ranks (their metrics are combined already): it reports progress and
    writes the checkpoints, from inside the stage, so that a stage Spark retries after losing a
    task resumes from what the failed attempt saved. The plan is shipped to every task as it is.
    """

    backend: str = "sparkdl"  # whose collectives average the gradients: sparkdl's communicator or Horovod's
    compression: str | None = None  # gradients on the wire as "bf16"/"fp16" (``sparkdl.collective.compression``)
    overlap: bool = True  # gradient buckets start moving while backprop runs (``reducer``)
    profile: bool = False  # every rank times each step's phases (``step_profile``); rank 0 returns them

    shards_optimizer: ClassVar[bool] = False  # each rank keeps and updates 1/N of the optimizer state (``sharded``)
    saves_step_checkpoints: ClassVar[bool] = True

    def connect(self, reporter: TaskReporter, task: BarrierTask) -> contextlib.AbstractContextManager:
        return trainer_communicator(self.backend, reporter, task.secret, task.settings.timeout, encrypt=task.encrypt)

    def train(self, ranks: Ranks) -> bytes | None:
        return task.train(self, ranks)


class SyncMode(Mode):
    """Every step, the workers' gradients are averaged by an allreduce (barrier mode: sparkdl's communicator, or
    Horovod's); equivalent to minibatch SGD at the global batch ``num_workers * batch_size``.

    ``mode="sync"``: :class:`SyncPlan`.
    """

    names = ("sync",)

    def options(self, name: str) -> tuple[Option, ...]:
        return (BACKEND, COMPRESSION, OVERLAP, PROFILE)

    def configure(self, name: str, model, values: dict) -> SyncPlan:
        backend, compression = values["backend"], values["compression"]
        if compression is not None and backend != "sparkdl":
            raise ValueError(
                f"Expected compression=None with backend={backend!r}: Horovod's collectives average in the "
                f"gradients' own dtype. Received: compression={compression!r}. Use backend='sparkdl' to compress."
            )
        return SyncPlan.from_values(name, values)
