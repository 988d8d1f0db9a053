"""The communicator's links: authentication (impostors, wrong ranks, silent and garbage peers), frames (desync,
garbage, ABORT, timeouts), and nothing received is ever unpickled, sealed or not."""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from collective_ranks import rank_data, run_ranks

from sparkdl.collective import CollectiveError, CollectiveTimeout, Listener, ReduceOp
from sparkdl.collective.api import OP_CODES
from sparkdl.collective.transport.link import Link
from sparkdl.collective.transport.mesh import Links
from sparkdl.net.auth import ConnectGaveUp
from sparkdl.net.frames import Header, Kind, dtype_code
from sparkdl.net.io import parse_address
from sparkdl.net.secure import PlainChannel, SealedChannel, connect_channel

ALLREDUCE, ALLGATHER = OP_CODES["allreduce"], OP_CODES["allgather"]


def frame(array, op=ALLREDUCE, seq=3, group=0, kind=Kind.COLLECTIVE, tag=0):
    return Header(kind, op, array.nbytes, dtype_code(array.dtype), group=group, tag=tag, seq=seq)


def send(link, array, **fields):
    link.send(frame(array, **fields), array.reshape(-1).view(np.uint8).data).result(timeout=10)


def check_link(server_link, client_link):
    send(client_link, np.arange(3, dtype=np.int64), seq=7)
    _, out = server_link.receive((Kind.COLLECTIVE, 0, 7), ALLREDUCE, np.empty(3, np.int64), None)
    np.testing.assert_array_equal(out, [0, 1, 2])


class Pair:
    """Rank 1's Links accepting (on a thread, from the start), and rank 0's address book pointing at it."""

    def __init__(self, secret, timeout=5.0, **listener_options):
        self.listeners = [Listener(), Listener(**listener_options)]
        self.addresses = [listener.address for listener in self.listeners]
        self.server = Links(1, self.addresses, self.listeners[1], secret, timeout, encrypt=False)
        self._pool = ThreadPoolExecutor(max_workers=1)
        self.accepted = self._pool.submit(self.server.link, 0)
        self.clients = []

    def client(self, secret, timeout=5.0):
        listener = Listener()
        links = Links(0, [listener.address, self.addresses[1]], listener, secret, timeout, encrypt=False)
        self.clients.append(links)
        return links

    def close(self):
        for links in [self.server, *self.clients]:
            links.close()
        for listener in self.listeners:
            listener.close()
        self._pool.shutdown(wait=False)


@pytest.fixture
def pair_of(request):
    pairs = []

    def make(*args, **kwargs):
        pairs.append(Pair(*args, **kwargs))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


# -- authentication ----------------------------------------------------------------------------------------------------


def test_wrong_secret_refused_then_real_peer_connects(pair_of):
    secret = secrets.token_bytes(32)
    pair = pair_of(secret)
    with pytest.raises(CollectiveTimeout, match="rank 0: could not connect to rank 1 .*same job secret"):
        pair.client(b"wrong secret", timeout=0.5).link(1)
    assert not pair.accepted.done()
    client = pair.client(secret).link(1)
    server = pair.accepted.result(timeout=5)
    assert (server.rank, server.peer) == (1, 0) and (client.rank, client.peer) == (0, 1)
    check_link(server, client)
    assert pair.server._acceptor.refused >= 1


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
    listener = Listener()
    links = Links(
        0, [listener.address, f"127.0.0.1:{server.getsockname()[1]}"], listener, b"secret", 0.5, encrypt=False
    )
    try:
        with pytest.raises(CollectiveTimeout, match="rank 1 failed to prove it knows the job secret"):
            links.link(1)
    finally:
        links.close()
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_garbage_and_silent_peers_do_not_block_real_peer(pair_of):
    secret = secrets.token_bytes(32)
    # The silent and short connections are not dropped for their silence within the real peer's few milliseconds:
    # it gets through only because no one waits on them.
    pair = pair_of(secret, timeout=10.0, handshake_timeout=3600.0)
    address = parse_address(pair.addresses[1])
    silent = socket.create_connection(address)
    garbage = socket.create_connection(address)
    garbage.sendall(os.urandom(68))  # a full-length, but forged, client hello
    short = socket.create_connection(address)
    short.sendall(os.urandom(10))
    client = pair.client(secret, timeout=10.0).link(1)
    check_link(pair.accepted.result(timeout=30), client)
    garbage.settimeout(10)
    garbage.recv(100)  # the server hello
    assert garbage.recv(100) == b""  # then dropped
    for sock in (silent, garbage, short):
        sock.close()


