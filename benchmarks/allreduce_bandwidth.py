"""Ring allreduce bus bandwidth versus raw single-stream TCP loopback throughput.

Usage: python benchmarks/allreduce_bandwidth.py [--sizes-mb 1 16 64] [--ranks 2 3 4] [--repeats 5] [--encrypt]

Every rank is a separate process (multiprocessing 'spawn'); listener addresses
are exchanged through multiprocessing queues/pipes.  Bus bandwidth is
2(N-1)/N * K / t, the per-rank traffic of the ring algorithm, so it is
directly comparable with the throughput of one TCP stream.  All traffic stays
on 127.0.0.1.  ``--encrypt`` also times the sealed ring (what runs when Spark's
``spark.network.crypto.enabled`` is on) and prints its bus bandwidth beside the plain one.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparkdl.collective import Listener, RingCommunicator  # noqa: E402
from sparkdl.collective.transport import SOCKET_BUFFER_BYTES  # noqa: E402

MB = 1 << 20


def _tuned_socket() -> socket.socket:
    """A socket configured like the communicator's, so the comparison is fair."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _raw_receiver(port_queue: mp.Queue, nbytes: int, rounds: int) -> None:
    server = _tuned_socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    view = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        received = 0
        while received < nbytes:
            received += conn.recv_into(view[received:])
        conn.sendall(b"k")
    conn.close()
    server.close()


def raw_loopback_throughput(nbytes: int, rounds: int) -> float:
    """Bytes/s of one TCP stream between two processes (sendall -> recv_into), median round."""
    ctx = mp.get_context("spawn")
    port_queue = ctx.Queue()
    receiver = ctx.Process(target=_raw_receiver, args=(port_queue, nbytes, rounds + 1))
    receiver.start()
    sock = _tuned_socket()
    sock.connect(("127.0.0.1", port_queue.get(timeout=60)))
    payload = np.ones(nbytes, dtype=np.uint8)
    times = []
    for _ in range(rounds + 1):  # first round is a warm-up
        start = time.perf_counter()
        sock.sendall(payload)
        sock.recv(1)
        times.append(time.perf_counter() - start)
    sock.close()
    receiver.join()
    return nbytes / statistics.median(times[1:])


def _raw_ring_rank(rank: int, size: int, address_queue: mp.Queue, conn, sizes: list[int], repeats: int) -> None:
    """Move the ring allreduce's per-rank traffic over plain sockets, with no reduction.

    Each rank streams 2(N-1)/N * K bytes to rank+1 while receiving as much from
    rank-1: the most any ring allreduce can achieve with N processes on this machine.
    """
    server = _tuned_socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    address_queue.put((rank, server.getsockname()[1]))
    ports = conn.recv()
    to_next = _tuned_socket()
    to_next.connect(("127.0.0.1", ports[(rank + 1) % size]))
    from_prev, _ = server.accept()
    results = {}
    for nbytes in sizes:
        traffic = 2 * (size - 1) * nbytes // size
        payload = np.ones(traffic, dtype=np.uint8)
        view = memoryview(bytearray(traffic))
        start = 0.0
        for round_index in range(repeats + 1):  # back to back, so start-up skew is amortised
            if round_index == 1:
                start = time.perf_counter()
            sender = threading.Thread(target=to_next.sendall, args=(payload,))
            sender.start()
            received = 0
            while received < traffic:
                received += from_prev.recv_into(view[received:])
            sender.join()
        results[nbytes] = [(time.perf_counter() - start) / repeats]  # mean round time
    conn.send((True, results))
    for sock in (to_next, from_prev, server):
        sock.close()


