"""Sync mode's driver side: one barrier stage of ``num_workers`` tasks, rank 0's trained model back."""

from __future__ import annotations

import dataclasses
import secrets

from sparkdl.launch.backends import BACKENDS, check_backend
from sparkdl.launch.session import encrypts_traffic
from sparkdl.modes import whole_replicas
from sparkdl.modes.base import Job, Mode, ModeResult, Option
from sparkdl.modes.fully_sharded import driver as fully_sharded
from sparkdl.modes.shared_options import COMPRESSION, PROFILE
from sparkdl.modes.sync import sharded
from sparkdl.modes.sync.task import SyncTask, run_sync_task

BACKEND = Option(
    "backend",
    "whose collectives average the gradients: sparkdl's 'ring' or 'horovod' (needs the Horovod stack)",
    kind=str,
    default="ring",
    choices=BACKENDS,
    check=check_backend,
)
OVERLAP = Option("overlap", "average gradient buckets of about 4 MB while backprop still runs", kind=bool, default=True)
SHARD_WEIGHTS = Option(
    "shard_weights",
    "mode='sharded': keep only 1/N of the weights between uses too (ZeRO-3): each layer's weights are all-gathered "
    "just before its forward and its backward pass and dropped after (chain models; no callbacks)",
    kind=bool,
    default=False,
)


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
    (ZeRO stage 1, ``sharded``): the same weights, 1/N of the optimizer's memory and work per rank; with
    ``shard_weights=True`` the weights too (ZeRO stage 3, ``modes.fully_sharded``).

    Rank 0 speaks for all ranks (their metrics are combined already): it reports progress and
    writes the checkpoints, from inside the stage, so that a stage Spark retries after losing a
    task resumes from what the failed attempt saved.
    """

    names = ("sync", "sharded")

    saves_checkpoints = "tasks"

    def options(self, name: str) -> tuple[Option, ...]:
        if name == "sharded":  # the ring's collectives
            return (COMPRESSION, OVERLAP, PROFILE, SHARD_WEIGHTS)
        return (BACKEND, COMPRESSION, OVERLAP, PROFILE)

    def configure(self, name: str, model, values: dict) -> SyncOptions | fully_sharded.FullyShardedOptions:
        if name == "sharded":
            sharded.check_model(model)
            if values["shard_weights"]:
                return fully_sharded.configure(model, values)
        backend, compression = values.get("backend", "ring"), values["compression"]
        if compression is not None and backend != "ring":
            raise ValueError(
                f"Expected compression=None with backend={backend!r}: Horovod's collectives average in the "
                f"gradients' own dtype. Received: compression={compression!r}. Use backend='ring' to compress."
            )
        return SyncOptions(backend, compression, values["overlap"], values["profile"], name == "sharded")

    def check_fit(self, name: str, options, *, num_workers: int, batch_size: int, weighted: bool) -> None:
        if isinstance(options, fully_sharded.FullyShardedOptions):
            fully_sharded.check_fit(weighted=weighted)

    def refuses_callbacks(self, name: str, options) -> str | None:
        return fully_sharded.NO_CALLBACKS if isinstance(options, fully_sharded.FullyShardedOptions) else None

    def run(self, job: Job) -> ModeResult:
        if isinstance(job.options, fully_sharded.FullyShardedOptions):
            return fully_sharded.run(job)
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
        return whole_replicas.run_stage(job, lambda batches, reporter: run_sync_task(batches, reporter, task))