def test_peer_with_valid_secret_but_wrong_rank_is_refused(pair_of):
    secret = secrets.token_bytes(32)
    pair = pair_of(secret)
    with pytest.raises(ConnectGaveUp):  # a higher rank never connects to a lower one
        connect_channel(pair.addresses[1], 2, 1, secret, 0.5, encrypt=False)
    with pytest.raises(ConnectGaveUp):  # rank 0, but towards another rank than the listener's
        connect_channel(pair.addresses[1], 0, 2, secret, 0.5, encrypt=False)
    assert not pair.accepted.done()
    client = pair.client(secret).link(1)  # the real rank 0 still gets in
    check_link(pair.accepted.result(timeout=5), client)


def test_only_impostors_end_in_timeout_not_hang(pair_of):
    pair = pair_of(b"real", timeout=1.0)
    silent = socket.create_connection(parse_address(pair.addresses[1]))
    # The link's own 1 s timeout ends the wait (its message), long before the 30 s result() would.
    with pytest.raises(CollectiveTimeout, match="rank 1: no authenticated connection from rank 0"):
        pair.accepted.result(timeout=30)
    silent.close()


# -- frames --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def link_pair():
    a, b = socket.socketpair()
    sender, receiver = Link(PlainChannel(a), 0, 1, timeout=1.0), Link(PlainChannel(b), 1, 0, timeout=0.2)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize(
    "sent, op, seq, expected, names",
    [
        (np.zeros(4, np.float32), ALLREDUCE, 3, np.empty(5, np.float32), ("16 bytes", "20 bytes")),  # wrong size
        (np.zeros(4, np.int32), ALLREDUCE, 3, np.empty(4, np.float32), ("int32", "float32")),  # wrong dtype
        (np.zeros(4, np.float32), ALLGATHER, 3, np.empty(4, np.float32), ("allgather", "allreduce")),  # wrong op
        (np.zeros(4, np.float32), ALLREDUCE, 4, np.empty(4, np.float32), ("#3", "#4")),  # wrong sequence
    ],
)
def test_frame_mismatch_is_out_of_step_naming_both(link_pair, sent, op, seq, expected, names):
    sender, receiver = link_pair
    send(sender, sent, op=op, seq=seq)
    with pytest.raises(CollectiveError, match="rank 1: out of step with rank 0") as info:
        receiver.receive((Kind.COLLECTIVE, 0, 3), ALLREDUCE, expected, None)
    for name in names:
        assert name in str(info.value)


def test_matching_frame_round_trips(link_pair):
    sender, receiver = link_pair
    data = np.arange(6, dtype=np.complex128)
    send(sender, data)
    out = np.empty(6, dtype=np.complex128)
    header, received = receiver.receive((Kind.COLLECTIVE, 0, 3), ALLREDUCE, out, None)
    assert received is out and header.seq == 3
    np.testing.assert_array_equal(out, data)


def test_frames_of_other_groups_and_tags_are_kept_not_out_of_step(link_pair):
    sender, receiver = link_pair
    send(sender, np.array([1.0]), group=9, seq=0)  # another group's collective
    send(sender, np.array([2.0]), kind=Kind.MESSAGE, tag=5, seq=0)  # a message
    send(sender, np.array([3.0]), seq=3)
    _, out = receiver.receive((Kind.COLLECTIVE, 0, 3), ALLREDUCE, np.empty(1), None)
    assert out.tolist() == [3.0]
    _, out = receiver.receive((Kind.MESSAGE, 0, 5), ALLREDUCE, None, np.dtype(np.float64))
    assert out.tolist() == [2.0]
    _, out = receiver.receive((Kind.COLLECTIVE, 9, 0), ALLREDUCE, np.empty(1), None)
    assert out.tolist() == [1.0]


