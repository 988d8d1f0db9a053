"""Sync mode's driver side: one barrier stage of ``num_workers`` tasks, rank 0's trained model back."""

from __future__ import annotations

import dataclasses
import secrets

from sparkdl.collective import compression as compressions
from sparkdl.keras import serialization
from sparkdl.keras.prebuilt import PrebuiltModel
from sparkdl.launch import run_tasks
from sparkdl.launch.backends import check_backend
from sparkdl.launch.session import encrypts_traffic
from sparkdl.modes.base import Job, Mode, ModeResult, Option
from sparkdl.modes.sync import sharded
from sparkdl.modes.sync.task import MODEL, SyncTask, run_sync_task


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    backend: str = "ring"  # whose collectives average the gradients: sparkdl's ring or Horovod's
    compression: str | None = None  # gradients on the wire as "bf16"/"fp16" (``sparkdl.collective.compression``)
    overlap: bool = True  # gradient buckets start moving while backprop runs
    profile: bool = False  # time each step's phases on every rank (FitResult.stats["step_profile"])
    shard: bool = False  # mode="sharded": each rank keeps and updates 1/N of the optimizer state


class SyncMode(Mode):
    """Minibatch SGD at the global batch ``num_workers * batch_size``: the replicas stay one model.

    ``"sharded"`` is the same training with the optimizer's state and update split over the ranks
    (ZeRO stage 1, ``sharded``): the same weights, 1/N of the optimizer's memory and work per rank.

    Rank 0 speaks for all ranks (their metrics are combined already): it reports progress and
    writes the checkpoints, from inside the stage, so that a stage Spark retries after losing a
    task resumes from what the failed attempt saved.
    """

    names = ("sync", "sharded")

    def options(self, name: str) -> dict[str, Option]:
        backend = {"backend": Option(check=check_backend)} if name == "sync" else {}  # sharded: the ring's
        return {
            **backend,
            "compression": Option(check=compressions.check),
            "overlap": Option(check=_check_flag("overlap")),
            "profile": Option(check=_check_flag("profile")),
        }

    def configure(self, name: str, model, values: dict) -> SyncOptions:
        if name == "sharded":
            sharded.check_model(model)
        backend, compression = values.get("backend") or "ring", values.get("compression")
        if compression is not None and backend != "ring":
            raise ValueError(
                f"Expected compression=None with backend={backend!r}: Horovod's collectives average in the "
                f"gradients' own dtype. Received: compression={compression!r}. Use backend='ring' to compress."
            )
        overlap, profile = values.get("overlap"), values.get("profile")
        return SyncOptions(backend, compression, True if overlap is None else overlap, bool(profile), name == "sharded")

    def run(self, job: Job) -> ModeResult:
        task = SyncTask(
            settings=job.settings,
            secret=secrets.token_bytes(32),
            start_history=job.start.history,
            backend=job.options.backend,
            compression=job.options.compression,
            overlap=job.options.overlap,
            profile=job.options.profile,
            shard=job.options.shard,
            checkpoints=job.checkpoints,
            encrypt=encrypts_traffic(job.training.frame.sparkSession),
        )
        # The result's Keras model is built from the start point while the stage runs (``keras.prebuilt``).
        prebuilt = PrebuiltModel(job.start.model_bytes, job.settings.custom_objects, timeout=job.settings.timeout)
        results = run_tasks(
            job.training.frame,
            job.settings.num_workers,
            lambda batches, reporter: run_sync_task(batches, reporter, task),
            barrier=True,
            timeout=job.settings.timeout,
            on_progress=job.monitor.on_event,
            offered={MODEL: job.start.model_bytes},
        )
        model_bytes, history, initial_epoch, stats = serialization.result_from_bytes(results[0])
        return ModeResult(prebuilt.trained(model_bytes), history, stats, initial_epoch)


def _check_flag(name: str):
    def check(value) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"Expected `{name}` to be True or False. Received: {name}={value!r}")

    return check
