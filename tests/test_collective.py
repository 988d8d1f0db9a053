"""Tests for sparkdl.collective: correctness against numpy, security, failure handling.

Ranks normally run as threads of this process over real 127.0.0.1 sockets;
a few tests use subprocesses to cover separate processes and a dying peer.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sparkdl.collective import CollectiveError, CollectiveTimeout, Listener, RingCommunicator, ring, transport
from sparkdl.collective.transport import Op, PeerLink, connect_peer
from sparkdl.net.secure import PlainChannel

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_ring(size, body, timeout=10.0, secrets_by_rank=None):
    """Run ``body(comm)`` on every rank of a ring of threads; return results by rank."""
    listeners = [Listener("127.0.0.1") for _ in range(size)]
    addresses = [listener.address for listener in listeners]
    secret = secrets.token_bytes(32)

    def rank_main(rank):
        rank_secret = secrets_by_rank[rank] if secrets_by_rank else secret
        with RingCommunicator.connect(rank, addresses, listeners[rank], rank_secret, timeout=timeout) as comm:
            assert (comm.rank, comm.size) == (rank, size)
            return body(comm)

    with ThreadPoolExecutor(max_workers=size) as pool:
        futures = [pool.submit(rank_main, rank) for rank in range(size)]
        return [future.result(timeout=60) for future in futures]


def rank_data(rank, shape, dtype, seed=0):
    """Integer-valued data, so float sums are exact whatever the reduction order."""
    rng = np.random.default_rng(seed * 100 + rank)
    return rng.integers(-1000, 1000, size=shape).astype(dtype)


SHAPES = [(1,), (2,), (7,), (3, 5, 2), (100_000,)]
DTYPES = [np.float32, np.float64, np.int64]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_collectives_match_numpy(size):
    cases = [(shape, dtype) for shape in SHAPES for dtype in DTYPES]

    def body(comm):
        outputs = []
        for index, (shape, dtype) in enumerate(cases):
            x = rank_data(comm.rank, shape, dtype, seed=index)
            before = x.copy()
            outputs.append(
                (
                    comm.allreduce(x),
                    comm.allreduce(x, average=True),
                    comm.allgather(x),
                    [comm.broadcast(x, root=root) for root in range(size)],
                )
            )
            np.testing.assert_array_equal(x, before)  # input untouched
        return outputs

    results = run_ring(size, body)
    for index, (shape, dtype) in enumerate(cases):
        inputs = [rank_data(rank, shape, dtype, seed=index) for rank in range(size)]
        total = np.sum(inputs, axis=0)
        mean = total // size if np.issubdtype(dtype, np.integer) else total / size
        for rank in range(size):
            summed, averaged, gathered, broadcasts = results[rank][index]
            for got, want in [(summed, total), (averaged, mean), (gathered, np.stack(inputs))]:
                assert got.dtype == np.dtype(dtype) and got.shape == want.shape
                np.testing.assert_array_equal(got, want)
            for root, got in enumerate(broadcasts):
                assert got.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(got, inputs[root])


def test_random_floats_and_other_dtypes():
    shapes_dtypes = [
        ((4, 33), np.float32),
        ((10,), np.float16),
        ((6,), np.int32),
        ((5,), np.uint8),
        ((9,), np.complex64),
    ]

    def body(comm):
        rng = np.random.default_rng(comm.rank)
        floats = rng.standard_normal((257, 3))
        others = [np.asarray(rank_data(comm.rank, s, np.int64) % 7, dtype=d) for s, d in shapes_dtypes]
        return comm.allreduce(floats), [comm.allreduce(x) for x in others]

    results = run_ring(3, body)
    floats = [np.random.default_rng(rank).standard_normal((257, 3)) for rank in range(3)]
    for summed, others in results:
        np.testing.assert_allclose(summed, np.sum(floats, axis=0), rtol=1e-12, atol=1e-12)
        for (shape, dtype), got in zip(shapes_dtypes, others):
            inputs = [np.asarray(rank_data(rank, shape, np.int64) % 7, dtype=dtype) for rank in range(3)]
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, np.sum(inputs, axis=0, dtype=dtype))


def test_many_segments_per_chunk(monkeypatch):
    """Tiny segments force the pipelined path (many frames per ring step)."""
    monkeypatch.setattr(ring, "SEGMENT_BYTES", 64)

    def body(comm):
        x = rank_data(comm.rank, (1001,), np.float64)
        return comm.allreduce(x), comm.allgather(x), comm.broadcast(x, root=2)

    inputs = [rank_data(rank, (1001,), np.float64) for rank in range(4)]
    for summed, gathered, broadcast in run_ring(4, body):
        np.testing.assert_array_equal(summed, np.sum(inputs, axis=0))
        np.testing.assert_array_equal(gathered, np.stack(inputs))
        np.testing.assert_array_equal(broadcast, inputs[2])


@pytest.mark.parametrize("count, parts", [(0, 3), (1, 4), (7, 3), (10, 5), (100_003, 4)])
def test_chunks_are_sized_like_array_split(count, parts):
    bounds = ring._chunk_bounds(count, parts)
    sizes = [len(chunk) for chunk in np.array_split(np.arange(count), parts)]
    assert np.diff(bounds).tolist() == sizes and bounds[0] == 0 and bounds[-1] == count


def test_non_contiguous_and_scalar_inputs():
    def body(comm):
        matrix = np.arange(24, dtype=np.float64).reshape(4, 6) + comm.rank
        return (
            comm.allreduce(matrix[:, ::2]),
            comm.allreduce(np.float32(comm.rank)),
            comm.allgather(np.int64(comm.rank)),
        )

    for strided, scalar, gathered in run_ring(3, body):
        want = sum(np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2] + r for r in range(3))
        np.testing.assert_array_equal(strided, want)
        assert scalar.shape == () and scalar == 3
        np.testing.assert_array_equal(gathered, [0, 1, 2])


def test_single_rank_needs_no_sockets():
    with Listener() as listener:
        comm = RingCommunicator.connect(0, [listener.address], listener, b"secret")
        x = np.arange(5, dtype=np.float32)
        for result in (comm.allreduce(x), comm.allreduce(x, average=True), comm.broadcast(x)):
            np.testing.assert_array_equal(result, x)
            assert result is not x
        np.testing.assert_array_equal(comm.allgather(x), x[None])
        comm.barrier()
        comm.close()


def test_barrier_waits_for_slowest_rank():
    arrived = threading.Event()

    def body(comm):
        if comm.rank == 1:
            time.sleep(0.3)
            arrived.set()
        comm.barrier()
        return arrived.is_set()  # no rank leaves the barrier before rank 1 has reached it

    assert run_ring(3, body) == [True, True, True]


def test_repeated_mixed_ops_stay_in_sync():
    def body(comm):
        log = {}
        for i in range(30):
            x = np.full(i % 7, comm.rank + i, dtype=np.int64)
            kind = i % 4
            if kind == 0:
                log[i] = comm.allreduce(x)
            elif kind == 1:
                log[i] = comm.allgather(x)
            elif kind == 2:
                log[i] = comm.broadcast(x, root=i % comm.size)
            else:
                comm.barrier()
        return log

    size = 4
    for log in run_ring(size, body):
        for i, got in log.items():
            inputs = [np.full(i % 7, rank + i, dtype=np.int64) for rank in range(size)]
            want = [np.sum(inputs, axis=0), np.stack(inputs), inputs[i % size]][i % 4]
            np.testing.assert_array_equal(got, want)


def test_mismatched_collectives_raise_desync():
    def body(comm):
        try:
            if comm.rank == 0:
                comm.allreduce(np.zeros(10, dtype=np.float32))
            else:
                comm.allreduce(np.zeros(10, dtype=np.float64))
        except CollectiveError as exc:
            return exc
        return None

    errors = run_ring(2, body, timeout=5.0)
    assert all(isinstance(e, CollectiveError) for e in errors)
    assert any("desync" in str(e) for e in errors)


# --- separate processes -------------------------------------------------------

WORKER = r"""
import json, os, sys, time
import numpy as np
from sparkdl.collective import Listener, RingCommunicator
listener = Listener("127.0.0.1")
print(listener.address, flush=True)
job = json.loads(sys.stdin.readline())
rank, size = job["rank"], len(job["addresses"])
comm = RingCommunicator.connect(rank, job["addresses"], listener, bytes.fromhex(job["secret"]), timeout=10)
if job["mode"] == "die":
    time.sleep(0.3)
    os._exit(1)