def test_garbage_frame_is_rejected(link_pair):
    sender, receiver = link_pair
    sender.channel.sock.sendall(os.urandom(64))
    with pytest.raises(CollectiveError, match="corrupt frame from rank 0"):
        receiver.receive((Kind.COLLECTIVE, 0, 0), ALLREDUCE, np.empty(4, np.float32), None)


def test_abort_frame_fails_the_receiver_with_the_peers_reason(link_pair):
    sender, receiver = link_pair
    sender.abort("rank 0 failed in allgather: a reason")
    with pytest.raises(
        CollectiveError, match="rank 1: allreduce failed: rank 0 gave up: rank 0 failed in allgather: a"
    ):
        receiver.receive((Kind.COLLECTIVE, 0, 0), ALLREDUCE, np.empty(4, np.float32), None)


def test_recv_timeout_and_closed_peer(link_pair):
    sender, receiver = link_pair
    with pytest.raises(CollectiveTimeout, match=r"rank 1: allreduce timed out after 0.2s .*rank 0"):
        receiver.receive((Kind.COLLECTIVE, 0, 0), ALLREDUCE, np.empty(4, np.float32), None)
    sender.close()
    with pytest.raises(CollectiveError, match="rank 0 closed the connection during allreduce"):
        receiver.receive((Kind.COLLECTIVE, 0, 0), ALLREDUCE, np.empty(4, np.float32), None)


# -- sends from the caller's thread, and behind the sender thread ------------------------------------------------------


def links_over_socketpair(encrypt: bool, buffer_bytes: int | None = None) -> tuple[Link, Link]:
    """Rank 0's link (the sender) and rank 1's, over one socket pair, plain or sealed; ``buffer_bytes`` shrinks the
    sockets' buffers so that a test can fill them."""
    a, b = socket.socketpair()
    if buffer_bytes is not None:
        for sock in (a, b):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    if encrypt:
        secret, proof = secrets.token_bytes(32), secrets.token_bytes(32)
        channels = (
            SealedChannel(a, secret, proof, is_client=True, peer="rank 1"),
            SealedChannel(b, secret, proof, is_client=False, peer="rank 0"),
        )
    else:
        channels = (PlainChannel(a), PlainChannel(b))
    return Link(channels[0], 0, 1, timeout=10.0), Link(channels[1], 1, 0, timeout=10.0)


def message(link: Link, array: np.ndarray, tag: int):
    header = Header(Kind.MESSAGE, OP_CODES["send"], array.nbytes, dtype_code(array.dtype), tag=tag)
    return link.send(header, array.reshape(-1).view(np.uint8).data)


