"""The emulated network: host namespaces joined by veth pairs to a bridge, shaped by tbf, delayed or made lossy by
NFQUEUE, links cut and restored; optionally this machine's own namespace on the bridge too.

Every host is a Linux network namespace with one interface, ``eth0``, the end of a veth pair whose other end is a
port of one bridge in a namespace of its own (the switch). Addresses are in 198.18.0.0/15 (RFC 2544's benchmarking
range); no route leads out of any namespace: no traffic leaves this machine. With ``root_port`` the root namespace
(this process's) has a port on the bridge as well, so that a process started here (a Spark driver) reaches the hosts
and they reach it; then each network takes a /24 of its own, so that networks of several processes do not meet.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile

from hostnet import nfqueue
from hostnet.processes import Started, gone, kill_all, namespace_processes, readline, run

PREFIX = "sdlhn"  # every namespace's and scratch folder's name starts with it, then the creating process's id
#: The switch's address on the bridge (the last of the /24): services of the network (a Spark master) listen there.
SWITCH_HOST = 253
ROOT_HOST = 254  # this machine's own namespace's address on the bridge, with ``root_port``


class Network(Started):
    """``hosts`` namespaces with a veth each to one bridge (in a namespace of its own); shaped, impaired and cut on
    demand. Use it as a context manager: everything it made is removed at the end, the processes left in its
    namespaces killed."""

    def __init__(self, hosts: int, *, root_port: bool = False, python_program: bool = False):
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self.root_port = root_port
        self.subnet = _free_subnet() if root_port else "198.18.0"
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(hosts)]
        self.switch_address = f"{self.subnet}.{SWITCH_HOST}"
        self.root_address = f"{self.subnet}.{ROOT_HOST}" if root_port else None
        self.impairment: tuple[float, float] = (0.0, 0.0)  # (delay seconds, loss fraction) of every host's arrivals
        self._python_program = python_program
        self._program: str | None = None
        self._scratch: str | None = None
        self._created: list[str] = []
        self._daemons: dict[str, subprocess.Popen] = {}  # host -> its NFQUEUE process

    def start(self) -> None:
        remove_abandoned()
        run("ip", "netns", "add", self.switch)
        self._created.append(self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "addr", "add", f"{self.switch_address}/24", "dev", "br0")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        run("ip", "-n", self.switch, "link", "set", "lo", "up")
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
        if self.root_port:
            run("ip", "link", "add", self.root_device, "type", "veth", "peer", "name", "proot", "netns", self.switch)
            run("ip", "-n", self.switch, "link", "set", "proot", "master", "br0")
            run("ip", "-n", self.switch, "link", "set", "proot", "up")
            run("ip", "addr", "add", f"{self.root_address}/24", "dev", self.root_device)
            run("ip", "link", "set", self.root_device, "up")

    @property
    def root_device(self) -> str:
        """The root namespace's end of its veth to the bridge (at most 15 characters, as every device name)."""
        return f"{self.prefix}-r"

    def sysctl(self, namespace: str, key: str, value: str) -> None:
        run("ip", "netns", "exec", namespace, "sh", "-c", f"echo {value} > /proc/sys/{key}")

    def exec_in(self, host: int) -> list[str]:
        """The command prefix that runs a program in host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host]]

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

    def impair(self, delay: float = 0.0, loss: float = 0.0) -> None:
        """Every packet arriving at a host is held ``delay`` seconds, or dropped with probability ``loss`` (0 and 0:
        neither). Packets reach the NFQUEUE process through an ``iptables`` rule in each host's raw PREROUTING
        chain; every packet, data and acknowledgement, meets it once, on arrival: a one-way delay (the round trip
        grows by twice ``delay``), and a loss of ``loss`` on every path between two hosts."""
        self._stop_impairment()
        self.impairment = (delay, loss)
        if delay <= 0 and loss <= 0:
            return
        command = nfqueue.command(self.program(), delay, loss)
        for host in self.hosts:
            run(
                "ip", "netns", "exec", host, "iptables", "-t", "raw", "-A", "PREROUTING", "-i", "eth0",
                "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass",
            )  # fmt: skip
            daemon = subprocess.Popen(
                ["ip", "netns", "exec", host, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            self._daemons[host] = daemon
            line = readline(daemon, 30)
            if line.strip() != "ready":
                raise RuntimeError(f"the NFQUEUE process of {host} did not start: {line} {daemon.stderr.read()}")

    def program(self) -> str | None:
        """The compiled NFQUEUE process (built on first use), or None where the Python one runs."""
        if self._program is None and not self._python_program:
            self._scratch = self._scratch or tempfile.mkdtemp(prefix=f"{self.prefix}-")
            self._program = nfqueue.compile_program(self._scratch)
            self._python_program = self._program is None
        return self._program

    def _stop_impairment(self) -> None:
        for daemon in self._daemons.values():
            with contextlib.suppress(ProcessLookupError):
                daemon.kill()
            daemon.wait()
        self._daemons.clear()
        for host in self.hosts:
            if host in self._created:
                run("ip", "netns", "exec", host, "iptables", "-t", "raw", "-F", check=False)

    def link(self, host: int, up: bool) -> None:
        """Host ``host``'s cable to the switch plugged in or pulled: its switch port up or down (the host's ``eth0``
        loses its carrier; its address, routes and sockets stay)."""
        run("ip", "-n", self.switch, "link", "set", f"p{host}", "up" if up else "down")

    def processes(self, host: int | None = None) -> list[int]:
        """The ids of the processes in this network's namespaces (in host ``host``'s only, if given)."""
        return namespace_processes(self._created if host is None else [self.hosts[host]])

    def close(self) -> None:
        self._stop_impairment()
        kill_all(self.processes())
        for namespace in reversed(self._created):
            run("ip", "netns", "del", namespace, check=False)
        self._created.clear()
        if self.root_port:
            run("ip", "link", "del", self.root_device, check=False)  # gone with the switch already, as a rule
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


def _free_subnet() -> str:
    """A /24 of 198.19.0.0/16 that no route of this machine's namespace uses (picked from this process's id)."""
    used = run("ip", "-4", "route", "show").stdout
    for step in range(256):
        candidate = f"198.19.{(os.getpid() + step) % 256}"
        if f"{candidate}.0/24" not in used:
            return candidate
    raise RuntimeError("no free /24 left in 198.19.0.0/16 for an emulated network")


def remove_abandoned() -> list[str]:
    """Removes what networks of processes that no longer run left behind (killed before their ``close``): their
    namespaces, the processes still in them, their scratch folders. Returns the namespaces removed."""
    names = run("ip", "netns", "list", check=False).stdout.split()
    mine = [name for name in names if name.startswith(PREFIX) and "-" in name]
    abandoned = [name for name in mine if not _alive(name[len(PREFIX) : name.index("-")])]
    kill_all(namespace_processes(abandoned))
    for name in abandoned:
        run("ip", "netns", "del", name, check=False)
    scratch = tempfile.gettempdir()
    for entry in os.listdir(scratch):
        if entry.startswith(PREFIX) and "-" in entry and not _alive(entry[len(PREFIX) : entry.index("-")]):
            shutil.rmtree(os.path.join(scratch, entry), ignore_errors=True)
    return abandoned


def _alive(pid: str) -> bool:
    return pid.isdigit() and not gone(int(pid))


def available() -> str | None:
    """Why the emulation cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
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


def impairment_available() -> str | None:
    """Why packets cannot be delayed or dropped here (``impair``), or None."""
    if shutil.which("iptables") is None:
        return "`iptables` is not installed (apt-get install iptables): packets cannot be steered to NFQUEUE"
    return None