x = np.arange(50_000, dtype=np.float64) * (rank + 1)
np.save(job["out"], np.stack([comm.allreduce(x), comm.allgather(x)[size - 1], comm.broadcast(x, root=1)]))
comm.barrier()
comm.close()
"""


def start_workers(ranks):
    """Start one subprocess per rank; return (processes, their listener addresses)."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {
        rank: subprocess.Popen(
            [sys.executable, "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO_ROOT,
        )
        for rank in ranks
    }
    return procs, {rank: proc.stdout.readline().strip() for rank, proc in procs.items()}


def send_job(proc, rank, addresses, secret, mode, tmp_path):
    job = {
        "rank": rank,
        "addresses": addresses,
        "secret": secret.hex(),
        "mode": mode,
        "out": str(tmp_path / f"rank{rank}.npy"),
    }
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()


def test_ranks_as_separate_processes(tmp_path):
    secret = secrets.token_bytes(32)
    procs, addresses = start_workers(range(3))
    ordered = [addresses[rank] for rank in range(3)]
    for rank, proc in procs.items():
        send_job(proc, rank, ordered, secret, "run", tmp_path)
    for proc in procs.values():
        assert proc.wait(timeout=30) == 0
    x = np.arange(50_000, dtype=np.float64)
    for rank in range(3):
        summed, last_row, broadcast = np.load(tmp_path / f"rank{rank}.npy")
        np.testing.assert_array_equal(summed, 6 * x)
        np.testing.assert_array_equal(last_row, 3 * x)
        np.testing.assert_array_equal(broadcast, 2 * x)


