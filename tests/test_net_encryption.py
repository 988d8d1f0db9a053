"""Sealed links (sparkdl.net.secure): the ring, the parameter server and the relay; tampering and replays refused."""

from __future__ import annotations

import io
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from frames import digits_frame
from models import make_mlp
from shards import LR, SGDShard

import sparkdl
from sparkdl.collective import CollectiveError, Listener, SparkdlCommunicator
from sparkdl.launch import payloads
from sparkdl.launch.forward import TaskReporter, _Forwarder
from sparkdl.launch.relay import OutputRelay
from sparkdl.launch.relay_frames import HEADER, MAX_FRAME_BYTES
from sparkdl.launch.session import encrypts_traffic
from sparkdl.net import errors, listener
from sparkdl.net.auth import CLIENT_HELLO
from sparkdl.net.frames import MAGIC
from sparkdl.net.secure import RECORD_BYTES, TAG_BYTES, IntegrityError, SealedChannel
from sparkdl.ps.client import ParameterClient
from sparkdl.ps.rules import Immediate
from sparkdl.ps.server import ParameterServer

#: A float pattern easy to look for in recorded bytes.
PATTERN = np.full(4096, 1234.5678, dtype=np.float32)


class Proxy:
    """A TCP proxy in front of one listener: records the client->server bytes, optionally flips one of them."""

    def __init__(self, upstream: str, flip_at: int | None = None):
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._upstream = upstream
        self._flip_at = flip_at
        self.recorded = bytearray()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()

    def _accept(self) -> None:
        client, _ = self._server.accept()
        host, port = self._upstream.rsplit(":", 1)
        server = socket.create_connection((host, int(port)))
        self._sockets += [client, server]
        for source, target, record in ((client, server, True), (server, client, False)):
            thread = threading.Thread(target=self._pump, args=(source, target, record), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, source: socket.socket, target: socket.socket, record: bool) -> None:
        try:
            while data := source.recv(65536):
                if record:
                    start = len(self.recorded)
                    self.recorded += data
                    if self._flip_at is not None and start <= self._flip_at < len(self.recorded):
                        data = bytearray(data)
                        data[self._flip_at - start] ^= 0x01
                target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()
        for sock in self._sockets:
            sock.close()


def run_proxied_ring(size, body, *, encrypt=True, flip_at=None, timeout=10.0):
    """Run ``body(comm)`` on a (sealed) ring of threads whose 0 -> 1 link passes through a :class:`Proxy`."""
    listeners = [Listener("127.0.0.1") for _ in range(size)]
    proxy = Proxy(listeners[1].address, flip_at=flip_at)
    addresses = [listener.address for listener in listeners]
    addresses[1] = proxy.address
    secret = secrets.token_bytes(32)

    def rank_main(rank):
        with SparkdlCommunicator.connect(
            rank, addresses, listeners[rank], secret, timeout=timeout, encrypt=encrypt, shared_memory=False
        ) as comm:
            return body(comm)

    try:
        with ThreadPoolExecutor(max_workers=size) as pool:
            futures = [pool.submit(rank_main, rank) for rank in range(size)]
            outcomes = []
            for future in futures:
                try:
                    outcomes.append(future.result(timeout=60))
                except Exception as exc:  # noqa: BLE001 - the test inspects which rank failed how
                    outcomes.append(exc)
            return outcomes, bytes(proxy.recorded)
    finally:
        proxy.close()
        for listener in listeners:
            listener.close()


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("size", [2, 3])
def test_sealed_ring_allreduce_is_right_and_the_wire_holds_no_plaintext(size, encrypt):
    # a ring sends rank 0's own chunk to rank 1 first: the pattern as it is, on a plain link
    outcomes, recorded = run_proxied_ring(size, lambda comm: comm.allreduce(PATTERN, algorithm="ring"), encrypt=encrypt)
    for result in outcomes:
        np.testing.assert_allclose(result, PATTERN * size, rtol=1e-6)
    assert len(recorded) > PATTERN.nbytes // size
    # a plain link carries the pattern as it is (so this check can fail); a sealed one must not
    assert (PATTERN[:64].tobytes() in recorded) is not encrypt


