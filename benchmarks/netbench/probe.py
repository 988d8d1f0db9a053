"""One link measured: a TCP stream and a 1-byte ping-pong between two hosts; the delay calibrated on them."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time

from hostnet.network import Network
from hostnet.processes import die_with_parent, readline, run

from netbench.common import SCRIPT
from sparkdl.net.io import tune


def _tuned_socket() -> socket.socket:
    """A TCP socket tuned as sparkdl's links are (``sparkdl.net.io.tune``), so the comparison is fair."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tune(sock)
    return sock


def probe_server_main(host: str) -> None:
    die_with_parent()
    server = _tuned_socket()
    server.bind((host, 0))
    server.listen(1)
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    buffer = bytearray(1 << 20)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        left = int.from_bytes(head, "big")
        while left:
            left -= conn.recv_into(buffer, min(len(buffer), left))
        conn.sendall(b"k")


def probe_client_main(target: str, nbytes: int, pings: int) -> None:
    die_with_parent()
    host, port = target.rsplit(":", 1)
    conn = _tuned_socket()
    conn.connect((host, int(port)))
    rtts = []
    for _ in range(pings):
        start = time.perf_counter()
        conn.sendall((1).to_bytes(8, "big") + b"p")
        conn.recv(1)
        rtts.append(time.perf_counter() - start)
    payload = bytes(nbytes)
    streams = []
    for _ in range(3):
        start = time.perf_counter()
        conn.sendall(nbytes.to_bytes(8, "big"))
        conn.sendall(payload)
        conn.recv(1)
        streams.append(time.perf_counter() - start)
    conn.close()
    rtts = rtts[len(rtts) // 10 :]  # the first ones open the path (ARP, slow start)
    print(json.dumps({"rtt": statistics.median(rtts), "rtt_min": min(rtts), "stream": [nbytes / t for t in streams]}))


def probe(network: Network, nbytes: int, pings: int = 200) -> dict:
    """One TCP stream and a 1-byte ping-pong from host 0 to host 1."""
    server = subprocess.Popen(
        [*network.exec_in(1), sys.executable, SCRIPT, "--role", "probe-server", "--host", network.addresses[1]],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        port = readline(server, 30).strip()
        client = run(
            *network.exec_in(0), sys.executable, SCRIPT, "--role", "probe-client",
            "--target", f"{network.addresses[1]}:{port}", "--bytes", str(nbytes), "--pings", str(pings),
        )  # fmt: skip
        return json.loads(client.stdout)
    finally:
        server.kill()
        server.wait()


def calibrate_delay(network: Network, delay: float, nbytes: int) -> dict:
    """Sets the per-host delay so that the round trip grows by 2 ``delay``; returns the probes.

    The process wakes, and the kernel reinjects, a little after each packet is due: the round trip
    overshoots by a few tens of microseconds. Up to three rounds of pings take half the error off the
    setting each time (never below 0); the last probe, with a stream, is what the tables print.
    """
    network.impair(delay=0)
    base = probe(network, nbytes)
    if delay <= 0:
        return {"base": base, "delayed": base, "set": 0.0}
    target, setting = base["rtt"] + 2 * delay, delay
    for _ in range(3):
        network.impair(delay=setting)
        rtt = probe(network, 1 << 16, pings=100)["rtt"]
        if abs(rtt - target) < 0.05 * target:
            break
        setting = max(0.0, setting + (target - rtt) / 2)
    network.impair(delay=setting)
    delayed = probe(network, nbytes)
    return {"base": base, "delayed": delayed, "set": setting, "target_rtt": target}
