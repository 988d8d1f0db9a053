"""The training modes' communication, one step each, on sparkdl's own parts: its communicator, gossip, parameter server.

A mode's step here is what its workers exchange per training step, without the model's compute (the
cost model predicts the communication, which a step's compute adds to or hides), with the calls the
mode itself makes:

- ``zero1`` (``mode="sharded"``): the gradients reduce-scattered, then the updated shards all-gathered;
- ``zero3`` (``shard_weights=True``) on :data:`ZERO3_UNITS` units: each unit's weights all-gathered before
  its forward and again before its backward (but the last unit's), each unit's gradient reduce-scattered;
- ``gossip`` (``mode="gossip"``, ring peers): one round of :class:`sparkdl.modes.gossip.exchange.Gossip`,
  this rank's weights to its neighbours and theirs back;
- ``pipeline`` (``mode="pipeline"``, one micro-batch): stage 0's activation passed stage to stage over the
  two alternating streams the pipeline engine uses, and the gradient passed back.

Those run inside :func:`netbench.collectives.rank_main`'s ranks. The parameter server's run here in
processes of their own (:func:`server_main`, :func:`worker_main`, :func:`ps_session`): each worker a
:class:`sparkdl.ps.client.ParameterClient` pushing K of gradients and pulling K of weights per step,
the servers :class:`sparkdl.ps.server.ParameterServer` with plain-SGD shards, placed as :data:`PS_LAYOUTS`
says: all on one more host (the driver's, ``mode="async"``, one shard or four; ``mode="sync_ps"``), or one
shard per worker's host (``server_placement="executors"``, the lectures' "multiple parameter servers").
Asynchronous workers are measured in two arrangements (:data:`IN_PHASE`, :data:`OUT_OF_PHASE`); ``sync_ps``
has one, as its round waits for every push before any pull.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable

import numpy as np
from hostnet.network import Network
from hostnet.processes import die_with_parent

from netbench.common import hear, interface_bytes, messages, role_processes, start_role, tell

#: The modes run on the communicator, in the order each size runs them.
COMMUNICATOR_MODES = ("zero1", "zero3", "gossip", "pipeline")
ZERO3_UNITS = 4
TIMEOUT = 600.0
#: A step: runs one, returns the check of its result (true where right), run after the clock stops.
Step = Callable[[], Callable[[], bool]]
#: How asynchronous workers' steps line up, each measured: all push, then all pull (as they start); or the odd ones
#: pulling while the even ones push. A driver-hosted server's link is busy both ways only out of phase; servers beside
#: the workers only in phase (out of phase, a host's pushes and its neighbours' pulls take one direction at a time).
#: Training's compute spreads the workers somewhere between; a record's time is the faster arrangement, the steady
#: state the model predicts (every link busy both ways), and the record keeps both.
IN_PHASE, OUT_OF_PHASE = "in phase", "out of phase"
LR = np.float32(0.1)
GRADIENT = np.float32(1e-3)


class Steps:
    """One rank's mode steps on ``comm``; the streams gossip and the pipeline split from it are made once."""

    def __init__(self, comm):
        self.comm = comm
        self._gossiping = None
        self._stage_streams = None
        self._round = 0

    def prepare(self, pattern: str, nbytes: int) -> Step:
        """The step of ``pattern`` on a model (or, for the pipeline, an activation) of ``nbytes``: each call runs one
        and returns the check of what arrived (run after the clock stops)."""
        return getattr(self, f"_step_{pattern}")(nbytes)

    def _equal_parts(self, nbytes: int) -> int:
        size = self.comm.size
        return max(1, nbytes // 4 // size) * size

    def _step_zero1(self, nbytes: int) -> Step:
        comm, count = self.comm, self._equal_parts(nbytes)
        gradient = np.full(count, comm.rank + 1, np.float32)
        shard = np.empty(count // comm.size, np.float32)
        weights = np.empty((comm.size, count // comm.size), np.float32)
        total = comm.size * (comm.size + 1) / 2

        def step() -> Callable[[], bool]:
            comm.reduce_scatter(gradient, out=shard)
            comm.allgather(shard, out=weights)
            return lambda: bool(np.all(weights == total))

        return step

    def _step_zero3(self, nbytes: int) -> Step:
        comm, count = self.comm, self._equal_parts(nbytes // ZERO3_UNITS)
        part = count // comm.size
        shards = [np.full(part, comm.rank + 1, np.float32) for _ in range(ZERO3_UNITS)]
        gradients = [np.full(count, comm.rank + 1, np.float32) for _ in range(ZERO3_UNITS)]
        gathered = np.empty((comm.size, part), np.float32)
        reduced = np.empty(part, np.float32)
        total = comm.size * (comm.size + 1) / 2

        def step() -> Callable[[], bool]:
            for unit in range(ZERO3_UNITS):  # forward: every unit's weights
                comm.allgather(shards[unit], out=gathered)
            for unit in reversed(range(ZERO3_UNITS)):  # backward: again, but the last unit's, kept
                if unit < ZERO3_UNITS - 1:
                    comm.allgather(shards[unit], out=gathered)
                comm.reduce_scatter(gradients[unit], out=reduced)
            return lambda: (
                bool(np.all(reduced == total)) and bool(np.all(gathered[:, 0] == np.arange(1, comm.size + 1)))
            )

        return step

    def _step_gossip(self, nbytes: int) -> Step:
        from sparkdl.modes.gossip.exchange import Gossip
        from sparkdl.modes.gossip.peers import neighbours

        comm = self.comm
        if self._gossiping is None:
            self._gossiping = Gossip(comm, "ring", seed=0, timeout=TIMEOUT)
        gossip = self._gossiping
        weights = np.full(nbytes // 4, comm.rank + 1, np.float32)

        def step() -> Callable[[], bool]:
            number, self._round = self._round, self._round + 1
            gossip.start(weights, number)
            correction = gossip.finish()
            mine = neighbours("ring", comm.rank, comm.size, seed=0, round=number)
            expected = sum(np.float32(n.weight) * np.float32(n.rank - comm.rank) for n in mine)
            return lambda: bool(np.allclose(correction, expected))

        return step

    def _step_pipeline(self, nbytes: int) -> Step:
        comm = self.comm
        if self._stage_streams is None:
            self._stage_streams = [comm.split(range(comm.size)), comm.split(range(comm.size))]
        stage, last = comm.rank, comm.size - 1
        upstream, downstream = self._stage_streams[(stage - 1) % 2], self._stage_streams[stage % 2]  # as the engine's
        activation = np.full(nbytes // 4, 1.0, np.float32)  # stage 0's; the others' arrives here
        gradient = np.empty_like(activation)

        def step() -> Callable[[], bool]:
            if stage > 0:
                upstream.recv_async(stage - 1, tag=0, out=activation).wait(TIMEOUT)
            if stage < last:
                downstream.send_async(activation, stage + 1, tag=0).wait(TIMEOUT)
                downstream.recv_async(stage + 1, tag=1, out=gradient).wait(TIMEOUT)
            else:
                gradient[:] = activation
            if stage > 0:
                upstream.send_async(gradient, stage - 1, tag=1).wait(TIMEOUT)
            return lambda: bool(np.all(gradient == 1.0))

        return step


# -- the parameter server, placed on hosts ----------------------------------------------------------------

#: ``name -> (server mode, shards per server host, servers on the workers' hosts)``: what ``ps_session`` builds.
PS_LAYOUTS = {
    "driver": ("async", 1, False),
    "driver, 4 shards": ("async", 4, False),
    "sync_ps": ("sync_ps", 1, False),
    "spread": ("async", 1, True),
}


class SGDShard:
    """w -= lr * g on a float32 vector that starts at zero."""

    def __init__(self, size: int):
        self.w = np.zeros(size, np.float32)
        self.size = size

    def read(self) -> np.ndarray:
        return self.w.copy()

    def apply(self, gradient: np.ndarray) -> None:
        self.w -= LR * gradient


def split_sizes(count: int, parts: int) -> list[int]:
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


def server_main(host: str) -> None:
    """Serves one size after another: a JSON line of shard sizes in, the addresses out; "stop" in, the counts out."""
    die_with_parent()
    from sparkdl.ps.rules import Immediate, SyncRounds
    from sparkdl.ps.server import ParameterServer

    job = json.loads(sys.stdin.readline())
    rule = SyncRounds() if job["mode"] == "sync_ps" else Immediate()
    for item in messages():
        shards = [SGDShard(size) for size in item["sizes"]]
        with ParameterServer(
            shards,
            host=host,
            secret=bytes.fromhex(job["secret"]),
            rule=rule,
            num_workers=job["num_workers"],
            timeout=TIMEOUT,
            first_shard=job["first_shard"],
        ) as server:
            print(json.dumps({"addresses": server.addresses}), flush=True)
            sys.stdin.readline()  # every worker is done with this size
            stats = server.stats()
        print(json.dumps({"versions": stats["versions"], "pushes": stats["pushes"]}), flush=True)


def worker_main(host: str) -> None:
    """One worker: per size of the parent's, :func:`worker_steps`."""
    die_with_parent()
    job = json.loads(sys.stdin.readline())
    for item in messages():
        worker_steps(job, item)


def worker_steps(job: dict, item: dict) -> None:
    """Connects and warms up with one step; then per arrangement of ``item["phases"]``, on "go", runs ``repeats``
    steps (a push and a pull each), timed, and prints its figures as a JSON line."""
    from sparkdl.ps.client import ParameterClient

    sync = job["mode"] == "sync_ps"
    sizes, repeats = item["shard_sizes"], item["repeats"]
    gradients = [np.full(size, GRADIENT, np.float32) for size in sizes]
    weights = [np.empty(size, np.float32) for size in sizes]
    with ParameterClient(
        item["addresses"],
        worker=job["worker"],
        secret=bytes.fromhex(job["secret"]),
        shard_sizes=sizes,
        timeout=TIMEOUT,
        separate_servers=job["separate"],
    ) as client:

        def push(step: int) -> None:  # sync_ps numbers its rounds and weighs each push by its rows
            if sync:
                client.push(gradients, step=step, rows=1)
            else:
                client.push(gradients)

        if sync:
            client.join(1, job["num_workers"])
        client.pull(weights)
        push(0)  # the links open and the buffers mapped before the clock runs
        client.pull(weights)
        print(json.dumps({"ready": True}), flush=True)
        steps = 1
        for phase in item["phases"]:
            sys.stdin.readline()
            wire = interface_bytes()
            start = time.clock_gettime(time.CLOCK_MONOTONIC)
            pull_first = phase == OUT_OF_PHASE and job["worker"] % 2 == 1
            if pull_first:
                client.pull(weights)
            for repeat in range(repeats):
                push(steps + repeat)
                if not pull_first or repeat < repeats - 1:
                    client.pull(weights)
            end = time.clock_gettime(time.CLOCK_MONOTONIC)
            steps += repeats
            received, sent = (after - before for after, before in zip(interface_bytes(), wire))
            # sync_ps: every round applied the mean once, so every worker pulls the same weights
            ok = all(np.all(np.isfinite(w)) for w in weights) and (
                not sync or all(np.allclose(w, -LR * GRADIENT * steps, rtol=1e-3) for w in weights)
            )
            line = {"start": start, "end": end, "ok": bool(ok), "wire_sent": sent, "wire_received": received}
            print(json.dumps(line), flush=True)
        client.done()
    print(json.dumps({"finished": True}), flush=True)  # the servers may stop now


def ps_session(network: Network, n: int, layout: str, plan: list, log) -> list[dict]:
    """The parameter server laid out as ``layout`` for ``n`` workers on hosts 0..n-1 (the driver's: host n); for each
    ``(nbytes, repeats)`` of ``plan``, every worker's steps timed together. One record per item."""
    mode, shards_per_host, spread = PS_LAYOUTS[layout]
    server_hosts = list(range(n)) if spread else [n]
    secret = secrets.token_hex(32)
    with role_processes() as processes:
        servers = [start_role(network, host, "ps-server") for host in server_hosts]
        workers = [start_role(network, rank, "ps-worker") for rank in range(n)]
        processes += servers + workers
        for index, server in enumerate(servers):
            tell(server, {"secret": secret, "mode": mode, "num_workers": n, "first_shard": index})
        for rank, worker in enumerate(workers):
            tell(worker, {"secret": secret, "mode": mode, "num_workers": n, "worker": rank, "separate": spread})
        records = []
        for nbytes, repeats in plan:
            budget = 120 + repeats * 8 * (2 * n * nbytes * 8 / 1e8)
            sizes = split_sizes(nbytes // 4, len(servers) * shards_per_host)
            per_server = [sizes[i * shards_per_host : (i + 1) * shards_per_host] for i in range(len(servers))]
            for server, its_sizes in zip(servers, per_server):
                tell(server, {"sizes": its_sizes})
            addresses = [a for server in servers for a in hear(server, 60, "a server")["addresses"]]
            phases = (IN_PHASE,) if mode == "sync_ps" else (IN_PHASE, OUT_OF_PHASE)
            for worker in workers:
                tell(worker, {"addresses": addresses, "shard_sizes": sizes, "repeats": repeats, "phases": phases})
            for rank, worker in enumerate(workers):
                hear(worker, budget, f"worker {rank}")
            rounds, ok, ranks = {}, True, []
            for phase in phases:
                for worker in workers:
                    tell(worker, {"go": phase})
                lines = [hear(worker, budget, f"worker {rank}") for rank, worker in enumerate(workers)]
                start, end = min(line["start"] for line in lines), max(line["end"] for line in lines)
                rounds[phase] = (end - start) / repeats  # a round: every worker one step
                ok = ok and all(line["ok"] for line in lines)
                ranks = [{k: line[k] / repeats for k in line if k.startswith("wire")} for line in lines]
            for rank, worker in enumerate(workers):
                hear(worker, 60, f"worker {rank}")  # finished: its DONE answered, its connections closed
            for server in servers:
                tell(server, {"stop": True})
            counts = [hear(server, 60, "a server") for server in servers]
            updates = [v for count in counts for v in count["versions"]]
            expected_updates = (1 + repeats * len(phases)) * (1 if mode == "sync_ps" else n)
            record = {
                "operation": "ps",
                "algorithm": layout,
                "n": n,
                "hosts": n,
                "nbytes": nbytes,
                "times": [min(rounds.values())],  # the arrangement that keeps the links busier: see PHASES
                "phases": rounds,
                "ok": ok and updates == [expected_updates] * len(updates),
                "ranks": ranks,  # of the last arrangement
                "server_hosts": len(server_hosts),
                "servers": len(sizes),
            }
            records.append(record)
            log(record)
        for process in processes:
            tell(process, {"done": True})
        for process in processes:
            process.wait(timeout=60)
        return records