def _allreduce_rank(rank: int, size: int, address_queue: mp.Queue, conn, sizes: list[int], repeats: int) -> None:
    listener = Listener("127.0.0.1")
    address_queue.put((rank, listener.address))
    addresses, secret, encrypt = conn.recv()
    with RingCommunicator.connect(rank, addresses, listener, secret, timeout=60.0, encrypt=encrypt) as comm:
        rng = np.random.default_rng(1234)
        check = [rng.standard_normal(MB // 4 + 3).astype(np.float32) for _ in range(size)]
        verified = np.allclose(comm.allreduce(check[rank]), np.sum(check, axis=0), rtol=1e-5, atol=1e-5)
        results = {}
        for nbytes in sizes:
            data = np.full(nbytes // 4, rank + 1, dtype=np.float32)
            expected = size * (size + 1) / 2
            times = []
            for _ in range(repeats + 1):  # first call is a warm-up
                comm.barrier()
                start = time.perf_counter()
                result = comm.allreduce(data)
                times.append(time.perf_counter() - start)
            verified = verified and bool(np.all(result == expected))
            results[nbytes] = times[1:]
        conn.send((verified, results))


def run_ring(target, size: int, sizes: list[int], repeats: int, encrypt: bool = False) -> tuple[bool, dict[int, float]]:
    """Run ``target`` on ``size`` rank processes; median over repeats of the slowest rank's time."""
    ctx = mp.get_context("spawn")
    address_queue = ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(size)]
    procs = [
        ctx.Process(target=target, args=(r, size, address_queue, pipes[r][1], sizes, repeats)) for r in range(size)
    ]
    for proc in procs:
        proc.start()
    addresses = [None] * size
    for _ in range(size):
        rank, address = address_queue.get(timeout=120)
        addresses[rank] = address
    secret = secrets.token_bytes(32)
    for parent_end, _ in pipes:
        parent_end.send((addresses, secret, encrypt) if target is _allreduce_rank else addresses)
    reports = [parent_end.recv() for parent_end, _ in pipes]
    for proc in procs:
        proc.join()
    verified = all(ok for ok, _ in reports)
    medians = {
        nbytes: statistics.median(max(per_rank) for per_rank in zip(*(r[nbytes] for _, r in reports)))
        for nbytes in sizes
    }
    return verified, medians


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--encrypt", action="store_true", help="also time the sealed (AEAD) ring")
    args = parser.parse_args(argv)
    sizes = [mb * MB for mb in args.sizes_mb]

    raw = raw_loopback_throughput(64 * MB, rounds=2 * args.repeats)
    print(f"raw TCP loopback, one stream, 64 MB sendall -> recv_into: {raw / 1e9:.2f} GB/s")
    print("ceiling = the same per-rank traffic over plain sockets in a ring of N processes, no reduction")
    print("(the 1 MB ceiling is dominated by thread start-up and scheduling noise)")
    print(
        f"{'N':>2} {'size':>7} {'time ms':>9} {'busbw GB/s':>11} {'vs raw':>7} "
        f"{'ceiling GB/s':>13} {'vs ceiling':>11}  verified"
        + (f" {'sealed GB/s':>12} {'vs plain':>9}  verified" if args.encrypt else "")
    )
    for size in args.ranks:
        _, ceilings = run_ring(_raw_ring_rank, size, sizes, args.repeats)
        verified, medians = run_ring(_allreduce_rank, size, sizes, args.repeats)
        if args.encrypt:
            sealed_verified, sealed = run_ring(_allreduce_rank, size, sizes, args.repeats, encrypt=True)
        for nbytes in sizes:
            traffic = 2 * (size - 1) / size * nbytes
            busbw, ceiling = traffic / medians[nbytes], traffic / ceilings[nbytes]
            print(
                f"{size:>2} {nbytes // MB:>4} MB {medians[nbytes] * 1e3:>9.1f} {busbw / 1e9:>11.2f} "
                f"{busbw / raw:>7.0%} {ceiling / 1e9:>13.2f} {busbw / ceiling:>11.0%}  "
                f"{'yes' if verified else 'NO'}"
                + (
                    f" {traffic / sealed[nbytes] / 1e9:>12.2f} {medians[nbytes] / sealed[nbytes]:>9.0%}  "
                    f"{'yes' if sealed_verified else 'NO'}"
                    if args.encrypt
                    else ""
                )
            )


if __name__ == "__main__":
    main()
