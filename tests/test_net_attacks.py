"""Attacks on every sparkdl listener (ring accept, parameter-server shard, relay) from the same host.

Each test attacks with real sockets (and real processes where a resource limit
must be lowered) and then asserts that the legitimate peer still finishes its
work with correct results. An attacker on "another host" connects from another
loopback address (:mod:`attackers`). The handshake under a flood: tests/test_net_handshakes.py.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import keras
import numpy as np
import pytest
from attackers import HOST, OTHER_HOST, Hog, logged_refusals, ps_request, ps_response, recv_exactly
from frames import digits_frame
from models import make_mlp
from shards import LR, SGDShard

import sparkdl
from sparkdl.collective import Listener
from sparkdl.collective.api import OP_CODES
from sparkdl.collective.transport.link import MAX_KEPT_BYTES
from sparkdl.collective.transport.mesh import Links
from sparkdl.launch import payloads
from sparkdl.launch.forward import TaskReporter, _Forwarder
from sparkdl.launch.relay import OutputRelay
from sparkdl.launch.relay_frames import ERROR, HEADER, RELAY_ID, STDOUT, ErrorReport
from sparkdl.net.acceptor import MAX_PENDING
from sparkdl.net.auth import SERVER_HELLO_BYTES, ConnectGaveUp, connect_authenticated
from sparkdl.net.frames import Header, Kind, dtype_code
from sparkdl.net.io import parse_address
from sparkdl.ps import protocol
from sparkdl.ps.client import NonFiniteGradientError, ParameterClient
from sparkdl.ps.rules import Immediate
from sparkdl.ps.server import ParameterServer

SECRET = b"attack-test-secret"
#: Longer than any test: a hogged slot is freed by eviction only, never by its handshake deadline.
FOREVER = 3600.0


# -- pending-slot hogging -------------------------------------------------------------------------------------------


def _evicted_at_least(hogs: int, cap: int) -> int:
    """Evictions a listener with ``cap`` pending slots must have made before it served a real peer that connected
    after ``hogs`` idle connections, whatever the machine's speed: the hog's connections are queued (its
    constructor returns once all are), the listener accepts in order, and none leaves a slot but by eviction
    (``FOREVER``); so the hog's connections beyond the cap, and the real peer's, each arrived at a full table."""
    return hogs + 1 - cap


def test_hogged_parameter_server_shard_still_serves_a_real_worker(caplog):
    shard = SGDShard(np.arange(6))
    with ParameterServer(
        [shard], host=HOST, secret=SECRET, rule=Immediate(), num_workers=1, handshake_timeout=FOREVER
    ) as ps:
        hog = Hog(ps.addresses[0], 72)  # the attack: 72 idle connections against 64 pending slots
        try:
            with ParameterClient(ps.addresses, worker=0, secret=SECRET, shard_sizes=[6], timeout=30) as worker:
                worker.push([np.ones(6, np.float32)])
                (weights,) = worker.pull()
        finally:
            hog.close()
    np.testing.assert_array_equal(weights, np.arange(6, dtype=np.float32) - LR)
    assert _evictions(caplog) >= _evicted_at_least(72, MAX_PENDING)


def ring_frame(array: np.ndarray, seq: int) -> tuple[Header, memoryview]:
    """A collective's frame of ``array``, as an allreduce of the job's group sends it."""
    header = Header(Kind.COLLECTIVE, OP_CODES["allreduce"], array.nbytes, dtype_code(array.dtype), seq=seq)
    return header, array.view(np.uint8).data


def test_hogged_ring_accept_still_takes_the_real_peer(caplog):
    listeners = [Listener(HOST), Listener(HOST, handshake_timeout=FOREVER, max_pending=16)]
    addresses = [listener.address for listener in listeners]
    server = Links(1, addresses, listeners[1], SECRET, 30.0, encrypt=False)  # accepting already
    client = Links(0, addresses, listeners[0], SECRET, 30.0, encrypt=False)
    try:
        with ThreadPoolExecutor(1) as pool:
            accepted = pool.submit(server.link, 0)
            hog = Hog(addresses[1], 20)  # more than its backlog of 16 may queue
            try:
                client.link(1).send(*ring_frame(np.arange(5, dtype=np.float32), 7)).result(30)
                out = np.empty(5, np.float32)
                accepted.result(60).receive((Kind.COLLECTIVE, 0, 7), OP_CODES["allreduce"], out, None)
            finally:
                hog.close()
    finally:
        client.close()
        server.close()
    np.testing.assert_array_equal(out, np.arange(5, dtype=np.float32))
    assert _evictions(caplog) >= _evicted_at_least(20, 16)


def test_hogged_relay_still_takes_a_real_task(caplog):
    out = io.StringIO()
    with OutputRelay(HOST, SECRET, num_workers=2, stdout=out, handshake_timeout=FOREVER) as relay:
        hog = Hog(relay.address, 80)  # more than the 64 pending slots
        try:
            sock = connect_authenticated(relay.address, 1, RELAY_ID, SECRET, timeout=30)
            sock.sendall(HEADER.pack(1, 6) + b"hello\n")
            sock.close()
            relay.wait_until_quiet(30)
        finally:
            hog.close()
    assert out.getvalue() == "[rank 1] hello\n"
    assert _evictions(caplog) >= _evicted_at_least(80, MAX_PENDING)


def test_an_async_fit_trains_exactly_while_another_host_hogs_its_parameter_server(spark, digits, monkeypatch):
    """A whole fit while 72 idle and 8 garbage connections from another host hog each shard of its parameter server
    from the moment it starts until the fit has returned: the weights are exactly plain SGD's (one worker, one batch
    of all rows a step), and the server's refused connections show the hog at work."""
    hogs: list[Hog] = []
    start = ParameterServer.start

    def start_and_hog(server):
        addresses = start(server)
        for address in addresses:
            hogs.extend([Hog(address, 72, source=OTHER_HOST), Hog(address, 8, source=OTHER_HOST, garbage=True)])
        return addresses

    monkeypatch.setattr(ParameterServer, "start", start_and_hog)
    x_train, _, y_train, _ = digits
    x, y = x_train[:64], y_train[:64]
    model = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(0.5), seed=4)
    reference = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(0.5), seed=4)
    try:
        result = sparkdl.fit(
            digits_frame(spark, x, y), model, num_workers=1, mode="async", epochs=3, batch_size=64, timeout=120
        )
        assert hogs and all(hog.running() for hog in hogs)  # still hogging when the fit returned
    finally:
        for hog in hogs:
            hog.close()
    reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    for got, want, initial in zip(result.model.get_weights(), reference.get_weights(), model.get_weights()):
        assert not np.allclose(want, initial, atol=1e-3)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert result.stats["pushes"] == 3
    assert result.stats["refused_connections"] > 8