def test_peer_process_dying_mid_collective_fails_survivors(tmp_path):
    """Rank 2 dies while ranks 0 and 1 are inside allreduce: they must fail fast, not hang."""
    secret = secrets.token_bytes(32)
    procs, worker_addresses = start_workers([2])
    listeners = [Listener(), Listener()]
    addresses = [listeners[0].address, listeners[1].address, worker_addresses[2]]
    send_job(procs[2], 2, addresses, secret, "die", tmp_path)

    def survivor(rank):
        comm = RingCommunicator.connect(rank, addresses, listeners[rank], secret, timeout=20)
        try:
            comm.allreduce(np.ones(1_000_000, dtype=np.float32))
        except CollectiveError as exc:
            return exc
        finally:
            comm.close()
        return None

    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(survivor, [0, 1]))
    assert procs[2].wait(timeout=10) == 1
    for error in outcomes:
        # Failed because the peer's connection broke, not by waiting out the 20 s timeout.
        assert isinstance(error, CollectiveError) and not isinstance(error, CollectiveTimeout), error


# --- failures and timeouts ----------------------------------------------------------


def test_silent_peer_times_out_with_descriptive_message():
    timed_out = threading.Event()

    def body(comm):
        if comm.rank == 1:
            # Never joins the collective, and keeps its links open until rank 0 has timed out: a close racing
            # the timeout would end rank 0's wait as "closed the connection" instead.
            assert timed_out.wait(30)
            return None
        try:
            with pytest.raises(CollectiveTimeout) as info:
                comm.allreduce(np.ones(3))
        finally:
            timed_out.set()
        with pytest.raises(CollectiveError, match="already failed"):
            comm.allreduce(np.ones(3))
        return str(info.value)

    message = run_ring(2, body, timeout=0.5)[0]
    for part in ("rank 0", "rank 1", "allreduce", "0.5"):
        assert part in message


def test_closed_peer_fails_collective():
    def body(comm):
        if comm.rank == 2:
            return None  # leaves the ring (closes its links) without participating
        with pytest.raises(CollectiveError):
            comm.allreduce(np.ones(10))
        return True

    assert run_ring(3, body, timeout=5.0)[:2] == [True, True]


# --- authentication -----------------------------------------------------------


def accept_in_background(listener, rank, peer, secret, timeout):
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(listener.accept_peer, rank, peer, secret, timeout)
    pool.shutdown(wait=False)
    return future


def check_link(server_link, client_link):
    client_link.send(Op.BARRIER, 7, np.arange(3, dtype=np.int64))
    out = np.empty(3, dtype=np.int64)
    server_link.recv_into(Op.BARRIER, 7, out)
    np.testing.assert_array_equal(out, [0, 1, 2])


def test_wrong_secret_refused_then_real_peer_connects():
    secret = secrets.token_bytes(32)
    with Listener() as listener:
        accepted = accept_in_background(listener, 1, 0, secret, timeout=5.0)
        with pytest.raises(CollectiveTimeout, match="rank 0: could not connect to rank 1"):
            connect_peer(listener.address, 0, 1, b"wrong secret", timeout=0.5)
        assert not accepted.done()
        client = connect_peer(listener.address, 0, 1, secret, timeout=5.0)
        server = accepted.result(timeout=5)
        assert (server.rank, server.peer) == (1, 0)
        check_link(server, client)
        client.close()
        server.close()


def test_client_refuses_server_that_cannot_prove_the_secret():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    stop = threading.Event()

    def fake_server():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                conn.sendall(b"SDLA" + os.urandom(32))
                conn.recv(68)
                conn.sendall(os.urandom(32))  # a forged proof

    thread = threading.Thread(target=fake_server, daemon=True)
    thread.start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    with pytest.raises(CollectiveTimeout, match="rank 1 failed to prove it knows the job secret"):
        connect_peer(address, 0, 1, b"secret", timeout=0.5)
    stop.set()
    thread.join(timeout=5)
    server.close()