def received(link: Link, tag: int) -> np.ndarray:
    return link.receive((Kind.MESSAGE, 0, tag), OP_CODES["send"], None, np.dtype(np.int32))[1]


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_small_send_on_an_idle_link_is_written_before_send_returns_without_the_sender_thread(encrypt):
    sender, receiver = links_over_socketpair(encrypt)
    try:
        futures = [message(sender, np.full(64, i, np.int32), tag=i) for i in range(20)]
        assert all(future.done() and future.exception() is None for future in futures)  # written, not queued
        assert not [thread for thread in threading.enumerate() if thread.name.startswith("sparkdl-rank0-to1")]
        for i in range(20):
            np.testing.assert_array_equal(received(receiver, i), np.full(64, i, np.int32))
        assert sender.bytes_sent == receiver.bytes_received == 20 * 64 * 4
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_sends_arrive_in_the_order_sent_when_the_socket_is_full(encrypt):
    """A frame the socket takes only part of is finished by the sender thread, and every send after it, small or
    large, waits behind it: the receiver, reading only once all were sent, gets each whole and in order."""
    sender, receiver = links_over_socketpair(encrypt, buffer_bytes=64 << 10)
    sizes = [16, 200_000, 16, 2_000_000, 16, 16, 100_000, 16]  # int32 values: 64 B to 8 MB a frame
    arrays = [np.arange(size, dtype=np.int32) * (i + 1) for i, size in enumerate(sizes)]
    try:
        futures = [message(sender, array, tag=0) for array in arrays]  # one tag: received in the order they arrive
        assert not futures[1].done()  # 800 KB into 64 KiB buffers nobody reads: its rest went to the sender thread
        assert not futures[2].done()  # the small frame behind it waits for it rather than overtaking
        for array in arrays:
            np.testing.assert_array_equal(received(receiver, 0), array)
        for future in futures:
            future.result(timeout=10)
        assert sender.bytes_sent == receiver.bytes_received == sum(sizes) * 4
        message(sender, np.arange(8, dtype=np.int32), tag=0).result(timeout=0)  # idle again: written at once
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_small_send_waits_behind_a_queued_send_even_when_the_socket_has_room(encrypt):
    sender, receiver = links_over_socketpair(encrypt)
    gate = threading.Event()
    sender._sender.submit(gate.wait)  # the sender thread held up, between two sends, as a busy machine may hold it
    try:
        large = message(sender, np.arange(1 << 19, dtype=np.int32), tag=0)  # 2 MiB: queued
        small = message(sender, np.arange(4, dtype=np.int32), tag=0)
        assert not large.done() and not small.done()  # both wait for the sender thread, in the order sent
        gate.set()
        np.testing.assert_array_equal(received(receiver, 0), np.arange(1 << 19, dtype=np.int32))
        np.testing.assert_array_equal(received(receiver, 0), np.arange(4, dtype=np.int32))
    finally:
        gate.set()
        sender.close()
        receiver.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_sends_arrive_in_the_order_sent_while_the_peer_reads(encrypt):
    """Small and large frames mixed, the peer reading as they come: a small frame is written from the caller's thread
    only when nothing it sent before is still queued, so none overtakes another."""
    sender, receiver = links_over_socketpair(encrypt, buffer_bytes=64 << 10)
    rng = np.random.default_rng(0)
    arrays = [np.full(int(size), i, np.int32) for i, size in enumerate(rng.choice([4, 40, 400_000], size=300))]
    with ThreadPoolExecutor(max_workers=1) as reader:
        arrived = reader.submit(lambda: [received(receiver, 0) for _ in arrays])
        try:
            futures = [message(sender, array, tag=0) for array in arrays]
            for got, array in zip(arrived.result(timeout=60), arrays):
                np.testing.assert_array_equal(got, array)
            for future in futures:
                future.result(timeout=10)
        finally:
            sender.close()
            receiver.close()


# -- never unpickled, sealed or not ------------------------------------------------------------------------------------


@pytest.mark.parametrize("encrypt", [False, True])
def test_every_operation_runs_without_unpickling_anything(monkeypatch, encrypt):
    def refuse(*args, **kwargs):
        raise AssertionError("something received was unpickled")

    for name in ("loads", "load"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)

    def body(comm):
        r, n = comm.rank, comm.size
        x = rank_data(r, (11, 2), np.float32)
        results = [
            comm.allreduce(x, algorithm=algorithm, op=op)
            for algorithm in ("ring", "tree", "naive")
            for op in (ReduceOp.SUM, ReduceOp.MAX)
        ]
        results += [
            comm.reduce(x, root=1),
            comm.broadcast(x, root=2, algorithm="ring"),
            comm.allgather(x, algorithm="naive"),
            comm.reduce_scatter(x),
            comm.gather(x, root=0),
            comm.scatter([x[: j + 1] for j in range(n)] if r == 1 else None, root=1),
            comm.allgather_v(x[: r + 1]),
            comm.alltoall([x[:j] for j in range(n)]),
            comm.allreduce_async(x).wait(),
        ]
        comm.barrier()
        comm.send(x, (r + 1) % n, tag=4)
        results.append(comm.recv((r - 1) % n, tag=4))
        return results

    results = run_ranks(3, body, encrypt=encrypt)
    inputs = [rank_data(r, (11, 2), np.float32) for r in range(3)]
    for r, got in enumerate(results):
        np.testing.assert_array_equal(got[0], np.sum(inputs, axis=0))
        np.testing.assert_array_equal(got[1], np.max(inputs, axis=0))
        np.testing.assert_array_equal(got[-1], inputs[(r - 1) % 3])