def test_an_announced_result_costs_the_relay_nothing_until_its_bytes_arrive(caplog):
    """A task that announces a 256 MiB result and stays silent costs the driver no 256 MiB; a real upload beside it
    arrives intact; an absurd size is refused with an error naming the rank and the size."""
    exchange = payloads.PayloadExchange()
    out = io.StringIO()
    upload = os.urandom((3 << 20) + 5)  # three frames and a bit
    absurd = 1 << 62
    with OutputRelay(HOST, SECRET, num_workers=3, exchange=exchange, stdout=out) as relay:
        tracemalloc.start()
        try:
            silent = connect_authenticated(relay.address, 0, RELAY_ID, SECRET, timeout=10)
            start = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            # the output line after the announcement shows when the relay has handled it
            silent.sendall(_announcement(256 << 20) + HEADER.pack(STDOUT, 7) + b"marker\n")
            deadline = time.monotonic() + 30
            while "[rank 0] marker" not in out.getvalue():
                assert time.monotonic() < deadline, "the relay did not handle the announcement"
                time.sleep(0.01)
            grown = tracemalloc.get_traced_memory()[1] - start
        finally:
            tracemalloc.stop()
        reporter = TaskReporter(_Forwarder(relay.address, SECRET, 1, timeout=10.0, encrypt=False), 1)
        payloads.upload(reporter, upload, attempt=2)
        reporter.connection.close()
        refused = connect_authenticated(relay.address, 2, RELAY_ID, SECRET, timeout=10)
        refused.sendall(_announcement(absurd))
        refused.settimeout(10)
        assert refused.recv(1) == b""  # the relay dropped that connection
        refused.close()
        silent.close()
        relay.wait_until_quiet(10)
    assert grown < 16 << 20, f"announcing 256 MiB cost {grown / 2**20:.0f} MiB"
    assert exchange.take(1, 2, len(upload)) == upload
    with pytest.raises(RuntimeError, match="never reached the driver's relay"):
        exchange.take(0, 1, 256 << 20)
    (refusal,) = [record.getMessage() for record in caplog.records if "rank 2" in record.getMessage()]
    assert f"Expected rank 2's result to be 0 to {payloads.MAX_RESULT_BYTES:,} bytes" in refusal
    assert f"Received: an announced size of {absurd:,} bytes" in refusal


