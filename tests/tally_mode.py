"""A mode registered by a test, as another package would register one: it declares an option and a layout.

``mode="tally"`` trains nothing: each task fingerprints the rows it was given (in order) and reports
them with its process id, to the driver and to ``tally_dir``; tasks of one shard must report the same
rows, and a task reading no shard none. ``copies`` tasks read each shard; what is left of ``num_workers``
reads nothing (``TallyPlan``). Its history holds, per epoch, the rows the shards held; it writes a checkpoint per epoch
through the checkpointer ``fit`` opened for it.
"""

import dataclasses
import hashlib
import json
import os

from sparkdl import launch
from sparkdl.keras import serialization
from sparkdl.launch.layout import Task, TaskLayout
from sparkdl.launch.task_context import current_task
from sparkdl.modes.base import Mode, ModeResult, Option, Plan

COPIES = Option("copies", "tasks that read each shard of the rows", default=1)
TALLY_DIR = Option("tally_dir", "where each task writes what it read", kind=str, required=True)


@dataclasses.dataclass(frozen=True)
class TallyPlan(Plan):
    copies: int
    tally_dir: str

    def layout(self, num_workers):
        copies = self.copies
        if num_workers < copies:
            raise ValueError(f"Expected num_workers >= copies. Received: num_workers={num_workers}, copies={copies}")
        shards = num_workers // copies
        return TaskLayout(
            tuple(
                Task(f"reader of shard {t // copies}", t // copies) if t < shards * copies else Task("bystander", None)
                for t in range(num_workers)
            )
        )

    def run(self, job):
        tally_dir = self.tally_dir
        reports = launch.run_tasks(
            job.training.frame,
            job.layout,
            lambda batches, reporter: tally(batches, tally_dir),
            barrier=True,
            timeout=job.settings.timeout,
        )
        tasks = [json.loads(bytes(reports[t])) for t in sorted(reports)]
        first_readers = [job.layout.readers(shard)[0] for shard in range(job.layout.shards)]
        rows = sum(tasks[t]["rows"] for t in first_readers)
        epochs = range(job.settings.initial_epoch, job.settings.epochs)
        model = serialization.model_from_bytes(job.start.model_bytes, job.settings.custom_objects)
        for epoch in epochs:
            if job.checkpointer is not None:
                job.checkpointer.record({"rows": float(rows)})
                job.checkpointer.save(epoch + 1, job.start.model_bytes)
        return ModeResult(model, {"rows": [float(rows)] * len(epochs)}, {"tasks": tasks}, job.settings.initial_epoch)


class TallyMode(Mode):
    names = ("tally",)

    def options(self, name):
        return (COPIES, TALLY_DIR)

    def configure(self, name, model, values):
        return TallyPlan(name, values["copies"], values["tally_dir"])


def tally(batches, tally_dir):
    digest, rows = hashlib.sha256(), 0
    for batch in batches:
        rows += batch.num_rows
        digest.update(json.dumps(batch.to_pylist()).encode())
    partition = current_task().partitionId()
    report = {"partition": partition, "pid": os.getpid(), "rows": rows, "fingerprint": digest.hexdigest()}
    with open(os.path.join(tally_dir, f"task-{partition}.json"), "w") as f:
        json.dump(report, f)
    return json.dumps(report).encode()
