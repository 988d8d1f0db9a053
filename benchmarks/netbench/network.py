"""The emulated network: host namespaces joined by veth pairs to a bridge, shaped by tbf, delayed by NFQUEUE."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

from netbench.common import SCRIPT, SUBNET, readline, run


class Network:
    """``hosts`` namespaces with a veth each to one bridge (in a namespace of its own); shaped and delayed on demand."""

    def __init__(self, hosts: int):
        self.prefix = f"sdlnp{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self._created: list[str] = []
        self._daemons: list[subprocess.Popen] = []
        self.delay_set = 0.0
        self.delay_binary: str | None = None

    def create(self) -> None:
        run("ip", "netns", "add", self.switch)
        self._created.append(self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, (host, address) in enumerate(zip(self.hosts, self.addresses)):
            run("ip", "netns", "add", host)
            self._created.append(host)
            run(
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                host,
                "type",
                "veth",
                "peer",
                "name",
                f"p{i}",
                "netns",
                self.switch,
            )
            run("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            run("ip", "-n", self.switch, "link", "set", f"p{i}", "up")
            self.sysctl(host, "net/ipv6/conf/all/disable_ipv6", "1")  # no router solicitations in the counters
            run("ip", "-n", host, "addr", "add", f"{address}/24", "dev", "eth0")
            run("ip", "-n", host, "link", "set", "eth0", "up")
            run("ip", "-n", host, "link", "set", "lo", "up")

    def sysctl(self, namespace: str, key: str, value: str) -> None:
        run("ip", "netns", "exec", namespace, "sh", "-c", f"echo {value} > /proc/sys/{key}")

    def shape(self, rate: float | None) -> None:
        """Every host's link at ``rate`` bits/s up and down (None: unshaped).

        The bucket holds 150 us of the rate (at least 24 KB) and packets are cut to at most two thirds
        of it (``gso_max_size``), so nothing passes much faster than the rate: at 1 Gbit/s 24 KB
        (0.2 ms), at 10 Gbit/s 187 KB.
        """
        for i, host in enumerate(self.hosts):
            for namespace, device in ((host, "eth0"), (self.switch, f"p{i}")):
                run("tc", "-n", namespace, "qdisc", "del", "dev", device, "root", check=False)
                if rate is None:
                    run("ip", "-n", namespace, "link", "set", device, "gso_max_size", "65536")
                    continue
                burst = max(24 << 10, int(rate / 8 * 150e-6))
                gso = 16384 if burst < 96 << 10 else 65536
                run("ip", "-n", namespace, "link", "set", device, "gso_max_size", str(gso))
                run(
                    "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
                    "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "200ms",
                )  # fmt: skip

    def start(self, host: int, role: str) -> subprocess.Popen:
        """``network_patterns.py --role ROLE`` in host ``host``'s namespace at ``nice -10``, on its address; JSON lines
        in and out."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host], "nice", "-n", "-10", sys.executable, SCRIPT, "--role", role, "--host", self.addresses[host]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def delay(self, seconds: float) -> None:
        """Every packet arriving at a host is held ``seconds`` (0: none): see the module's docstring."""
        self.stop_delay()
        self.delay_set = seconds
        if seconds <= 0:
            return
        for host in self.hosts:
            run(
                "ip", "netns", "exec", host, "iptables", "-t", "raw", "-A", "PREROUTING", "-i", "eth0",
                "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass",
            )  # fmt: skip
            command = (
                [self.delay_binary, str(int(seconds * 1e9))]
                if self.delay_binary
                else [sys.executable, SCRIPT, "--role", "delay", "--delay-s", repr(seconds)]
            )
            daemon = subprocess.Popen(
                ["ip", "netns", "exec", host, *command],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            self._daemons.append(daemon)
            line = readline(daemon, 30)
            if line.strip() != "ready":
                raise RuntimeError(f"the delay process of {host} did not start: {line} {daemon.stderr.read()}")

    def stop_delay(self) -> None:
        for daemon in self._daemons:
            with contextlib.suppress(ProcessLookupError):
                daemon.kill()
            daemon.wait()
        self._daemons.clear()
        for host in self.hosts:
            if host in self._created:
                run("ip", "netns", "exec", host, "iptables", "-t", "raw", "-F", check=False)

    def close(self) -> None:
        self.stop_delay()
        for namespace in reversed(self._created):
            run("ip", "netns", "del", namespace, check=False)
        self._created.clear()


def available() -> str | None:
    """Why the emulation cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"sdlnp{os.getpid()}-probe"
    try:
        result = run("ip", "netns", "add", probe, check=False)
        if result.returncode != 0:
            return f"`ip netns add` failed: {result.stderr.strip()}"
        veth = run(
            "ip", "-n", probe, "link", "add", "name", "sdlnpa", "type", "veth", "peer", "name", "sdlnpb", check=False
        )
        if veth.returncode != 0:
            return f"no veth pairs: {veth.stderr.strip()}"
        tbf = run("tc", "-n", probe, "qdisc", "add", "dev", "sdlnpa", "root", "tbf", "rate", "1gbit", "burst", "32k", "latency", "1ms", check=False)  # fmt: skip
        if tbf.returncode != 0:
            return f"no tbf qdisc: {tbf.stderr.strip()}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


def delay_available() -> str | None:
    if shutil.which("iptables") is None:
        return "`iptables` is not installed (apt-get install iptables): no latency is added"
    return None
