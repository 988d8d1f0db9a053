"""Horovod inside Spark barrier tasks: its Gloo rendezvous and the environment ``hvd.init()`` reads.

Rank 0's task serves Horovod's rendezvous (its HTTP key-value store, given the
stage's slot plan) on its own address; the address reaches every task through
``BarrierTaskContext.allGather``; each task then sets the ``HOROVOD_*``
variables that ``hvd.init()`` reads, exactly as ``horovodrun`` would.

Horovod's own transports (the rendezvous over HTTP, Gloo over TCP) carry no
authentication; sparkdl binds the rendezvous to the task's address only and
serves it for the length of the job. Where that is not acceptable, use the
built-in ``backend="sparkdl"``, which authenticates every connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
from collections.abc import Iterator, Sequence

__all__ = ["Slot", "horovod_environment", "interface_of", "slot_plan"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One rank's place in the job, in Horovod's terms (fields as ``horovod.runner.common.util.hosts.SlotInfo``)."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def environment(self) -> dict[str, str]:
        return {
            "HOROVOD_HOSTNAME": self.hostname,
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }


def slot_plan(hosts: Sequence[str]) -> list[Slot]:
    """The slots of ranks 0..N-1 where rank i runs on ``hosts[i]`` (rank = partition index, hosts interleaved or not).

    local rank: index among the ranks on the same host; cross rank: index of
    the host among the hosts that have a rank with that local rank.
    """
    local_ranks: list[int] = []
    per_host: dict[str, int] = {}
    for host in hosts:
        local_ranks.append(per_host.get(host, 0))
        per_host[host] = local_ranks[-1] + 1
    host_order = list(dict.fromkeys(hosts))
    slots = []
    for rank, (host, local_rank) in enumerate(zip(hosts, local_ranks)):
        peers = [h for h in host_order if per_host[h] > local_rank]  # hosts with a rank at this local rank
        slots.append(Slot(host, rank, local_rank, peers.index(host), len(hosts), per_host[host], len(peers)))
    return slots


def interface_of(address: str) -> str:
    """The network interface holding ``address`` (Gloo binds to an interface by name)."""
    import psutil

    ip = socket.gethostbyname(address)
    for name, entries in psutil.net_if_addrs().items():
        if any(entry.address == ip for entry in entries):
            return name
    raise RuntimeError(
        f"No network interface holds {address} ({ip}); Horovod's Gloo needs one to bind to. "
        "Check spark.driver.host / SPARK_LOCAL_IP on the executors."
    )


@contextlib.contextmanager
def _rendezvous_server(host: str, slots: list[Slot]) -> Iterator[str]:
    """Horovod's rendezvous store, bound to ``host`` only, for the block's duration; yields "host:port"."""
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    server = RendezvousHTTPServer((host, 0), RendezvousHandler, 0)
    server.init([SlotInfo(**dataclasses.asdict(slot)) for slot in slots])
    thread = threading.Thread(target=server.serve_forever, name="sparkdl-horovod-rendezvous", daemon=True)
    thread.start()
    try:
        yield f"{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def horovod_environment(timeout: float) -> Iterator[Slot]:
    """Inside a barrier task: makes ``hvd.init()`` join this stage's job while the block runs.

    Shuts down whatever Horovod the block initialised (PySpark reuses its
    Python workers, and the next job has other peers) and restores the
    environment afterwards.
    """
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    hosts = [info.address.rsplit(":", 1)[0] for info in context.getTaskInfos()]
    slots = slot_plan(hosts)
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(_rendezvous_server(hosts[0], slots)) if rank == 0 else ""
        rendezvous = context.allGather(address)[0]
        rendezvous_host, port = rendezvous.rsplit(":", 1)
        environment = {
            **slots[rank].environment(),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_host,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": interface_of(hosts[rank]),
            "HOROVOD_GLOO_TIMEOUT_SECONDS": str(max(1, int(timeout))),
        }
        stack.enter_context(_environment(environment))
        stack.callback(_shutdown_initialised_horovod)
        yield slots[rank]


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _shutdown_initialised_horovod() -> None:
    import sys

    for name in ("horovod.tensorflow", "horovod.torch"):
        module = sys.modules.get(name)
        if module is not None and module.is_initialized():
            module.shutdown()
