"""Ranks of a sparkdl communicator as threads of the test process, over real 127.0.0.1 sockets; and their data."""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from sparkdl.collective import Listener, SparkdlCommunicator
from sparkdl.collective.transport.link import Link


def run_ranks(size, body, *, timeout=10.0, secrets_by_rank=None, capture=False, **connect):
    """``body(comm)`` on every rank of a job of ``size`` threads; their results by rank.

    ``connect`` goes to :meth:`SparkdlCommunicator.connect` (``shared_memory=False`` unless given). With
    ``capture``, a rank's exception is its result instead of being raised; otherwise the first rank to fail raises
    its exception (the cause: the others' are its consequences), noting every failed rank's error.
    """
    listeners = [Listener("127.0.0.1") for _ in range(size)]
    addresses = [listener.address for listener in listeners]
    secret = secrets.token_bytes(32)
    connect.setdefault("shared_memory", False)

    def rank_main(rank):
        rank_secret = secrets_by_rank[rank] if secrets_by_rank else secret
        try:
            with SparkdlCommunicator.connect(
                rank, addresses, listeners[rank], rank_secret, timeout=timeout, **connect
            ) as comm:
                assert (comm.rank, comm.size) == (rank, size)
                return body(comm)
        except Exception as exc:
            if capture:
                return exc
            failures.append((time.monotonic(), rank, exc))
            raise

    failures: list[tuple[float, int, Exception]] = []
    try:
        with ThreadPoolExecutor(max_workers=size) as pool:
            futures = [pool.submit(rank_main, rank) for rank in range(size)]
            wait(futures, timeout=120)
        if failures:
            _, _, first = min(failures, key=lambda failure: failure[0])
            for _, rank, exc in sorted(failures, key=lambda failure: failure[0]):
                first.add_note(f"rank {rank} failed: {type(exc).__name__}: {exc}")
            raise first
        return [future.result(timeout=0) for future in futures]
    finally:
        for listener in listeners:
            listener.close()


class SentFrames:
    """Records every frame any rank of this process sends: (rank, peer, header), both global ranks."""

    def __init__(self, monkeypatch):
        self.frames: list[tuple] = []
        self._lock = threading.Lock()
        send_frames = Link.send_frames  # every frame goes through it

        def recording_send(link, frames):
            with self._lock:
                self.frames.extend((link.rank, link.peer, header) for header, _ in frames)
            return send_frames(link, frames)

        monkeypatch.setattr(Link, "send_frames", recording_send)

    def edges(self, op: int, seq: int, group: int = 0) -> set[tuple[int, int]]:
        """(sender, receiver) of every frame of collective ``op`` call number ``seq`` of ``group``."""
        with self._lock:
            return {
                (rank, peer)
                for rank, peer, header in self.frames
                if header.op == op and header.seq == seq and header.group == group
            }


def rank_data(rank, shape, dtype, seed=0):
    """Small integer values of ``dtype``, so every sum is exact whatever the reduction order, and fits int8."""
    rng = np.random.default_rng(seed * 100 + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    low = 0 if dtype.kind in "ub" else -3
    values = rng.integers(low, 4, size=shape)
    if dtype.kind == "c":
        return (values + 1j * rng.integers(-3, 4, size=shape)).astype(dtype)
    return values.astype(dtype)
