"""The stage of ``server_placement="executors"``: its workers and server tasks, and the rendezvous where they meet.

The stage holds ``num_workers`` workers (task ``r`` reads shard ``r`` of the rows, as in the driver
placement) and ``num_servers`` server tasks (task ``num_workers + k`` serves shard ``k`` and reads no
rows: ``layout``). Barrier scheduling starts them together, so the servers run while the workers
train, on as many executors as Spark spreads them over: the servers' network links and cores add up
with the machines instead of all sharing the driver's.

The tasks meet twice at the stage's rendezvous on the driver's relay (``sparkdl.launch.rendezvous``,
the one sync mode's ring uses; :func:`meet`):

1. **the start**: server 0 names the checkpoint training starts from by its place (epoch, steps into
   the next), the driver's (``Job.start``) or, when Spark retried the stage after a lost task, the
   newest checkpoint the driver wrote meanwhile; every server loads that one and every worker trains
   from its epoch, each at the step the servers say it stood (:func:`start_place`);
2. **the addresses**: each server, listening by now, gives its shard's address, and the workers connect
   to them (:func:`server_addresses`).

Every record is a small JSON object (a string at the rendezvous, never unpickled), checked here.
"""

from __future__ import annotations

import io
import json
import typing

import numpy as np

from sparkdl.launch import rendezvous
from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.layout import Task, TaskLayout

#: The progress event a server task sends once it listens: ``{"event": SERVER_EVENT, "shard", "address", "task"}``
#: (the driver reads the shards' state there for its checkpoints).
SERVER_EVENT = "server"


def layout(num_workers: int, num_servers: int) -> TaskLayout:
    """``num_workers`` workers, each reading a shard of the rows of its own, then ``num_servers`` servers reading none."""
    workers = tuple(Task("worker", rank) for rank in range(num_workers))
    return TaskLayout(workers + tuple(Task(f"server {k}", None) for k in range(num_servers)))


def optimizer_payload(shard: int) -> str:
    """The name under which the driver offers shard ``shard``'s optimizer state to start from (a resumed fit's)."""
    return f"optimizer {shard}"


def arrays_to_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """Named arrays as ``.npz`` bytes (read back with ``allow_pickle=False``)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub reads **arrays as its options
    return buffer.getvalue()


def arrays_from_bytes(data: bytes | bytearray) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def meet(reporter: TaskReporter, record: dict, timeout: float) -> list[dict]:
    """Inside a task of the stage: ``record`` in, every task's record out (by partition), once every task sent one."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    answers = rendezvous.join(reporter, context.partitionId(), context.taskAttemptId(), json.dumps(record), timeout)
    records = [json.loads(answer) for answer in answers]
    if not all(isinstance(r, dict) for r in records):
        raise ConnectionError(f"The stage's rendezvous answered records that are not objects: {answers!r}")
    return records


def start_place(records: list[dict], num_workers: int) -> tuple[int, int]:
    """The place (``Checkpoint.place``: epoch, steps into the next) of the checkpoint server 0 (task
    ``num_workers``) says training starts from."""
    record = records[num_workers] if len(records) > num_workers else {}
    place = (record.get("epoch"), record.get("steps"))
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in place):
        raise ConnectionError(f"Server 0 named no checkpoint to start from at the stage's rendezvous: {records!r}")
    return typing.cast(tuple[int, int], place)


def server_addresses(records: list[dict], num_workers: int) -> list[str]:
    """Each server's shard address (``host:port``), by shard."""
    addresses = [record.get("address") for record in records[num_workers:]]
    if not addresses or not all(isinstance(a, str) and a.rsplit(":", 1)[-1].isdigit() for a in addresses):
        raise ConnectionError(f"The server tasks gave no addresses at the stage's rendezvous: {records!r}")
    return [str(address) for address in addresses]