def _announcement(size: int) -> bytes:
    header = json.dumps({"attempt": 1, "size": size}).encode()
    return HEADER.pack(payloads._RESULT, len(header)) + header


def _evictions(caplog) -> int:
    return logged_refusals(caplog.records, "evicted: more than")


# -- file descriptors exhausted -------------------------------------------------------------------------------------

_SERVE_WITH_FEW_FILES = r"""
import json, logging, os, resource, sys
import numpy as np
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from sparkdl.collective import Listener
from sparkdl.collective.api import OP_CODES
from sparkdl.collective.transport.mesh import Links
from sparkdl.net.frames import Header, Kind, dtype_code
from sparkdl.ps.rules import Immediate
from sparkdl.ps.server import ParameterServer
from shards import LR, SGDShard
kind, secret = sys.argv[1], bytes.fromhex(sys.argv[2])

class Shard:
    size = 4
    def __init__(self):
        self.w = np.zeros(4, np.float32)
    def read(self):
        return self.w.copy()
    def apply(self, gradient):
        self.w -= gradient

server = (ParameterServer([Shard()], host="127.0.0.1", secret=secret, rule=Immediate(), num_workers=1)
          if kind == "ps" else Listener("127.0.0.1"))
address = server.start()[0] if kind == "ps" else server.address
if kind == "ring":  # rank 1 of two, accepting rank 0 (the test) from now on
    server = Links(1, ["127.0.0.1:1", address], server, secret, 120.0, encrypt=False)
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
print(json.dumps(address), flush=True)
if kind == "ring":
    link = server.link(0)
    out = np.empty(4, np.float32)
    link.receive((Kind.COLLECTIVE, 0, 0), OP_CODES["allreduce"], out, None)
    doubled = 2 * out
    link.send(Header(Kind.COLLECTIVE, OP_CODES["allreduce"], 16, dtype_code(np.float32)), doubled.data).result(60)
sys.stdin.read()  # until the test is done
server.stop() if kind == "ps" else server.close()
"""


@pytest.mark.parametrize("kind", ["ps", "ring"])
def test_listener_survives_running_out_of_file_descriptors(kind):
    """A flood exhausts the listener's open-file limit (EMFILE): it pauses, frees a slot, and serves the real peer."""
    secret = secrets.token_bytes(32)
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE_WITH_FEW_FILES, kind, secret.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    log: list[str] = []
    saw_emfile = threading.Event()

    def read_log():
        for line in process.stderr:
            log.append(line)
            if "accept() failed" in line and "Too many open files" in line:
                saw_emfile.set()

    threading.Thread(target=read_log, daemon=True).start()
    flood = []
    try:
        address = json.loads(process.stdout.readline())
        for _ in range(40):
            flood.append(socket.create_connection(parse_address(address), timeout=10))
        assert saw_emfile.wait(120), "".join(log)
        if kind == "ps":
            with ParameterClient([address], worker=0, secret=secret, shard_sizes=[4], timeout=60) as worker:
                worker.push([np.ones(4, np.float32)])
                (weights,) = worker.pull()
            np.testing.assert_array_equal(weights, -np.ones(4, np.float32))
        else:
            own = Listener("127.0.0.1")
            links = Links(0, [own.address, address], own, secret, 60.0, encrypt=False)
            try:
                link = links.link(1)
                link.send(*ring_frame(np.arange(4, dtype=np.float32), 0)).result(60)
                out = np.empty(4, np.float32)
                link.receive((Kind.COLLECTIVE, 0, 0), OP_CODES["allreduce"], out, None)
            finally:
                links.close()
            np.testing.assert_array_equal(out, 2 * np.arange(4, dtype=np.float32))
    finally:
        for sock in flood:
            sock.close()
        process.communicate("", timeout=60)
    assert process.returncode == 0, "".join(log)


