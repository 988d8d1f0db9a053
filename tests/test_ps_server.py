"""Parameter-server networking (sparkdl.ps): no Spark, no Keras, numpy shards on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from shards import LR, SGDShard

from sparkdl.collective import CollectiveError, CollectiveTimeout
from sparkdl.collective.transport import connect_authenticated, parse_address
from sparkdl.ps import client as client_module
from sparkdl.ps import protocol
from sparkdl.ps.client import ParameterClient
from sparkdl.ps.server import ParameterServer

HOST = "127.0.0.1"
SECRET = b"ps-test-secret"


class OverlapShard(SGDShard):
    """Records how often apply() ran while another apply() was still running."""

    def __init__(self, init):
        super().__init__(init)
        self._guard = threading.Lock()
        self.active = 0
        self.overlaps = 0
        self.calls = 0

    def apply(self, gradient):
        with self._guard:
            self.active += 1
            self.calls += 1
            if self.active > 1:
                self.overlaps += 1
        time.sleep(0.02)
        super().apply(gradient)
        with self._guard:
            self.active -= 1


def make_shards(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [SGDShard(rng.standard_normal(size)) for size in sizes]


def server(shards, mode="async", num_workers=2, **kwargs):
    return ParameterServer(shards, host=HOST, secret=SECRET, mode=mode, num_workers=num_workers, **kwargs)


def client(ps, worker, sizes, timeout=10.0, secret=SECRET, addresses=None):
    return ParameterClient(addresses or ps.addresses, worker=worker, secret=secret, shard_sizes=sizes, timeout=timeout)


def run_threads(fn, count):
    with ThreadPoolExecutor(count) as pool:
        return [f.result() for f in [pool.submit(fn, i) for i in range(count)]]


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# -- correctness ---------------------------------------------------------------------------


@pytest.mark.parametrize("threaded", [False, True], ids=["pipelined", "thread-per-shard"])
def test_pull_initial_then_concurrent_async_pushes_sum_up(threaded, monkeypatch):
    if threaded:  # the client's path for large shards
        monkeypatch.setattr(client_module, "THREADED_BYTES", 0)
    sizes = [7, 1000, 33]
    shards = make_shards(sizes)
    initial = [s.w.copy() for s in shards]
    workers, steps = 4, 10
    grads = {
        w: [
            [np.random.default_rng(100 * w + k).standard_normal(n).astype(np.float32) for n in sizes]
            for k in range(steps)
        ]
        for w in range(workers)
    }
    with server(shards, num_workers=workers) as ps:
        assert all(a.startswith(f"{HOST}:") for a in ps.addresses)
        with client(ps, 0, sizes) as c:
            for got, want in zip(c.pull(), initial):
                assert got.dtype == np.float32
                np.testing.assert_array_equal(got, want)

        def train(w):
            with client(ps, w, sizes) as c:
                for k in range(steps):
                    c.pull()
                    c.push(grads[w][k])
                c.done()

        run_threads(train, workers)
        with client(ps, 0, sizes) as c:
            final = c.pull()
            assert c.versions == [workers * steps] * len(sizes)
        stats = ps.stats()
    for i, (got, init) in enumerate(zip(final, initial)):
        total = sum(grads[w][k][i] for w in range(workers) for k in range(steps))
        np.testing.assert_allclose(got, init - LR * total, rtol=1e-5, atol=1e-5)
    assert stats["pushes"] == workers * steps
    assert stats["pulls"] == workers * steps + 2
    assert stats["versions"] == [workers * steps] * len(sizes)
    assert stats["clocks"] == [steps] * workers
    payload = 4 * sum(sizes)
    assert stats["bytes_in"] >= workers * steps * payload
    assert stats["bytes_out"] >= (workers * steps + 2) * payload


@pytest.mark.parametrize("mode", ["hogwild", "async"])
def test_hogwild_applies_concurrently_async_serialises(mode):
    shard = OverlapShard(np.zeros(64))
    workers, steps = 4, 3
    with server([shard], mode=mode, num_workers=workers) as ps:

        def train(w):
            with client(ps, w, [64]) as c:
                for _ in range(steps):
                    c.push([np.ones(64, np.float32)])

        run_threads(train, workers)
    assert shard.calls == workers * steps
    if mode == "hogwild":
        assert shard.overlaps > 0
    else:
        assert shard.overlaps == 0
        np.testing.assert_allclose(shard.w, -LR * workers * steps)


@pytest.mark.parametrize("mode", ["ssp", "async"])
def test_ssp_bounds_staleness_with_a_slow_worker(mode):
    sizes = [10, 3]
    steps, slow_delay = 6, 0.12
    with server(make_shards(sizes), mode=mode, num_workers=3, max_staleness=1) as ps:

        def train(w):
            with client(ps, w, sizes) as c:
                for _ in range(steps):
                    c.pull()
                    if w == 2:
                        time.sleep(slow_delay)
                    c.push([np.ones(n, np.float32) for n in sizes])
                c.done()

        run_threads(train, 3)
        stats = ps.stats()
    assert stats["clocks"] == [steps] * 3
    if mode == "ssp":
        # every granted pull was at most one push ahead of the slow worker: the fast ones were held back
        assert stats["max_staleness"] <= 1
    else:
        assert stats["max_staleness"] > 1


def test_ssp_done_releases_waiting_worker():
    sizes = [4]
    with server(make_shards(sizes), mode="ssp", num_workers=2, max_staleness=0, timeout=10) as ps:
        with client(ps, 0, sizes) as fast, client(ps, 1, sizes) as slow:
            fast.pull()
            fast.push([np.ones(4, np.float32)])
            result = []
            waiter = threading.Thread(target=lambda: result.append(fast.pull()))
            waiter.start()
            time.sleep(0.3)
            assert waiter.is_alive(), "pull ahead of the slowest worker was not held back"
            slow.done()
            waiter.join(5)
            assert not waiter.is_alive() and len(result) == 1
            for _ in range(3):  # worker 1 is done: worker 0 runs freely now
                fast.pull()
                fast.push([np.ones(4, np.float32)])
        assert ps.stats()["max_staleness"] == 0


def test_ssp_pull_times_out_when_a_worker_never_comes():
    sizes = [4]
    with server(make_shards(sizes), mode="ssp", num_workers=2, max_staleness=0, timeout=1.0) as ps:
        with client(ps, 0, sizes, timeout=10) as c:
            c.pull()
            c.push([np.ones(4, np.float32)])
            with pytest.raises(CollectiveTimeout) as info:
                c.pull()
    message = str(info.value)
    # The server's staleness gate gave up after its timeout=1.0 and said so (not the client's 10 s socket timeout).
    assert "refused under mode='ssp'" in message
    assert "worker 0" in message and ps.addresses[0] in message
    assert "max_staleness=0" in message and "timeout" in message


# -- retries, bad peers --------------------------------------------------------------------


def raw_connect(ps, shard, worker=1, secret=SECRET, timeout=5.0):
    sock = connect_authenticated(ps.addresses[shard], worker, shard, secret, timeout)
    sock.settimeout(timeout)
    return sock


def drain_until_closed(sock, timeout=5.0):
    """Half-close, then read until the server closes its end."""
    sock.settimeout(timeout)
    try:
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass
    except OSError:  # reset, or not connected any more
        pass
    finally:
        sock.close()


def test_retried_worker_continues_after_vanishing_mid_frame():
    sizes = [50, 20]
    shards = make_shards(sizes)
    initial = [s.w.copy() for s in shards]
    g = [np.full(n, k + 1, np.float32) for k, n in enumerate(sizes)]
    with server(shards, mode="ssp", num_workers=2, max_staleness=5) as ps:
        first = client(ps, 0, sizes)
        first.pull()
        first.push(g)
        first.push(g)
        # the task dies while sending its third push: half a frame, then the sockets vanish
        for shard, n in enumerate(sizes):
            sock = raw_connect(ps, shard, worker=0)
            sock.sendall(protocol.pack_request(protocol.Msg.PUSH, 1, 4 * n) + b"\x00" * (2 * n))
            sock.close()
        first.close()
        wait_for(lambda: ps.stats()["protocol_errors"] >= 2)
        assert ps.stats()["clocks"] == [2, 0]
        with client(ps, 0, sizes) as retry:  # Spark's retry: same worker id
            for got, init, grad in zip(retry.pull(), initial, g):
                np.testing.assert_allclose(got, init - 2 * LR * grad, rtol=1e-6)
            retry.push(g)
            assert retry.versions == [3, 3]
        stats = ps.stats()
    assert stats["clocks"] == [3, 0]
    assert stats["versions"] == [3, 3]


def test_wrong_secret_wrong_worker_and_swapped_shards_are_refused():
    sizes = [8, 8]
    with server(make_shards(sizes), num_workers=2) as ps:
        with pytest.raises(CollectiveTimeout, match="secret") as info:
            client(ps, 0, sizes, secret=b"not the secret", timeout=0.5)
        assert "worker 0" in str(info.value)
        refused = ps.stats()["refused_connections"]
        assert refused >= 1
        with pytest.raises(CollectiveTimeout):
            client(ps, 2, sizes, timeout=0.5)  # worker id outside 0..num_workers-1
        with pytest.raises(CollectiveTimeout):
            client(ps, 0, sizes, timeout=0.5, addresses=ps.addresses[::-1])
        assert ps.stats()["refused_connections"] > refused
        with client(ps, 1, sizes) as c:
            assert [len(w) for w in c.pull()] == sizes


def test_silent_and_unauthenticated_clients_do_not_block_others():
    sizes = [16]
    shards = make_shards(sizes)
    # Silent connections are never dropped for their silence during this test (an hour's handshake deadline): the
    # worker gets through within its own timeout only because no one waits on them.
    with server(shards, num_workers=2, handshake_timeout=3600.0) as ps:
        host, port = parse_address(ps.addresses[0])
        silent = [socket.create_connection((host, port), timeout=5) for _ in range(5)]
        stuck = raw_connect(ps, 0)  # authenticated, then stops mid-frame
        stuck.sendall(protocol.pack_request(protocol.Msg.PUSH, 1, 64)[:10])
        try:
            with client(ps, 0, sizes, timeout=10.0) as c:
                np.testing.assert_array_equal(c.pull()[0], shards[0].w)
                c.push([np.ones(16, np.float32)])
        finally:
            for sock in silent + [stuck]:
                sock.close()


def test_wrong_shard_sizes_give_clear_errors():
    with server(make_shards([5]), num_workers=1) as ps:
        with client(ps, 0, [6]) as c:
            with pytest.raises(CollectiveError, match="shard_sizes"):
                c.pull()
        with client(ps, 0, [6]) as c:
            with pytest.raises(CollectiveError, match="shard_sizes"):
                c.push([np.ones(6, np.float32)])
        with client(ps, 0, [5]) as c:
            with pytest.raises(ValueError):
                c.push([np.ones(4, np.float32)])
            assert len(c.pull()[0]) == 5


def test_stop_releases_ports_and_a_second_server_works():
    threads_before = threading.active_count()
    sizes = [3, 4]
    ps = server(make_shards(sizes), num_workers=1)
    addresses = ps.start()
    c = client(ps, 0, sizes)
    c.pull()
    silent = socket.create_connection(parse_address(addresses[0]), timeout=5)
    ps.stop()
    ps.stop()  # idempotent
    with pytest.raises(CollectiveError):
        c.pull()
    c.close()
    silent.close()
    wait_for(lambda: threading.active_count() <= threads_before)
    for address in addresses:
        host, port = parse_address(address)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, port), timeout=2).close()
        probe = socket.socket()
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))  # fails if the listener were still open
        probe.listen(1)
        probe.close()
    with server(make_shards(sizes, seed=1), num_workers=1) as again:
        with client(again, 0, sizes) as c2:
            c2.push([np.ones(3, np.float32), np.ones(4, np.float32)])
            assert again.stats()["versions"] == [1, 1]
    with pytest.raises(ValueError, match="interface"):
        ParameterServer(make_shards([1]), host="0.0.0.0", secret=SECRET, mode="async", num_workers=1)


# -- fuzzing -------------------------------------------------------------------------------

_SIZES = [5, 16]
_TYPES = st.one_of(st.sampled_from([int(m) for m in protocol.Msg]), st.integers(0, 255))
_LENGTHS = st.one_of(
    st.sampled_from(
        [0, 1, 4 * _SIZES[0], 4 * _SIZES[1], 4 * _SIZES[1] - 1, 4 * _SIZES[1] + 1, 2**31, 2**63, 2**64 - 1]
    ),
    st.integers(0, 2**64 - 1),
)
_FRAME = st.one_of(
    st.tuples(  # anything goes
        st.one_of(st.just(protocol.REQUEST_MAGIC), st.binary(min_size=4, max_size=4)),
        _TYPES,
        st.integers(0, 255),
        st.integers(0, 3),
        st.integers(0, 2**32 - 1),
        _LENGTHS,
        st.binary(max_size=120),
    ),
    st.tuples(  # a well-formed push header that lies about its length, with enough bytes after it
        st.just(protocol.REQUEST_MAGIC),
        st.just(int(protocol.Msg.PUSH)),
        st.just(0),
        st.just(0),
        st.integers(0, 2**32 - 1),
        _LENGTHS,
        st.binary(min_size=4 * max(_SIZES) + 8, max_size=120),
    ),
)


def _encode(frame, shard_size):
    magic, msg, reserved1, reserved2, seq, length, payload = frame
    header = protocol.REQUEST.pack(magic, msg, reserved1, reserved2, seq, length)
    complete_push = (
        magic == protocol.REQUEST_MAGIC
        and msg == protocol.Msg.PUSH
        and not reserved1
        and not reserved2
        and length == 4 * shard_size
    )
    if complete_push:  # garbage must never be a valid push: cut it short
        payload = payload[: length - 1]
    return header + payload


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@example(data=None)
def _fuzz_once(ps, initial, data):
    if data is None:  # explicit oversized frame on an authenticated connection
        authenticated, shard, blobs = (
            True,
            1,
            [protocol.REQUEST.pack(protocol.REQUEST_MAGIC, protocol.Msg.PUSH, 0, 0, 1, 2**63)],
        )
    else:
        authenticated = data.draw(st.booleans(), "authenticated")
        shard = data.draw(st.integers(0, 1), "shard")
        blobs = data.draw(
            st.lists(
                st.one_of(
                    st.binary(max_size=200),
                    _FRAME.map(lambda f: _encode(f, _SIZES[shard])),
                    _FRAME.map(lambda f: _encode(f, _SIZES[shard])[: data.draw(st.integers(0, 40))]),
                ),
                min_size=1,
                max_size=3,
            ),
            "blobs",
        )
    # One connection per blob: concatenated, a push cut short could be completed by the next blob's bytes.
    for blob in blobs:
        if authenticated:
            sock = raw_connect(ps, shard, worker=1)
        else:
            sock = socket.create_connection(parse_address(ps.addresses[shard]), timeout=5)
        try:
            sock.sendall(blob)
        except OSError:
            pass  # the server may already have closed on the first bad bytes
        drain_until_closed(sock)
    with client(ps, 0, _SIZES, timeout=5) as c:
        for got, want in zip(c.pull(), initial):
            np.testing.assert_array_equal(got, want)
    assert ps.stats()["versions"] == [0, 0]


def test_fuzzed_garbage_never_disturbs_the_server():
    shards = make_shards(_SIZES)
    initial = [s.w.copy() for s in shards]
    with server(shards, num_workers=2) as ps:
        _fuzz_once(ps, initial)
        stats = ps.stats()
    assert stats["refused_connections"] > 0 and stats["protocol_errors"] > 0
    for shard, want in zip(shards, initial):
        np.testing.assert_array_equal(shard.w, want)