def test_garbage_and_silent_peers_do_not_block_real_peer():
    secret = secrets.token_bytes(32)
    # The silent and short connections are never dropped for their silence during this test (an hour's deadline):
    # the real peer gets through within its timeout only because no one waits on them.
    with Listener(handshake_timeout=3600.0) as listener:
        accepted = accept_in_background(listener, 1, 0, secret, timeout=10.0)
        host, port = transport.parse_address(listener.address)
        silent = socket.create_connection((host, port))
        garbage = socket.create_connection((host, port))
        garbage.sendall(os.urandom(68))  # a full-length, but forged, client hello
        short = socket.create_connection((host, port))
        short.sendall(os.urandom(10))
        client = connect_peer(listener.address, 0, 1, secret, timeout=10.0)
        server = accepted.result(timeout=30)
        check_link(server, client)
        garbage.settimeout(10)
        garbage.recv(100)  # the server hello
        assert garbage.recv(100) == b""  # then dropped
        for sock in (silent, garbage, short, client, server):
            sock.close()


def test_peer_with_valid_secret_but_wrong_rank_is_refused():
    secret = secrets.token_bytes(32)
    with Listener() as listener:
        accepted = accept_in_background(listener, 1, 0, secret, timeout=5.0)
        with pytest.raises(CollectiveTimeout):
            connect_peer(listener.address, 2, 1, secret, timeout=0.5)
        client = connect_peer(listener.address, 0, 1, secret, timeout=5.0)
        check_link(accepted.result(timeout=5), client)


def test_only_impostors_end_in_timeout_not_hang():
    with Listener() as listener:
        accepted = accept_in_background(listener, 1, 0, b"real", timeout=1.0)
        silent = socket.create_connection(transport.parse_address(listener.address))
        # accept_peer's own 1 s timeout ends the wait (its message), long before the 30 s result() would.
        with pytest.raises(CollectiveTimeout, match="rank 1: no authenticated connection from rank 0"):
            accepted.result(timeout=30)
        silent.close()


def test_ring_with_mismatched_secrets_fails_within_timeout():
    # run_ring waits 60 s for a rank: the ring's own 1 s timeout must be what ends it, naming the secret.
    with pytest.raises(CollectiveTimeout, match="same job secret"):
        run_ring(2, lambda comm: None, timeout=1.0, secrets_by_rank=[b"one", b"two"])


# --- framing ----------------------------------------------------------------------


@pytest.fixture
def link_pair():
    a, b = socket.socketpair()
    sender, receiver = PeerLink(PlainChannel(a), 0, 1, timeout=1.0), PeerLink(PlainChannel(b), 1, 0, timeout=0.2)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize(
    "sent, op, seq, expected",
    [
        (np.zeros(4, np.float32), Op.ALLREDUCE, 3, np.empty(5, np.float32)),  # wrong size
        (np.zeros(4, np.int32), Op.ALLREDUCE, 3, np.empty(4, np.float32)),  # wrong dtype
        (np.zeros(4, np.float32), Op.ALLGATHER, 3, np.empty(4, np.float32)),  # wrong op
        (np.zeros(4, np.float32), Op.ALLREDUCE, 4, np.empty(4, np.float32)),  # wrong sequence
    ],
)
def test_frame_mismatch_is_desync(link_pair, sent, op, seq, expected):
    sender, receiver = link_pair
    sender.send(op, seq, sent)
    with pytest.raises(CollectiveError, match="desync"):
        receiver.recv_into(Op.ALLREDUCE, 3, expected)


def test_matching_frame_round_trips(link_pair):
    sender, receiver = link_pair
    data = np.arange(6, dtype=np.complex128)
    sender.send(Op.ALLREDUCE, 3, data)
    out = np.empty(6, dtype=np.complex128)
    receiver.recv_into(Op.ALLREDUCE, 3, out)
    np.testing.assert_array_equal(out, data)


def test_garbage_frame_is_rejected(link_pair):
    sender, receiver = link_pair
    sender._sock.sendall(os.urandom(64))
    with pytest.raises(CollectiveError, match="corrupt frame"):
        receiver.recv_into(Op.ALLREDUCE, 0, np.empty(4, np.float32))


def test_recv_timeout_and_closed_peer(link_pair):
    sender, receiver = link_pair
    with pytest.raises(CollectiveTimeout, match=r"rank 1: allreduce timed out after 0.2s .*rank 0"):
        receiver.recv_into(Op.ALLREDUCE, 0, np.empty(4, np.float32))
    sender.close()
    with pytest.raises(CollectiveError, match="closed the connection"):
        receiver.recv_into(Op.ALLREDUCE, 0, np.empty(4, np.float32))


def test_unsupported_dtype_rejected_before_sending():
    listener = Listener()
    with RingCommunicator.connect(0, [listener.address], listener, b"s") as comm:
        with pytest.raises(TypeError):
            comm.allreduce(np.array(["a"]))
        with pytest.raises(TypeError):
            comm.allreduce(np.zeros(3, dtype=">f4"))
