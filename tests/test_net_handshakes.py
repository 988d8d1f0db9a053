"""The handshake under a flood: who gets evicted, what a client cut short is told, the deadline, the log's volume.

Real listeners, real sockets; the flood comes from another loopback address where
the test needs another host (:mod:`attackers`).
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from attackers import HOST, OTHER_HOST, Hog, logged_refusals, ps_request, ps_response, recv_exactly
from shards import SGDShard

from sparkdl.net import auth, refusals
from sparkdl.net.auth import SERVER_HELLO_BYTES, ConnectGaveUp, connect_authenticated
from sparkdl.net.frames import Kind
from sparkdl.net.io import parse_address
from sparkdl.net.listener import ServingListener
from sparkdl.net.secure import connect_channel
from sparkdl.ps import protocol
from sparkdl.ps.rules import Immediate
from sparkdl.ps.server import ParameterServer

SECRET = b"handshake-test-secret"
#: Longer than any test: a pending slot is freed by eviction only, never by its handshake deadline.
FOREVER = 3600.0


def late_hellos(monkeypatch, delay: float) -> list[float]:
    """Every client hello of this test is sent ``delay`` seconds late (a real network, a busy executor); the list
    gets the time of each attempt."""
    handshake = auth.client_handshake
    attempts: list[float] = []

    def late_handshake(sock, *args):
        attempts.append(time.monotonic())
        time.sleep(delay)
        return handshake(sock, *args)

    monkeypatch.setattr(auth, "client_handshake", late_handshake)
    return attempts


def test_a_late_hello_keeps_its_slot_while_another_host_hogs_the_listener(monkeypatch):
    """The issue's attack: 72 idle connections from another host against 64 pending slots evict one another every
    few milliseconds. A worker whose hello comes 200 ms late still authenticates at its first attempt: the flood
    only evicts its own connections."""
    shard = SGDShard(np.arange(6))
    with ParameterServer(
        [shard], host=HOST, secret=SECRET, rule=Immediate(), num_workers=1, handshake_timeout=FOREVER
    ) as ps:
        hog = Hog(ps.addresses[0], 72, source=OTHER_HOST)
        try:
            attempts = late_hellos(monkeypatch, delay=0.2)
            refused_before = ps.stats()["refused_connections"]
            sock = connect_authenticated(ps.addresses[0], 0, 0, SECRET, timeout=30)
            refused_meanwhile = ps.stats()["refused_connections"] - refused_before
            sock.sendall(ps_request(protocol.Msg.PULL, 1, 0))
            response = ps_response(sock)
            weights = np.frombuffer(recv_exactly(sock, response.nbytes), np.float32)
            sock.close()
        finally:
            hog.close()
    assert len(attempts) == 1  # never evicted: no second attempt
    assert refused_meanwhile > 8  # while the hello was late, the hog's connections were evicted
    assert (response.kind, response.status, response.seq) == (Kind.RESPONSE, protocol.Status.OK, 1)
    np.testing.assert_array_equal(weights, np.arange(6, dtype=np.float32))


def test_a_late_hello_from_the_floods_own_address_gets_in_promptly(monkeypatch):
    """72 idle connections from this host's address, re-opened as they are dropped, against 64 pending slots; a worker
    from the same address whose hello comes 20 ms late waits its turn in line and authenticates within a fraction of
    a second (was: every attempt evicted by the flood's reconnections before its hello, locked out until its
    timeout)."""
    shard = SGDShard(np.arange(6))
    with ParameterServer(
        [shard], host=HOST, secret=SECRET, rule=Immediate(), num_workers=1, handshake_timeout=FOREVER
    ) as ps:
        hog = Hog(ps.addresses[0], 72)
        try:
            late_hellos(monkeypatch, delay=0.02)
            started = time.monotonic()
            sock = connect_authenticated(ps.addresses[0], 0, 0, SECRET, timeout=10)
            took = time.monotonic() - started
            sock.sendall(ps_request(protocol.Msg.PULL, 1, 0))
            response = ps_response(sock)
            weights = np.frombuffer(recv_exactly(sock, response.nbytes), np.float32)
            sock.close()
            assert hog.running()
        finally:
            hog.close()
    assert took < 2.0, took
    np.testing.assert_array_equal(weights, np.arange(6, dtype=np.float32))


def test_a_client_cut_before_its_hello_is_told_so_not_sent_to_check_the_secret(monkeypatch):
    """Evicted by a hog from its own host, or past its handshake deadline: the client's error says the listener
    dropped the connection before reading its hello. A wrong secret is still named as such."""
    delay = 0.5
    late_hellos(monkeypatch, delay)
    cases = [(FOREVER, Hog, SECRET), (0.1, None, SECRET), (FOREVER, None, b"another secret")]
    errors = []
    for handshake_timeout, hog_kind, secret in cases:
        listener = ServingListener(
            HOST,
            SECRET,
            0,
            range(1),
            lambda channel, rank: None,
            name="cut",
            max_connections=1,
            handshake_timeout=handshake_timeout,
        )
        hog = hog_kind(listener.address, 72) if hog_kind else None  # from this client's own address
        try:
            with pytest.raises(ConnectGaveUp) as info:  # shorter than the delay: one attempt, whose error is raised
                connect_authenticated(listener.address, 0, 0, secret, timeout=delay / 2)
            errors.append(info.value.last_error)
        finally:
            if hog:
                hog.close()
            listener.close()
    evicted, past_deadline, wrong_secret = errors
    for error in (evicted, past_deadline):
        assert "dropped the connection before reading this client's hello" in error, error
        assert "not a secret mismatch" in error and "secret?" not in error, error
    assert "after reading this client's proof (different job secret" in wrong_secret, wrong_secret


def test_a_silent_connection_is_dropped_at_its_handshake_deadline_while_a_real_peer_connects(caplog):
    deadline = 1.0

    def echo(channel, rank):
        data = bytearray(4)
        channel.recv_into(memoryview(data))
        channel.send([data])

    listener = ServingListener(
        HOST, SECRET, 0, range(1), echo, name="deadline", max_connections=1, handshake_timeout=deadline
    )
    try:
        silent = socket.create_connection(parse_address(listener.address), timeout=deadline + 15)
        peer = connect_channel(listener.address, 0, 0, SECRET, timeout=30, encrypt=False)
        peer.send([b"ping"])
        answer = bytearray(4)
        assert peer.recv_into(memoryview(answer)) == 4 and answer == b"ping"
        served = time.monotonic()
        peer.sock.close()
        greeting = _recv_until_closed(silent)  # a TimeoutError here: never dropped
        dropped = time.monotonic()
        silent.close()
    finally:
        listener.close()
    assert len(greeting) <= SERVER_HELLO_BYTES  # the listener's hello at most: nothing else reached it
    assert served < dropped  # the real peer was served while the silent connection was still pending
    assert listener.refused == 1  # and then its deadline dropped it
    assert logged_refusals(caplog.records, f"no authentication within {deadline}s") == 1, caplog.text


def _recv_until_closed(sock: socket.socket) -> bytes:
    received = b""
    try:
        while data := sock.recv(4096):
            received += data
    except ConnectionResetError:
        pass
    return received


def test_a_flood_of_thousands_of_refusals_writes_a_bounded_log_whose_counts_add_up(monkeypatch, caplog):
    monkeypatch.setattr(refusals, "LOG_INTERVAL", 0.5)
    started = time.monotonic()
    listener = ServingListener(HOST, SECRET, 0, range(1), lambda channel, rank: None, name="flooded", max_connections=1)
    hogs = [Hog(listener.address, 72, source=OTHER_HOST), Hog(listener.address, 8, source=OTHER_HOST, garbage=True)]
    try:
        deadline = time.monotonic() + 120
        while listener.refused < 5000:
            assert time.monotonic() < deadline, f"only {listener.refused} refusals in 120 s"
            time.sleep(0.05)
    finally:
        for hog in hogs:
            hog.close()
        listener.close()  # logs the summary of the last interval
    elapsed = time.monotonic() - started
    records = [record for record in caplog.records if record.name == refusals.__name__]
    # at most a line in full and a summary per interval, where every refusal used to log a line
    assert len(records) <= 2 * (elapsed / refusals.LOG_INTERVAL + 2), (len(records), elapsed)
    assert logged_refusals(records) == listener.refused
    assert logged_refusals(records, "evicted: more than 64 pending connections") > 0
    assert logged_refusals(records, "bad authentication code") > 0
    assert any(" × evicted: more than 64 pending connections" in record.getMessage() for record in records)
