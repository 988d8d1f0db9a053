"""The collectives: one rank per process in its host's namespace, told what to run over stdin, timed together."""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable

import numpy as np
from hostnet.network import Network
from hostnet.processes import die_with_parent

from netbench.common import hear, interface_bytes, role_processes, start_role, tell
from netbench.modes import Step, Steps

#: (operation, algorithm) of the one-rank-per-host sessions, in the order each size runs them.
FLAT = (
    ("allreduce", "ring"),
    ("allreduce", "naive"),
    ("allreduce", "tree"),
    ("reduce_scatter", "ring"),
    ("allgather", "ring"),
    ("allgather", "naive"),
    ("broadcast", "ring"),
    ("broadcast", "tree"),
)
#: ... and of the two-ranks-per-host session.
TWO_PER_HOST = (("allreduce", "hierarchical"), ("allreduce", "ring"), ("allreduce", "naive"))


def _arrays(operation: str, nbytes: int, size: int, rank: int) -> tuple[np.ndarray, np.ndarray | None]:
    count = nbytes // 4
    if operation == "allgather":
        part = count // size
        return np.full(part, rank + 1, np.float32), np.empty((size, part), np.float32)
    data = np.full(count, rank + 1, np.float32)
    if operation == "allreduce":
        return data, np.empty_like(data)
    if operation == "reduce_scatter":
        base, extra = divmod(count, size)
        return data, np.empty(base + (rank < extra), np.float32)
    return data, None


def _call(comm, operation: str, algorithm: str, data: np.ndarray, out: np.ndarray | None):
    if operation == "allreduce":
        return comm.allreduce(data, out=out, algorithm=algorithm)
    if operation == "reduce_scatter":
        return comm.reduce_scatter(data, out=out, algorithm=algorithm)
    if operation == "allgather":
        return comm.allgather(data, out=out, algorithm=algorithm)
    return comm.broadcast(data, root=0, algorithm=algorithm)


def _correct(operation: str, result: np.ndarray, size: int) -> bool:
    if operation in ("allreduce", "reduce_scatter"):
        return bool(np.all(result == size * (size + 1) / 2))
    if operation == "allgather":
        return bool(np.all(result == np.arange(1, size + 1, dtype=np.float32)[:, None]))
    return bool(np.all(result == 1))


def rank_main(host: str) -> None:
    """Listens on ``host``, reads its job (JSON) from stdin, runs it, one JSON line per item on stdout."""
    die_with_parent()
    from sparkdl.collective import Listener, SparkdlCommunicator

    listener = Listener(host)
    print(json.dumps({"address": listener.address}), flush=True)
    job = json.loads(sys.stdin.readline())
    rank = job["rank"]
    with SparkdlCommunicator.connect(
        rank,
        job["addresses"],
        listener,
        bytes.fromhex(job["secret"]),
        timeout=600.0,
        shared_memory=job["shared_memory"],
    ) as comm:
        size, steps, warmed, cached = comm.size, Steps(comm), set(), {}

        def prepare(operation: str, algorithm: str, nbytes: int) -> Step:
            if operation == "mode":
                return steps.prepare(algorithm, nbytes)
            data, out = _arrays(operation, nbytes, size, rank)
            if out is not None:
                out.fill(0)  # its pages mapped now, not in the first timed call

            def step() -> Callable[[], bool]:
                result = _call(comm, operation, algorithm, data, out)
                return lambda: _correct(operation, result, size)

            return step

        for index, (operation, algorithm, nbytes, repeats) in enumerate(job["plan"]):
            if (operation, algorithm) not in warmed:  # opens the links this algorithm uses (a star, a mesh)
                prepare(operation, algorithm, 4096 * size)()
                warmed.add((operation, algorithm))
            key = (operation, algorithm, nbytes)
            if key not in cached:
                cached.clear()  # one item's arrays at a time
                cached[key] = prepare(operation, algorithm, nbytes)
                if operation == "mode":
                    cached[key]()  # a mode's buffers (gossip's, for one) allocated before the clock runs
            step = cached[key]
            wire = interface_bytes()
            payload = comm.traffic()
            starts, ends, ok = [], [], True
            for repeat in range(repeats):
                comm.barrier()
                starts.append(time.clock_gettime(time.CLOCK_MONOTONIC))  # one clock for every namespace
                check = step()
                ends.append(time.clock_gettime(time.CLOCK_MONOTONIC))
                if repeat == 0:
                    ok = check()
            comm.barrier()  # every byte of the last call has left its sender's socket buffer
            received, sent = (after - before for after, before in zip(interface_bytes(), wire))
            moved = comm.traffic()
            payload_sent = sum(moved[p][0] - payload.get(p, (0, 0))[0] for p in moved)
            payload_received = sum(moved[p][1] - payload.get(p, (0, 0))[1] for p in moved)
            print(
                json.dumps(
                    {
                        "index": index,
                        "starts": starts,
                        "ends": ends,
                        "ok": ok,
                        "wire_sent": sent / repeats,
                        "wire_received": received / repeats,
                        "payload_sent": payload_sent / repeats,
                        "payload_received": payload_received / repeats,
                    }
                ),
                flush=True,
            )
    print(json.dumps({"done": True}), flush=True)


def session(network: Network, hosts_of_ranks: list[int], plan: list, shared_memory: bool, log) -> list[dict]:
    """Runs ``plan`` on one rank per entry of ``hosts_of_ranks`` (its host's index); one record per item."""
    with role_processes() as processes:
        processes += [start_role(network, host, "rank") for host in hosts_of_ranks]
        addresses = [hear(process, 60, f"rank {rank}")["address"] for rank, process in enumerate(processes)]
        secret = secrets.token_hex(32)
        for rank, process in enumerate(processes):
            tell(process, {"rank": rank, "addresses": addresses, "secret": secret, "shared_memory": shared_memory, "plan": plan})  # fmt: skip
        records = []
        for operation, algorithm, nbytes, repeats in plan:
            # The slowest case: naive allreduce of 256 MB on 4 ranks at 1 Gbit/s, about 13 s a call.
            budget = 120 + repeats * 8 * (2 * len(processes) * nbytes * 8 / 1e8)
            lines = [hear(process, budget, f"rank {rank}") for rank, process in enumerate(processes)]
            # From the first rank's start to the last rank's end: a rank that leaves the barrier late (by a one-way
            # latency) would otherwise not count the time the root's first message was on its way.
            starts = [min(per_rank) for per_rank in zip(*(line["starts"] for line in lines))]
            ends = [max(per_rank) for per_rank in zip(*(line["ends"] for line in lines))]
            times = [end - start for start, end in zip(starts, ends)]
            record = {
                "operation": operation,
                "algorithm": algorithm,
                "n": len(processes),
                "hosts": len(set(hosts_of_ranks)),
                "nbytes": nbytes,
                "times": times,
                "ok": all(line["ok"] for line in lines),
                "ranks": [{k: line[k] for k in line if k.startswith(("wire", "payload"))} for line in lines],
            }
            records.append(record)
            log(record)
        for rank, process in enumerate(processes):
            hear(process, 60, f"rank {rank}")
            process.wait(timeout=60)
        return records


def repeats_for(nbytes: int, repeats: int, large: int = 1) -> int:
    """Fewer calls for large arrays: all ``repeats`` to 4 MB, half to 32 MB, ``large`` above (256 MB at 1 Gbit/s:
    2-14 s a call)."""
    if nbytes <= 4 << 20:
        return repeats
    if nbytes <= 32 << 20:
        return max(1, repeats // 2, large)
    return large
