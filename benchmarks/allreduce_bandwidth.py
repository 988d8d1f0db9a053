"""Allreduce bus bandwidth of each algorithm, side by side with raw TCP loopback, in one run.

Usage: python benchmarks/allreduce_bandwidth.py [--sizes 4K 64K 1M 16M 64M 256M] [--ranks 2 3 4]
       [--repeats 5] [--encrypt] [--before CHECKOUT]

Every rank is a separate process (multiprocessing 'spawn') on 127.0.0.1. For
each N and array size K it times, in this order and in one run:

- ``raw``: one TCP stream between two processes (sendall -> recv_into of K bytes), the link's ceiling;
- ``ring``: sparkdl's ring over TCP (shared memory off), every rank moving 2(N-1)K/N;
- ``naive``: gather to rank 0, reduce, send back over TCP: rank 0 moves 2(N-1)K;
- ``shm``: the default on one host: the ranks reduce through one shared-memory segment (hierarchical);
- ``sealed`` (``--encrypt``): the ring with every link sealed (AES-256-GCM), as when Spark encrypts RPC;
- ``before`` (``--before CHECKOUT``): that checkout's own benchmark, run now, for its ring (MB sizes only;
  a checkout from before the communicator, b368c37 or earlier, whose script takes ``--sizes-mb``).

Bus bandwidth is 2(N-1)/N * K / t (NCCL's convention: comparable with one link's
throughput whatever N is). Every variant writes into one preallocated output
(``out=``), as NCCL's benchmarks do, so that page faults of fresh arrays are not timed. Each time is the slowest rank's for one call; the
table shows the median of ``--repeats`` calls and, in brackets, the spread
(min-max) as the machine's noise. ``root MB`` is what rank 0 sent plus
received per call, measured on its links: the lectures' claim is that the
naive root's traffic grows with N while each ring rank's stays near 2K.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from netbench.common import UNITS, label, parse_size  # noqa: E402  (sizes as text, as the network benchmark's)

from sparkdl.collective import Listener, SparkdlCommunicator  # noqa: E402
from sparkdl.net.io import tune  # noqa: E402

#: (label, algorithm, shared memory, sealed)
VARIANTS = {
    "ring": ("ring", False, False),
    "naive": ("naive", False, False),
    "shm": ("hierarchical", True, False),
    "sealed": ("ring", False, True),
}


def _tuned_socket() -> socket.socket:
    """A TCP socket tuned as sparkdl's links are (``sparkdl.net.io.tune``), so the comparison is fair."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tune(sock)
    return sock


def _raw_receiver(port_queue, sizes: list[int], rounds: int) -> None:
    server = _tuned_socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    for nbytes in sizes:
        view = memoryview(bytearray(nbytes))
        for _ in range(rounds + 1):
            received = 0
            while received < nbytes:
                received += conn.recv_into(view[received:])
            conn.sendall(b"k")
    conn.close()
    server.close()


def raw_loopback(sizes: list[int], rounds: int) -> dict[int, list[float]]:
    """Seconds per K-byte transfer of one TCP stream between two processes, per size (first round a warm-up)."""
    ctx = mp.get_context("spawn")
    port_queue = ctx.Queue()
    receiver = ctx.Process(target=_raw_receiver, args=(port_queue, sizes, rounds))
    receiver.start()
    sock = _tuned_socket()
    sock.connect(("127.0.0.1", port_queue.get(timeout=60)))
    times: dict[int, list[float]] = {}
    for nbytes in sizes:
        payload = np.ones(nbytes, dtype=np.uint8)
        rounds_seen = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            sock.sendall(payload)
            sock.recv(1)
            rounds_seen.append(time.perf_counter() - start)
        times[nbytes] = rounds_seen[1:]
    sock.close()
    receiver.join()
    return times


