"""Parameter-server networking (sparkdl.ps): no Spark, no Keras, numpy shards on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from attackers import ps_request, ps_response, recv_exactly
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ps_servers import HOST, SECRET, client, server
from shards import LR, SGDShard, make_shards

from sparkdl.net.auth import connect_authenticated
from sparkdl.net.errors import CollectiveError, CollectiveTimeout
from sparkdl.net.frames import HEADER, MAGIC, VERSION, Header, Kind, dtype_code
from sparkdl.net.io import parse_address
from sparkdl.net.listener import ServingListener
from sparkdl.ps import client as client_module
from sparkdl.ps import protocol
from sparkdl.ps.client import ParameterClient
from sparkdl.ps.rules import BoundedStaleness, Hogwild, Immediate
from sparkdl.ps.server import ParameterServer


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


@pytest.mark.parametrize("rule", [Hogwild(), Immediate()])
def test_hogwild_applies_concurrently_async_serialises(rule):
    shard = OverlapShard(np.zeros(64))
    workers, steps = 4, 3
    with server([shard], rule=rule, num_workers=workers) as ps:

        def train(w):
            with client(ps, w, [64]) as c:
                for _ in range(steps):
                    c.push([np.ones(64, np.float32)])

        run_threads(train, workers)
    assert shard.calls == workers * steps
    if rule == Hogwild():
        assert shard.overlaps > 0
    else:
        assert shard.overlaps == 0
        np.testing.assert_allclose(shard.w, -LR * workers * steps)


@pytest.mark.parametrize("rule", [BoundedStaleness(1), Immediate()])
def test_ssp_bounds_staleness_with_a_slow_worker(rule):
    sizes = [10, 3]
    steps, slow_delay = 6, 0.12
    with server(make_shards(sizes), rule=rule, num_workers=3) as ps:

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
    if rule == BoundedStaleness(1):
        # every granted pull was at most one push ahead of the slow worker: the fast ones were held back
        assert stats["max_staleness"] <= 1
    else:
        assert stats["max_staleness"] > 1


def test_ssp_done_releases_waiting_worker():
    sizes = [4]
    with server(make_shards(sizes), rule=BoundedStaleness(0), num_workers=2, timeout=10) as ps:
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
    with server(make_shards(sizes), rule=BoundedStaleness(0), num_workers=2, timeout=1.0) as ps:
        with client(ps, 0, sizes, timeout=10) as c:
            c.pull()
            c.push([np.ones(4, np.float32)])
            with pytest.raises(CollectiveTimeout) as info:
                c.pull()
        assert ps.stats()["workers_set_aside"] == []  # without min_workers, none
    message = str(info.value)
    # The server's staleness gate gave up after its timeout=1.0 and said so (not the client's 10 s socket timeout).
    assert "refused under mode='ssp'" in message
    assert "worker 0" in message and ps.addresses[0] in message
    assert "max_staleness=0" in message and "timeout" in message


def test_ssp_with_min_workers_goes_on_without_a_silent_worker_and_takes_it_back_once_caught_up():
    """min_workers=1 of 2: worker 1 never sends a thing, so worker 0's second pull, held by the gate, is admitted once
    worker 1 has been silent for the timeout (set aside) instead of failing; worker 0 then runs on, and worker 1,
    coming late, trains its steps without holding worker 0 back until it has caught up (then it holds it again)."""
    sizes = [4]
    one = [np.ones(4, np.float32)]
    with server(make_shards(sizes), rule=BoundedStaleness(0), num_workers=2, timeout=1.0, min_workers=1) as ps:
        with client(ps, 0, sizes) as fast:
            fast.pull()
            fast.push(one)
            assert ps.stats()["workers_set_aside"] == []
            fast.pull()  # held by worker 1, silent since the server started: set aside after timeout=1.0, not failed
            assert ps.stats()["workers_set_aside"] == [1]
            for _ in range(3):
                fast.push(one)
                fast.pull()  # not held: the slowest active worker is worker 0 itself
            fast.push(one)  # worker 0 at clock 5
            with client(ps, 1, sizes) as late:
                for _ in range(3):  # behind worker 0: neither held nor holding
                    late.pull()
                    late.push(one)
                fast.pull()  # worker 1 at clock 3 of 5, catching up, holds nobody: held, this would time out
                for _ in range(2):
                    late.pull()
                    late.push(one)  # clock 5: caught up, active again
                fast.push(one)  # clock 6
                waiter = threading.Thread(target=fast.pull)
                waiter.start()
                time.sleep(0.3)
                assert waiter.is_alive(), "worker 1, caught up, no longer held worker 0 to max_staleness=0"
                late.pull()
                late.push(one)
                waiter.join(5)
                assert not waiter.is_alive()
        stats = ps.stats()
    assert stats["workers_set_aside"] == [1]
    assert stats["clocks"] == [6, 6]


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
    with server(shards, rule=BoundedStaleness(5), num_workers=2) as ps:
        first = client(ps, 0, sizes)
        first.pull()
        first.push(g)
        first.push(g)
        # the task dies while sending its third push: half a frame, then the sockets vanish
        for shard, n in enumerate(sizes):
            sock = raw_connect(ps, shard, worker=0)
            sock.sendall(ps_request(protocol.Msg.PUSH, 1, 4 * n) + b"\x00" * (2 * n))
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
        stuck.sendall(ps_request(protocol.Msg.PUSH, 1, 64)[:10])
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
        ParameterServer(make_shards([1]), host="0.0.0.0", secret=SECRET, rule=Immediate(), num_workers=1)


# -- refused headers -----------------------------------------------------------------------


def with_raw(header: bytes, **raw) -> bytes:
    """``header`` with fields a :class:`Header` always packs right (magic, version, flags, pad) set to ``raw``."""
    fields = dict(zip(("magic", "version", "kind", "op", "dtype", "status", "flags", "pad"), HEADER.unpack(header)))
    fields.update(raw)
    return HEADER.pack(*fields.values(), *HEADER.unpack(header)[8:])


_FLOAT32 = dtype_code(np.float32)
_PUSH, _PULL = protocol.Msg.PUSH, protocol.Msg.PULL
#: (request header, whether the server answers BAD_REQUEST before closing, what its log says): each for shard 0 of 4
_REFUSED = {
    "wrong kind (response)": (ps_request(_PUSH, 7, 16, kind=Kind.RESPONSE), True, "a RESPONSE frame"),
    "wrong kind (collective)": (ps_request(_PULL, 7, 0, kind=Kind.COLLECTIVE), True, "a COLLECTIVE frame"),
    "wrong dtype on push (float64)": (ps_request(_PUSH, 7, 16, dtype=dtype_code(np.float64)), True, "dtype code"),
    "wrong dtype on push (bytes)": (ps_request(_PUSH, 7, 16, dtype=0), True, "dtype code"),
    "dtype on pull": (ps_request(_PULL, 7, 0, dtype=_FLOAT32), True, "dtype code"),
    "unknown type": (ps_request(9, 7, 0), True, "unknown message type 9"),
    "non-zero status": (ps_request(_PULL, 7, 0, status=1), True, "reserved"),
    "non-zero group": (ps_request(_PULL, 7, 0, group=1), True, "reserved"),
    "non-zero tag": (ps_request(_PULL, 7, 0, tag=1), True, "reserved"),
    "non-zero value": (ps_request(_PULL, 7, 0, value=1), True, "reserved"),  # (a push's is its step)
    "wrong length": (ps_request(_PUSH, 7, 12), True, "exactly 16"),
    "wrong version": (with_raw(ps_request(_PUSH, 7, 16), version=VERSION + 1), False, f"wire version {VERSION + 1}"),
    "bad magic": (with_raw(ps_request(_PUSH, 7, 16), magic=b"SDLP"), False, "bad magic"),
    "non-zero flags": (with_raw(ps_request(_PUSH, 7, 16), flags=1), False, "flags 1"),
    "non-zero pad": (with_raw(ps_request(_PUSH, 7, 16), pad=1), False, "pad 1"),
    "unknown kind": (ps_request(_PUSH, 7, 16, kind=0), False, "kind 0"),
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_a_refused_header_closes_the_connection_and_a_real_client_is_still_served(case, caplog):
    header, answered, reason = _REFUSED[case]
    shard = SGDShard(np.zeros(4))
    with server([shard], num_workers=2) as ps:
        sock = raw_connect(ps, 0)
        # a whole push's worth of finite gradient follows: nothing of it may be applied
        sock.sendall(header + np.ones(4, np.float32).tobytes())
        if answered:
            response = ps_response(sock)
            assert (response.kind, response.status, response.seq) == (Kind.RESPONSE, protocol.Status.BAD_REQUEST, 7)
            assert response.op == HEADER.unpack(header)[3] and response.dtype == 0
            assert reason in recv_exactly(sock, response.nbytes).decode()
        try:
            assert sock.recv(1) == b"", "the server kept the connection open"
        except ConnectionResetError:
            pass  # closed with the payload unread
        sock.close()
        wait_for(lambda: ps.stats()["protocol_errors"] == 1)
        assert any(reason in record.getMessage() for record in caplog.records), caplog.text
        np.testing.assert_array_equal(shard.w, np.zeros(4))
        with client(ps, 1, [4]) as c:
            c.push([np.ones(4, np.float32)])
            np.testing.assert_allclose(c.pull()[0], -LR * np.ones(4))
            assert c.versions == [1]


def fake_shard(reply):
    """A listener for worker 0 that answers each request with the header bytes ``reply(request)`` and a payload of
    the length that header announces."""

    def serve(channel, worker):
        header = bytearray(HEADER.size)
        while channel.recv_into(memoryview(header)) == HEADER.size:
            request = Header.unpack(header, source="the test's client")
            if request.nbytes:
                channel.recv_into(memoryview(bytearray(request.nbytes)))
            response = reply(request)
            channel.send([response, bytes(HEADER.unpack(response)[-1])])

    return ServingListener(HOST, SECRET, 0, range(1), serve, name="fake shard", max_connections=4)


def ok_response(request, **fields) -> bytes:
    """The header of the OK response a real shard of 4 parameters at version 1 gives, ``fields`` overridden."""
    values = dict(
        kind=Kind.RESPONSE,
        op=request.op,
        dtype=_FLOAT32 if request.op == _PULL else 0,
        seq=request.seq,
        value=1,
        nbytes=16 if request.op == _PULL else 0,
    )
    return Header(**{**values, **fields}).pack()


@pytest.mark.parametrize(
    "fields",
    [dict(), dict(seq=99), dict(kind=Kind.REQUEST), dict(kind=Kind.MESSAGE), dict(op=3), dict(dtype=0), dict(tag=1)],
    ids=["well-formed", "wrong seq", "request kind", "message kind", "wrong type", "wrong dtype", "non-zero tag"],
)
def test_the_client_refuses_a_response_that_does_not_answer_its_request(fields):
    listener = fake_shard(lambda request: ok_response(request, **fields))
    try:
        with ParameterClient([listener.address], worker=0, secret=SECRET, shard_sizes=[4], timeout=5.0) as c:
            if not fields:
                np.testing.assert_array_equal(c.pull()[0], np.zeros(4, np.float32))
                assert c.versions == [1]
                return
            with pytest.raises(CollectiveError, match="malformed or out-of-order response.*sparkdl parameter server"):
                c.pull()
    finally:
        listener.close(5.0)


def test_the_client_refuses_a_response_of_another_wire_version():
    listener = fake_shard(lambda request: with_raw(ok_response(request), version=VERSION + 1))
    try:
        with ParameterClient([listener.address], worker=0, secret=SECRET, shard_sizes=[4], timeout=5.0) as c:
            with pytest.raises(CollectiveError, match=f"malformed response .*wire version {VERSION + 1}"):
                c.pull()
    finally:
        listener.close(5.0)


# -- fuzzing -------------------------------------------------------------------------------

_SIZES = [5, 16]
_TYPES = st.one_of(st.sampled_from([int(m) for m in protocol.Msg]), st.integers(0, 255))
_LENGTHS = st.one_of(
    st.sampled_from(
        [0, 1, 4 * _SIZES[0], 4 * _SIZES[1], 4 * _SIZES[1] - 1, 4 * _SIZES[1] + 1, 2**31, 2**63, 2**64 - 1]
    ),
    st.integers(0, 2**64 - 1),
)


def _mostly(right, anything):
    """A header field: often the value a well-formed request has, else anything of its width."""
    return st.one_of(st.just(right), anything)


_FRAME = st.one_of(
    st.fixed_dictionaries(  # anything goes
        dict(
            magic=_mostly(MAGIC, st.binary(min_size=4, max_size=4)),
            version=_mostly(VERSION, st.integers(0, 255)),
            kind=_mostly(int(Kind.REQUEST), st.integers(0, 255)),
            op=_TYPES,
            dtype=st.one_of(st.sampled_from([0, _FLOAT32]), st.integers(0, 255)),
            status=_mostly(0, st.integers(0, 255)),
            flags=_mostly(0, st.integers(0, 255)),
            pad=_mostly(0, st.integers(0, 2**16 - 1)),
            group=_mostly(0, st.integers(0, 2**32 - 1)),
            tag=_mostly(0, st.integers(0, 2**32 - 1)),
            seq=st.integers(0, 2**32 - 1),
            value=_mostly(0, st.integers(0, 2**64 - 1)),
            nbytes=_LENGTHS,
            payload=st.binary(max_size=120),
        )
    ),
    st.fixed_dictionaries(  # a well-formed push header that lies about its length, with enough bytes after it
        dict(
            op=st.just(int(_PUSH)),
            dtype=st.just(_FLOAT32),
            seq=st.integers(0, 2**32 - 1),
            nbytes=_LENGTHS,
            payload=st.binary(min_size=4 * max(_SIZES) + 8, max_size=120),
        )
    ),
)


def _encode(frame, shard_size):
    fields = dict(frame)
    payload = fields.pop("payload")
    raw = {name: fields.pop(name) for name in ("magic", "version", "flags", "pad") if name in fields}
    fields.setdefault("kind", Kind.REQUEST)
    header = with_raw(Header(**fields).pack(), **raw)
    right = (MAGIC, VERSION, Kind.REQUEST, _PUSH, _FLOAT32, 0, 0, 0, 0, 0, HEADER.unpack(header)[10], 0, 4 * shard_size)
    if HEADER.unpack(header) == right:  # garbage must never be a valid push: cut it short
        payload = payload[: 4 * shard_size - 1]
    return header + payload


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@example(data=None)
def _fuzz_once(ps, initial, data):
    if data is None:  # explicit oversized frame on an authenticated connection
        authenticated, shard, blobs = (
            True,
            1,
            [ps_request(protocol.Msg.PUSH, 1, 2**63)],
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


def test_a_worker_that_resumes_is_told_where_it_stands_and_each_step_is_applied_once_per_shard():
    """async, two shards: a worker's task dies after its push of step 2 reached shard 0 only. Its next attempt tells
    the shards its rows and asks where it stands: shard 0 says step 3, shard 1 step 2. It resumes at 2; shard 0 drops
    that push (applied already) and each shard has applied each of its steps once. A worker whose rows changed since
    is refused."""
    sizes = [2, 2]
    shards = make_shards(sizes)
    with server(shards, num_workers=1) as ps:
        first = client(ps, 0, sizes)
        assert first.resume(10, 99) == [-1, -1]  # nothing applied yet: its first step
        for step in range(2):
            first.push([np.ones(n, np.float32) for n in sizes], step=step)
        first.close()
        only_first = client(ps, 0, sizes[:1], addresses=ps.addresses[:1])  # step 2 reaches shard 0: the task dies
        only_first.push([np.ones(sizes[0], np.float32)], step=2)
        only_first.close()
        retry = client(ps, 0, sizes)
        assert retry.resume(10, 99) == [3, 2]
        retry.push([np.ones(n, np.float32) for n in sizes], step=2)
        assert ps.stats()["versions"] == [3, 3] and ps.stats()["replayed_pushes"] == [1, 0]
        with ps.holding_updates():
            assert ps.positions() == ([10], [99], [[3], [3]])
        with pytest.raises(CollectiveError, match="trains 11 rows, but the positions of its steps were taken on 10"):
            client(ps, 0, sizes).resume(11, 99)
        retry.close()