def test_flipped_byte_fails_with_integrity_error_instead_of_a_wrong_result():
    flip_at = CLIENT_HELLO.size + 4 + 100  # inside the first sealed record after the handshake
    outcomes, _ = run_proxied_ring(
        2, lambda comm: comm.allreduce(PATTERN, algorithm="ring"), flip_at=flip_at, timeout=5.0
    )
    receiver = outcomes[1]
    assert isinstance(receiver, CollectiveError), receiver
    assert isinstance(receiver.__cause__, IntegrityError)
    assert "rank 0" in str(receiver.__cause__) and "failed authentication" in str(receiver.__cause__)
    assert all(not isinstance(outcome, np.ndarray) for outcome in outcomes)


def sealed_pair():
    a, b = socket.socketpair()
    secret, proof = secrets.token_bytes(32), secrets.token_bytes(32)
    sender = SealedChannel(a, secret, proof, is_client=True, peer="the server")
    receiver = SealedChannel(b, secret, proof, is_client=False, peer="the client")
    return a, b, sender, receiver


def recorded_record(sock: socket.socket) -> bytes:
    """One whole sealed record read raw off ``sock``."""
    prefix = sock.recv(4, socket.MSG_WAITALL)
    (length,) = struct.unpack("!I", prefix)
    return prefix + sock.recv(length, socket.MSG_WAITALL)


def test_replayed_record_is_refused():
    a, b = socket.socketpair()  # the sender writes here; the test reads the sealed bytes raw
    c, d = socket.socketpair()  # the test writes them (twice) here, for the receiver
    secret, proof = secrets.token_bytes(32), secrets.token_bytes(32)
    sender = SealedChannel(a, secret, proof, is_client=True, peer="the server")
    receiver = SealedChannel(d, secret, proof, is_client=False, peer="the client")
    sender.send([b"first message"])
    record = recorded_record(b)
    c.sendall(record)
    out = bytearray(13)
    assert receiver.recv_into(memoryview(out)) == 13 and bytes(out) == b"first message"
    c.sendall(record)  # the same record again
    with pytest.raises(IntegrityError, match="record #1 from the client failed authentication"):
        receiver.recv_into(memoryview(out))
    for sock in (a, b, c, d):
        sock.close()


def test_absurd_length_is_refused_before_allocating():
    a, b, _, receiver = sealed_pair()
    a.sendall(struct.pack("!I", RECORD_BYTES + TAG_BYTES + 1))
    with pytest.raises(IntegrityError, match="announces"):
        receiver.recv_into(memoryview(bytearray(8)))
    a.close()
    b.close()


