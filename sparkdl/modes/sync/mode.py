"""Sync mode's driver side: one barrier stage of ``num_workers`` tasks, rank 0's trained model back."""

from __future__ import annotations

import dataclasses
import secrets

from sparkdl.keras import serialization
from sparkdl.launch import run_tasks
from sparkdl.launch.backends import check_backend
from sparkdl.launch.session import encrypts_traffic
from sparkdl.modes.base import Job, Mode, ModeResult, Option
from sparkdl.modes.sync.task import MODEL, SyncTask, run_sync_task


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    backend: str = "ring"  # whose collectives average the gradients: sparkdl's ring or Horovod's


class SyncMode(Mode):
    """Minibatch SGD at the global batch ``num_workers * batch_size``: the replicas stay one model.

    Rank 0 speaks for all ranks (their metrics are combined already): it reports progress and
    writes the checkpoints, from inside the stage, so that a stage Spark retries after losing a
    task resumes from what the failed attempt saved.
    """

    names = ("sync",)

    def options(self, name: str) -> dict[str, Option]:
        return {"backend": Option(check=check_backend)}

    def configure(self, name: str, model, values: dict) -> SyncOptions:
        return SyncOptions(values.get("backend") or "ring")

    def run(self, job: Job) -> ModeResult:
        task = SyncTask(
            settings=job.settings,
            secret=secrets.token_bytes(32),
            start_history=job.start.history,
            backend=job.options.backend,
            checkpoints=job.checkpoints,
            encrypt=encrypts_traffic(job.training.frame.sparkSession),
        )
        results = run_tasks(
            job.training.frame,
            job.settings.num_workers,
            lambda batches, reporter: run_sync_task(batches, reporter, task),
            barrier=True,
            timeout=job.settings.timeout,
            on_progress=job.monitor.on_event,
            offered={MODEL: job.start.model_bytes},
        )
        model_bytes, history, initial_epoch = serialization.result_from_bytes(results[0])
        return ModeResult(
            serialization.model_from_bytes(model_bytes, job.settings.custom_objects), history, {}, initial_epoch
        )