# -- non-finite pushes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_push_is_refused_before_anything_is_applied(bad):
    shards = [SGDShard(np.arange(3)), SGDShard(np.arange(4))]
    with ParameterServer(shards, host=HOST, secret=SECRET, rule=Immediate(), num_workers=2) as ps:
        with ParameterClient(ps.addresses, worker=1, secret=SECRET, shard_sizes=[3, 4], timeout=10) as worker:
            worker.push([np.ones(3, np.float32), np.ones(4, np.float32)])
            gradient = np.ones(4, np.float32)
            gradient[2] = bad
            with pytest.raises(NonFiniteGradientError, match=r"worker 1: push #2 .*shard 1.*lower the learning rate"):
                worker.push([np.ones(3, np.float32), gradient])
        assert ps.stats()["versions"][1] == 1  # the refused push changed nothing on shard 1
        np.testing.assert_array_equal(shards[1].w, np.arange(4, dtype=np.float32) - LR)
        # The raw answer is BAD_REQUEST, and the connection stays usable.
        sock = connect_authenticated(ps.addresses[1], 0, 1, SECRET, timeout=10)
        sock.sendall(ps_request(protocol.Msg.PUSH, 1, 16) + gradient.tobytes())
        response = ps_response(sock)
        assert (response.kind, response.op, response.status, response.seq, response.dtype) == (
            Kind.RESPONSE,
            protocol.Msg.PUSH,
            protocol.Status.BAD_REQUEST,
            1,
            0,
        )
        assert recv_exactly(sock, response.nbytes).decode().startswith(protocol.NON_FINITE)
        sock.sendall(ps_request(protocol.Msg.PULL, 2, 0))
        response = ps_response(sock)
        assert (response.status, response.seq, response.value, response.nbytes, response.dtype) == (
            protocol.Status.OK,
            2,
            1,
            16,
            dtype_code(np.float32),
        )
        np.testing.assert_array_equal(
            np.frombuffer(recv_exactly(sock, 16), np.float32), np.arange(4, dtype=np.float32) - LR
        )
        sock.close()


# -- malformed frames -----------------------------------------------------------------------------------------------


def test_parameter_server_answers_a_2_to_the_64_length_and_keeps_serving():
    shard = SGDShard(np.zeros(2))
    with ParameterServer([shard], host=HOST, secret=SECRET, rule=Immediate(), num_workers=1) as ps:
        for length in (2**64 - 1, 7, 0):
            sock = connect_authenticated(ps.addresses[0], 0, 0, SECRET, timeout=10)
            sock.sendall(ps_request(protocol.Msg.PUSH, 1, length))
            assert ps_response(sock).status == protocol.Status.BAD_REQUEST
            sock.close()
        with ParameterClient(ps.addresses, worker=0, secret=SECRET, shard_sizes=[2], timeout=10) as worker:
            worker.push([np.ones(2, np.float32)])
        assert ps.stats()["protocol_errors"] == 3
    np.testing.assert_array_equal(shard.w, [-LR, -LR])


_KEEP_WHILE_WAITING = r"""
import json, sys
import numpy as np
from sparkdl.collective import CollectiveError, Listener
from sparkdl.collective.api import OP_CODES
from sparkdl.collective.transport.mesh import Links
from sparkdl.net.frames import Kind
secret, timeout = bytes.fromhex(sys.argv[1]), float(sys.argv[2])
listener = Listener("127.0.0.1")
links = Links(1, ["127.0.0.1:1", listener.address], listener, secret, timeout, encrypt=False)
print(json.dumps(listener.address), flush=True)
link = links.link(0)
try:  # waits for an allreduce frame; whatever else arrives meanwhile is kept
    link.receive((Kind.COLLECTIVE, 0, 0), OP_CODES["allreduce"], np.empty(4, np.float32), None)
except CollectiveError as exc:
    print(json.dumps(str(exc)), flush=True)
links.close()
print(json.dumps("closed"), flush=True)
sys.stdin.read()  # until the test is done
"""


def _resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        (line,) = [line for line in status if line.startswith("VmRSS:")]
    return int(line.split()[1]) / 1024


