"""Real attackers for the network tests: connections that hog a listener, its rate-limited log read back,
parameter-server frames made by hand, and another user's process squatting Unix socket names."""

from __future__ import annotations

import os
import re
import selectors
import socket
import subprocess
import threading

from sparkdl.net import refusals
from sparkdl.net.auth import CLIENT_HELLO
from sparkdl.net.frames import HEADER, Header, Kind
from sparkdl.net.io import parse_address
from sparkdl.ps import protocol

HOST = "127.0.0.1"
#: Another host to a listener on HOST: Linux routes all of 127/8 to lo.
OTHER_HOST = "127.0.0.2"


class Hog:
    """Holds ``count`` unauthenticated connections to ``address`` and re-opens each one the listener drops.

    They stay idle, or with ``garbage`` each sends a hello's worth of random bytes. ``source`` is the address they
    come from: another loopback address (Linux routes all of 127/8 to lo) is another host to the listener.
    """

    def __init__(self, address: str, count: int, *, source: str = HOST, garbage: bool = False):
        self._address = parse_address(address)
        self._source = (source, 0)
        self._garbage = garbage
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._missing = 0  # dropped connections not yet re-opened (the listener refused or timed out a connect)
        self.opened = 0
        for _ in range(count):
            self._open()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> None:
        sock = socket.create_connection(self._address, timeout=2, source_address=self._source)
        try:
            if self._garbage:
                sock.sendall(os.urandom(CLIENT_HELLO.size))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def _reopen(self) -> None:
        while self._missing and not self._stop.is_set():
            try:
                self._open()
            except OSError:  # the listener's backlog is full, or it is closing: try again on the next round
                return
            self._missing -= 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._reopen()
            for key, _ in self._selector.select(0.05):
                try:
                    data = key.fileobj.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # dropped: take the slot again
                    self._selector.unregister(key.fileobj)
                    key.fileobj.close()
                    self._missing += 1

    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the hog's thread did not stop"
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()


#: Another user where the tests run as root (their uid otherwise): any local user may bind an abstract socket name.
OTHER_USER = 65534 if os.geteuid() == 0 else None

_SQUAT = r"""
import socket, sys
held = []
for name in sys.argv[2:]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    if sys.argv[1] == "listening":
        sock.listen(1)
    held.append(sock)
print("held", flush=True)
sys.stdin.read()
"""


class Squatter:
    """A process of :data:`OTHER_USER` that binds the abstract Unix socket ``names`` (without their leading NUL, as
    /proc/net/unix lists them after an @), and listens on them if ``listening``, until :meth:`close`."""

    def __init__(self, names: list[str], *, listening: bool):
        self.process = subprocess.Popen(
            ["/usr/bin/python3", "-c", _SQUAT, "listening" if listening else "bound", *names],
            user=OTHER_USER,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout.readline() == "held\n", "the squatter could not bind every name"

    def __enter__(self) -> Squatter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.process.communicate("", timeout=30)


def logged_refusals(records, reason: str = "") -> int:
    """The refusals (whose reason starts with ``reason``) that the listeners' rate-limited log accounts for: one for
    each line logged in full, and each summary's count of them."""
    count = 0
    for record in records:
        if record.name != refusals.__name__:
            continue
        message = record.getMessage()
        if ": refused a connection: " in message:
            count += message.split(": refused a connection: ", 1)[1].startswith(reason)
        else:
            summary = re.fullmatch(r".*: refused ([\d,]+) more connections? in the last [\d.]+ s: (.*)", message)
            assert summary, message
            counts = dict((why, int(n.replace(",", ""))) for n, why in _SUMMED.findall(summary[2]))
            assert sum(counts.values()) == int(summary[1].replace(",", "")), message
            count += sum(n for why, n in counts.items() if why.startswith(reason))
    return count


_SUMMED = re.compile(r"([\d,]+) × (.+?)(?=, [\d,]+ × |$)")


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"closed after {len(data)} of {size} bytes"
        data += chunk
    return data


def ps_request(msg: int, seq: int, nbytes: int, **fields) -> bytes:
    """A parameter-server request header as a real client packs it; ``fields`` override any of its fields."""
    values = dict(kind=Kind.REQUEST, op=msg, dtype=protocol.request_dtype(msg), seq=seq, nbytes=nbytes)
    return Header(**{**values, **fields}).pack()


def ps_response(sock: socket.socket) -> Header:
    """The next parameter-server response header on ``sock`` (its payload is left unread)."""
    return Header.unpack(recv_exactly(sock, HEADER.size), source="the parameter server")