def test_records_split_and_join_across_reads():
    a, b, sender, receiver = sealed_pair()
    data = np.arange(RECORD_BYTES // 2 + 7, dtype=np.uint8).tobytes()  # more than one record
    thread = threading.Thread(target=sender.send, args=([b"head", data, data],))
    thread.start()
    out = bytearray(4 + 2 * len(data))
    assert receiver.recv_into(memoryview(out)[:3]) == 3
    assert receiver.recv_into(memoryview(out)[3:]) == len(out) - 3
    thread.join(timeout=30)
    assert bytes(out) == b"head" + data + data
    a.close()
    assert receiver.recv_into(memoryview(bytearray(1))) == 0  # peer closed
    b.close()


# --- the parameter server and the relay seal their connections too --------------------------------------------------


def proxied_parameter_server(*, encrypt, flip_at=None):
    """A one-shard server (``encrypt`` as given) and a worker whose connection passes through a :class:`Proxy`."""
    secret = secrets.token_bytes(32)
    shard = SGDShard(np.zeros(PATTERN.size, dtype=np.float32))
    server = ParameterServer([shard], host="127.0.0.1", secret=secret, rule=Immediate(), num_workers=1, encrypt=encrypt)
    server.start()
    proxy = Proxy(server.addresses[0], flip_at=flip_at)
    client = ParameterClient(
        [proxy.address], worker=0, secret=secret, shard_sizes=[PATTERN.size], timeout=10.0, encrypt=encrypt
    )
    return server, shard, proxy, client


@pytest.mark.parametrize("encrypt", [True, False])
def test_sealed_parameter_server_pushes_and_pulls_and_the_wire_holds_no_plaintext(encrypt):
    server, shard, proxy, client = proxied_parameter_server(encrypt=encrypt)
    try:
        client.push([PATTERN])
        (weights,) = client.pull()
        np.testing.assert_allclose(weights, -LR * PATTERN, rtol=1e-6)
        np.testing.assert_array_equal(weights, shard.w)
        recorded = bytes(proxy.recorded)
        assert len(recorded) > PATTERN.nbytes
        assert (PATTERN[:64].tobytes() in recorded) is not encrypt  # a plain push carries the gradient as it is
    finally:
        client.close()
        proxy.close()
        server.stop()


def test_flipped_byte_in_a_sealed_push_is_refused_and_nothing_is_applied():
    flip_at = CLIENT_HELLO.size + 4 + 100  # inside the push's first sealed record
    server, shard, proxy, client = proxied_parameter_server(encrypt=True, flip_at=flip_at)
    try:
        with pytest.raises(errors.CollectiveError, match="worker 0: shard 0"):
            client.push([PATTERN])
        np.testing.assert_array_equal(shard.w, np.zeros(PATTERN.size, dtype=np.float32))
        assert server.stats()["protocol_errors"] == 1 and server.stats()["pushes"] == 0
    finally:
        client.close()
        proxy.close()
        server.stop()


def test_a_plain_worker_is_refused_by_a_sealed_server():
    secret = secrets.token_bytes(32)
    shard = SGDShard(np.zeros(8, dtype=np.float32))
    with ParameterServer([shard], host="127.0.0.1", secret=secret, rule=Immediate(), num_workers=1, encrypt=True) as ps:
        with ParameterClient(ps.addresses, worker=0, secret=secret, shard_sizes=[8], timeout=10.0) as client:
            with pytest.raises(errors.CollectiveError, match="worker 0: shard 0"):
                client.push([np.ones(8, dtype=np.float32)])
        np.testing.assert_array_equal(shard.w, np.zeros(8, dtype=np.float32))
        assert ps.stats()["protocol_errors"] == 1


@pytest.mark.parametrize("encrypt", [True, False])
def test_sealed_relay_carries_results_and_errors_and_the_wire_holds_no_plaintext(encrypt):
    secret = secrets.token_bytes(32)
    exchange = payloads.PayloadExchange()
    with OutputRelay("127.0.0.1", secret, 1, exchange=exchange, stdout=io.StringIO(), encrypt=encrypt) as relay:
        proxy = Proxy(relay.address)
        reporter = TaskReporter(_Forwarder(proxy.address, secret, 0, timeout=10.0, encrypt=encrypt), 0)
        try:
            payloads.upload(reporter, PATTERN.tobytes(), attempt=7)
            reporter.error(ValueError("a-marker-in-the-report"))
            reporter.connection.close()
            relay.wait_until_quiet(10.0)
        finally:
            proxy.close()
        assert bytes(exchange.take(0, 7, PATTERN.nbytes)) == PATTERN.tobytes()
        assert [report.message for report in relay.reports] == ["a-marker-in-the-report"]
    recorded = bytes(proxy.recorded)
    assert (PATTERN[:64].tobytes() in recorded) is not encrypt
    assert (b"a-marker-in-the-report" in recorded) is not encrypt


def test_links_stay_plain_when_sparks_crypto_is_off(spark, monkeypatch):
    """The shared session runs without spark.network.crypto.enabled: the raw bytes on a fit's relay and
    parameter-server connections and on a ring's links are the plain protocol (the sealed side:
    test_fits_with_spark_rpc_encryption)."""
    assert not encrypts_traffic(spark)
    opened = []  # (channel type, first bytes on the socket) of each connection a driver's listener served
    open_channel = listener.open_channel

    def peeking_open_channel(conn, *args, **kwargs):
        conn.settimeout(60)  # every client speaks first after its handshake: a frame header, or a request's
        head = conn.recv(HEADER.size, socket.MSG_PEEK | socket.MSG_WAITALL)
        conn.settimeout(None)
        channel = open_channel(conn, *args, **kwargs)
        opened.append((type(channel).__name__, head))
        return channel

    monkeypatch.setattr(listener, "open_channel", peeking_open_channel)
    rng = np.random.default_rng(0)
    data = digits_frame(spark, rng.random((32, 64), dtype=np.float32), rng.integers(0, 10, 32))
    result = sparkdl.fit(data, make_mlp(hidden=(16,)), num_workers=2, epochs=1, batch_size=8, mode="async")
    assert np.isfinite(result.history["loss"]).all()
    assert {name for name, _ in opened} == {"PlainChannel"}, opened
    requests = [head for _, head in opened if head.startswith(MAGIC)]  # a worker's first request
    relayed = [HEADER.unpack(head) for _, head in opened if not head.startswith(MAGIC)]
    assert len(requests) >= 2 and len(relayed) >= 2, opened  # each worker's shard and relay connections
    # a task's first frame as it is (a sealed record would start with its length: a 0 byte)
    assert all(1 <= kind <= 8 and length <= MAX_FRAME_BYTES for kind, length in relayed), relayed

    def ring_link_bytes():
        from sparkdl.collective import context
        from sparkdl.net.frames import HEADER as FRAME_HEADER

        communicator = context.communicator()
        other = 1 - communicator.rank
        communicator.send(PATTERN, other, tag=7)  # a frame of its shape, then one of its bytes
        incoming = communicator._job.links.link(other).channel
        wanted, raw = 2 * FRAME_HEADER.size + 16 + PATTERN.nbytes, b""
        for _ in range(1000):  # a peek returns what has arrived so far, even with MSG_WAITALL
            raw = incoming.sock.recv(wanted, socket.MSG_PEEK | socket.MSG_WAITALL)
            if len(raw) == wanted:
                break
            time.sleep(0.01)
        received = communicator.recv(other, tag=7)
        return type(incoming).__name__, PATTERN.tobytes() in raw, np.array_equal(received, PATTERN)

    assert sparkdl.run(ring_link_bytes, num_workers=2, spark=spark) == ("PlainChannel", True, True)


_ENCRYPTED_FIT = """
import numpy as np
from pyspark.sql import SparkSession
import sparkdl
from sparkdl.launch.session import encrypts_traffic
from frames import digits_frame
from models import make_mlp

spark = (
    SparkSession.builder.master("local[2,2]")
    .config("spark.driver.host", "127.0.0.1")
    .config("spark.ui.enabled", "false")
    .config("spark.authenticate", "true")
    .config("spark.authenticate.secret", "sparkdl-test-secret")
    .config("spark.network.crypto.enabled", "true")
    .getOrCreate()
)
assert encrypts_traffic(spark)

# What every listener on the driver (the relay, the parameter server's shards) opened for its connections.
import sparkdl.net.listener as listener
opened = []
_open_channel = listener.open_channel


def recording_open_channel(*args, **kwargs):
    channel = _open_channel(*args, **kwargs)
    opened.append(type(channel).__name__)
    return channel


listener.open_channel = recording_open_channel
rng = np.random.default_rng(0)
x = rng.random((64, 64), dtype=np.float32)
y = rng.integers(0, 10, 64)
data = digits_frame(spark, x, y)
result = sparkdl.fit(data, make_mlp(), num_workers=2, epochs=2, batch_size=8)
assert len(result.history["loss"]) == 2 and all(np.isfinite(result.history["loss"]))
assert len(opened) >= 2 and set(opened) == {"SealedChannel"}, opened  # the tasks' relay connections
relay_connections = len(opened)
result = sparkdl.fit(data, make_mlp(), num_workers=2, epochs=2, batch_size=8, mode="async")
assert len(result.history["loss"]) == 2 and all(np.isfinite(result.history["loss"]))
# two more relay connections, and each worker's connection to the server's shard
assert len(opened) >= relay_connections + 4 and set(opened) == {"SealedChannel"}, opened


def channel():
    from sparkdl.collective import context

    communicator = context.communicator()
    return type(communicator._job.links.link(1 - communicator.rank).channel).__name__


assert sparkdl.run(channel, num_workers=2, spark=spark) == "SealedChannel"
print("ENCRYPTED FIT OK")
spark.stop()
"""


@pytest.mark.slow
def test_fits_with_spark_rpc_encryption(tmp_path):
    """A session with spark.network.crypto.enabled (its own, in a subprocess): the ring, the parameter server and
    the relay are sealed, and the models train."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), tests, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _ENCRYPTED_FIT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ENCRYPTED FIT OK" in done.stdout, done.stdout[-3000:] + done.stderr[-5000:]