@pytest.mark.parametrize("announced", [1 << 30, (4 << 30) - 1])
def test_an_announced_length_commits_no_memory_until_its_bytes_arrive(announced):
    """A peer sends a message of 16 MiB, then announces one nobody waits for (1 GiB, 4 GiB-1) and sends 1 MiB of
    it: the rank waiting for its allreduce keeps what arrived, not what was announced (was: 1,024 and 4,096 MB more
    resident at the timeout), and gives it all back when its links close."""
    secret = secrets.token_bytes(32)
    process = subprocess.Popen(
        [sys.executable, "-c", _KEEP_WHILE_WAITING, secret.hex(), "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    own = Listener(HOST)
    links = Links(0, [own.address, json.loads(process.stdout.readline())], own, secret, 30.0, encrypt=False)
    try:
        link = links.link(1)
        before = _resident_mb(process.pid)
        whole = Header(Kind.MESSAGE, OP_CODES["send"], 16 << 20, tag=98)
        announcement = Header(Kind.MESSAGE, OP_CODES["send"], announced, tag=99)
        link.channel.send([whole.pack(), bytes(16 << 20), announcement.pack(), bytes(1 << 20)])
        deadline, waiting = time.monotonic() + 1.0, before
        while time.monotonic() < deadline:  # while the rank waits in its receive, the frame's 1 MiB arrived
            waiting = max(waiting, _resident_mb(process.pid))
            time.sleep(0.01)
        error = json.loads(process.stdout.readline())
        timed_out = _resident_mb(process.pid)
        assert json.loads(process.stdout.readline()) == "closed"
        closed = _resident_mb(process.pid)
    finally:
        links.close()
        process.communicate("", timeout=60)
    if announced + (16 << 20) <= MAX_KEPT_BYTES:
        assert "allreduce timed out after 2.0s waiting to receive from rank 0" in error, error
    else:  # refused at its header
        assert f"rank 0 sent more than {MAX_KEPT_BYTES} bytes ahead of their receives" in error, error
    grown = {"waiting": waiting - before, "timed out": timed_out - before, "closed": closed - before}
    assert grown["waiting"] < 64 and grown["timed out"] < 64 and grown["closed"] < 8, grown


def test_relay_ignores_malformed_and_foreign_error_reports():
    errors = []
    with OutputRelay(HOST, SECRET, num_workers=2, on_error=errors.append, stdout=io.StringIO()) as relay:
        sock = connect_authenticated(relay.address, 1, RELAY_ID, SECRET, timeout=10)
        foreign = ErrorReport(0, "ValueError", "blame rank 0", "").to_json()
        own = ErrorReport(1, "ValueError", "real failure", "tb").to_json()
        for payload in (
            b"{not json",
            b"[1, 2]",
            b'{"rank": 1}',
            b'{"rank": "x", "type_name": 1, "message": 2, "traceback": 3}',
            b"\xff\xfe",
            foreign,
            own,
        ):
            sock.sendall(HEADER.pack(ERROR, len(payload)) + payload)
        sock.close()
        relay.wait_until_quiet(30)
        # A header announcing 2^32-1 bytes ends that connection only; the relay keeps serving.
        sock = connect_authenticated(relay.address, 0, RELAY_ID, SECRET, timeout=10)
        sock.sendall(struct.pack("!BI", 1, 2**32 - 1))
        assert sock.recv(1) == b""
        sock.close()
        sock = connect_authenticated(relay.address, 0, RELAY_ID, SECRET, timeout=10)
        sock.sendall(HEADER.pack(ERROR, len(foreign)) + foreign)
        sock.close()
        relay.wait_until_quiet(30)
    assert [(r.rank, r.message) for r in relay.reports] == [(1, "real failure"), (0, "blame rank 0")]
    assert [r.message for r in errors] == ["real failure"]


# -- prompt close ---------------------------------------------------------------------------------------------------


def _close_in_thread(close) -> threading.Thread:
    thread = threading.Thread(target=close, daemon=True)
    thread.start()
    thread.join(60)
    return thread


def _greeted_idle_connection(address: str) -> socket.socket:
    """A connection that the listener at ``address`` has accepted (its greeting arrived) and that never says a word:
    when close() is called, every idle socket is one the listener holds, none still in the kernel's queue."""
    sock = socket.create_connection(parse_address(address), timeout=10)
    recv_exactly(sock, SERVER_HELLO_BYTES)
    return sock


def test_relay_and_shard_close_without_waiting_for_200_idle_connections():
    """With a handshake deadline of an hour, close() can only return by dropping the idle connections at once."""
    relay = OutputRelay(HOST, SECRET, num_workers=2, stdout=io.StringIO(), handshake_timeout=FOREVER)
    ps = ParameterServer(
        [SGDShard(np.zeros(2))], host=HOST, secret=SECRET, rule=Immediate(), num_workers=2, handshake_timeout=FOREVER
    )
    ps.start()
    idle = [_greeted_idle_connection(address) for address in (relay.address, ps.addresses[0]) for _ in range(100)]
    # Authenticated but silent tasks too, as many as the relay runs threads for (2 * num_workers + 2); one more is
    # refused before the relay proves itself, so that task's connect retries and gives up.
    tasks = [connect_authenticated(relay.address, i % 2, RELAY_ID, SECRET, timeout=10) for i in range(6)]
    try:
        with pytest.raises(ConnectGaveUp) as refused:
            connect_authenticated(relay.address, 0, RELAY_ID, SECRET, timeout=0.5)
        assert "after reading this client's proof" in refused.value.last_error, refused.value.last_error
        assert len(relay._listener.threads()) == 1 + 6
        threads = relay._listener.threads() + ps._shards[0].listener.threads()
        assert not _close_in_thread(relay.close).is_alive()
        assert not _close_in_thread(ps.stop).is_alive()
        assert not any(thread.is_alive() for thread in threads)
    finally:
        for sock in idle + tasks:
            sock.close()
