"""Parameter-server throughput: pushes/s and push payload MB/s on loopback.

Usage: python benchmarks/ps_throughput.py [--params 20000 4000000] [--shards 1 2 4]
                                          [--workers 1 2 4] [--seconds 2.5] [--encrypt]
                                          [--compression bf16|fp16]

One ParameterServer (mode "async", numpy SGD shards: ``w -= lr * g``) runs in
this process; client workers are separate processes (multiprocessing
'spawn', started once and reused for every configuration).  Every worker loops
pull + push (its gradient is fixed random data) for ``--seconds`` after one
warm-up step.  "pushes/s" is the sum over workers of pushes / own elapsed time,
"push MB/s" the gradient payload those pushes carried (float32, or half-width
with ``--compression``, narrowed once by each worker before it starts; pulls move
the float32 weights back, not counted), "ms/step" the mean pull+push time of one
worker. All traffic stays on 127.0.0.1.  ``--encrypt`` also times each row with
sealed connections (what runs when Spark's ``spark.network.crypto.enabled`` is on),
right after the plain one, and prints the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparkdl.collective import compression as compressions  # noqa: E402
from sparkdl.ps.client import ParameterClient  # noqa: E402
from sparkdl.ps.server import ParameterServer  # noqa: E402

MB = 1e6


class SGDShard:
    def __init__(self, size: int, lr: float = 1e-3):
        self.w = np.random.default_rng(size).standard_normal(size).astype(np.float32)
        self.size = size
        self.lr = np.float32(lr)

    def read(self) -> np.ndarray:
        return self.w.copy()

    def apply(self, gradient: np.ndarray) -> None:
        if gradient.dtype != np.float32:  # a compressed push, widened here
            gradient = compressions.widen(gradient)
        gradient *= self.lr  # the server's receive buffer is ours during the call
        self.w -= gradient


def _worker(commands: mp.Queue, results: mp.Queue, go) -> None:
    while True:
        job = commands.get()
        if job is None:
            return
        addresses, sizes, worker, secret, seconds, encrypt, compression = job
        rng = np.random.default_rng(worker)
        gradients = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        if compression is not None:
            gradients = [compressions.narrow(g, compression) for g in gradients]
        with ParameterClient(
            addresses,
            worker=worker,
            secret=secret,
            shard_sizes=sizes,
            timeout=60,
            encrypt=encrypt,
            compression=compression,
        ) as client:
            client.pull()
            client.push(gradients)
            results.put(("ready", worker))
            go.wait()
            start = time.perf_counter()
            count = 0
            while time.perf_counter() - start < seconds:
                client.pull()
                client.push(gradients)
                count += 1
            elapsed = time.perf_counter() - start
            client.done()
        results.put(("result", count, elapsed))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, nargs="+", default=[20_000, 4_000_000])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=2.5)
    parser.add_argument("--encrypt", action="store_true", help="also time sealed connections")
    parser.add_argument("--compression", choices=compressions.NAMES, help="push half-width gradients")
    args = parser.parse_args(argv)

    ctx = mp.get_context("spawn")
    commands, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    pool = [ctx.Process(target=_worker, args=(commands, results, go), daemon=True) for _ in range(max(args.workers))]
    for process in pool:
        process.start()
    secret = secrets.token_bytes(32)
    print(
        f"parameter server throughput, mode=async, numpy SGD shards, {os.cpu_count()} cores, "
        f"{args.seconds}s per row, workers = separate processes, pushes as {args.compression or 'float32'}"
    )
    sealed = " sealed pushes/s | vs plain |" if args.encrypt else ""
    print(f"| params | shards | workers | pushes/s | push MB/s | ms/step |{sealed}")
    print("|---|---|---|---|---|---|" + ("---|---|" if args.encrypt else ""))
    started = time.perf_counter()

    def measure(sizes: list[int], workers: int, encrypt: bool) -> tuple[float, float]:
        """(pushes/s over all workers, mean ms per pull + push) of one server and ``workers`` clients."""
        ps = ParameterServer(
            [SGDShard(n) for n in sizes],
            host="127.0.0.1",
            secret=secret,
            mode="async",
            num_workers=workers,
            timeout=60,
            encrypt=encrypt,
            compression=args.compression,
        )
        with ps:
            go.clear()
            for w in range(workers):
                commands.put((ps.addresses, sizes, w, secret, args.seconds, encrypt, args.compression))
            for _ in range(workers):
                assert results.get(timeout=120)[0] == "ready"
            go.set()
            outcomes = [results.get(timeout=120) for _ in range(workers)]
        rate = sum(count / elapsed for _, count, elapsed in outcomes)
        return rate, 1e3 * float(np.mean([elapsed / max(count, 1) for _, count, elapsed in outcomes]))

    try:
        for params in args.params:
            for shards in args.shards:
                sizes = [len(part) for part in np.array_split(np.arange(params), shards)]
                for workers in args.workers:
                    rate, step_ms = measure(sizes, workers, encrypt=False)
                    push_bytes = (2 if args.compression else 4) * params
                    row = f"| {params:,} | {shards} | {workers} | {rate:,.0f} | {rate * push_bytes / MB:,.0f} | {step_ms:.2f} |"
                    if args.encrypt:
                        sealed_rate, _ = measure(sizes, workers, encrypt=True)
                        row += f" {sealed_rate:,.0f} | {sealed_rate / rate:.2f}x |"
                    print(row, flush=True)
    finally:
        for _ in pool:
            commands.put(None)
        for process in pool:
            process.join(10)
    print(f"total {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