def _rank(rank: int, size: int, address_queue, conn, sizes: list[int], repeats: int, variant: str) -> None:
    algorithm, shared_memory, encrypt = VARIANTS[variant]
    listener = Listener("127.0.0.1")
    address_queue.put((rank, listener.address))
    addresses, secret = conn.recv()
    with SparkdlCommunicator.connect(
        rank, addresses, listener, secret, timeout=120.0, encrypt=encrypt, shared_memory=shared_memory
    ) as comm:
        rng = np.random.default_rng(1234)
        check = [rng.standard_normal(UNITS["M"] // 4 + 3).astype(np.float32) for _ in range(size)]
        result = comm.allreduce(check[rank], algorithm=algorithm)
        verified = bool(np.allclose(result, np.sum(check, axis=0), rtol=1e-5, atol=1e-5))
        report = {}
        for nbytes in sizes:
            data = np.full(nbytes // 4, rank + 1, dtype=np.float32)
            result = np.empty_like(data)  # reused, as a training step reuses its buffers: no page faults timed
            times = []
            before = sum(sent + received for sent, received in comm.traffic().values())
            for _ in range(repeats + 1):  # the first call is a warm-up
                comm.barrier()
                start = time.perf_counter()
                comm.allreduce(data, algorithm=algorithm, out=result)
                times.append(time.perf_counter() - start)
            moved = sum(sent + received for sent, received in comm.traffic().values()) - before
            barriers = (repeats + 1) * 2 * len(comm.traffic())  # a barrier's 1-byte frames, at most
            verified = verified and bool(np.all(result == size * (size + 1) / 2))
            report[nbytes] = (times[1:], max(0, moved - barriers) / (repeats + 1))
        conn.send((verified, report))


def run_ranks(size: int, sizes: list[int], repeats: int, variant: str):
    """(verified, {size: (slowest rank's time per call, rank 0's bytes per call)}) of ``size`` rank processes."""
    ctx = mp.get_context("spawn")
    address_queue = ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(size)]
    procs = [
        ctx.Process(target=_rank, args=(r, size, address_queue, pipes[r][1], sizes, repeats, variant))
        for r in range(size)
    ]
    for proc in procs:
        proc.start()
    addresses = [""] * size
    for _ in range(size):
        rank, address = address_queue.get(timeout=120)
        addresses[rank] = address
    secret = secrets.token_bytes(32)
    for parent_end, _ in pipes:
        parent_end.send((addresses, secret))
    reports = [parent_end.recv() for parent_end, _ in pipes]
    for proc in procs:
        proc.join()
    slowest = {
        nbytes: [max(per_rank) for per_rank in zip(*(report[nbytes][0] for _, report in reports))] for nbytes in sizes
    }
    return all(ok for ok, _ in reports), {nbytes: (slowest[nbytes], reports[0][1][nbytes][1]) for nbytes in sizes}


def before_ring(checkout: str, size: int, sizes: list[int], repeats: int) -> dict[int, float]:
    """Bus bandwidth (bytes/s) of ``checkout``'s ring, from its own benchmark run now (whole-MB sizes only)."""
    megabytes = [nbytes // UNITS["M"] for nbytes in sizes if nbytes >= UNITS["M"] and nbytes % UNITS["M"] == 0]
    if not megabytes:
        return {}
    command = [sys.executable, "benchmarks/allreduce_bandwidth.py", "--ranks", str(size), "--repeats", str(repeats)]
    output = subprocess.run(
        [*command, "--sizes-mb", *map(str, megabytes)], cwd=checkout, capture_output=True, text=True, check=True
    ).stdout
    found = {}
    for line in output.splitlines():
        match = re.match(r"\s*(\d+)\s+(\d+) MB\s+[\d.]+\s+([\d.]+)", line)
        if match and int(match.group(1)) == size:
            found[int(match.group(2)) * UNITS["M"]] = float(match.group(3)) * 1e9
    return found


def _cell(times: list[float], traffic: float) -> tuple[float, str]:
    median = statistics.median(times)
    low, high = traffic / max(times) / 1e9, traffic / min(times) / 1e9
    return traffic / median, f"{traffic / median / 1e9:6.2f} [{low:.2f}-{high:.2f}]"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=parse_size, nargs="+", default=[parse_size(s) for s in "4K 64K 1M 16M 64M 256M".split()]
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--encrypt", action="store_true", help="also time the sealed ring")
    parser.add_argument("--before", metavar="CHECKOUT", help="also run this checkout's benchmark for its ring")
    args = parser.parse_args(argv)
    variants = ["ring", "naive", "shm"] + (["sealed"] if args.encrypt else [])

    raw = raw_loopback(args.sizes, rounds=max(3, args.repeats))
    print(f"machine: {os.cpu_count()} cores; bus bandwidth in GB/s, median [min-max] of {args.repeats} calls")
    header = f"{'N':>2} {'size':>5} {'raw TCP':>22}" + "".join(f" {name:>22}" for name in variants)
    header += (f" {'before':>7}" if args.before else "") + f" {'shm/raw':>8} {'shm/ring':>8}"
    header += f" {'root MB ring':>12} {'root MB naive':>13}  verified"
    print(header)
    for size in args.ranks:
        results = {name: run_ranks(size, args.sizes, args.repeats, name) for name in variants}
        before = before_ring(args.before, size, args.sizes, args.repeats) if args.before else {}
        for nbytes in args.sizes:
            traffic = 2 * (size - 1) / size * nbytes
            raw_bw, raw_text = _cell(raw[nbytes], nbytes)
            cells = {name: _cell(results[name][1][nbytes][0], traffic) for name in variants}
            line = f"{size:>2} {label(nbytes):>5} {raw_text:>22}" + "".join(f" {cells[n][1]:>22}" for n in variants)
            if args.before:
                line += f" {before[nbytes] / 1e9:>7.2f}" if nbytes in before else f" {'-':>7}"
            line += f" {cells['shm'][0] / raw_bw:>8.2f} {cells['shm'][0] / cells['ring'][0]:>8.2f}"
            root = {name: results[name][1][nbytes][1] / UNITS["M"] for name in ("ring", "naive")}
            line += f" {root['ring']:>12.1f} {root['naive']:>13.1f}"
            line += "  " + ("yes" if all(results[name][0] for name in variants) else "NO")
            print(line, flush=True)


if __name__ == "__main__":
    main()
