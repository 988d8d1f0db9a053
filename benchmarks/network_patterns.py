"""Every collective pattern on emulated networks, measured side by side, and the cost model fitted on them.

Usage (as root): python benchmarks/network_patterns.py [--rates 1gbit 10gbit] [--delays 0.1ms 1ms]
       [--ranks 2 3 4] [--sizes 100K 1M 16M 64M] [--repeats 5] [--large-repeats 2] [--no-hierarchical]
       [--patterns allreduce:ring ...] [--json results.json] [--from-json results.json] [--quick]

The defaults take about 5 minutes on a 2-core machine; ``--sizes 100K 1M 16M 64M 256M`` (the run in
docs/benchmarks.md) 20 minutes; ``--quick`` (1 Gbit/s, 0.1 ms, N = 2 and 4, to 64 MB) 1.5 minutes.

Each rank runs in a Linux network namespace of its own (its "host"), joined to the others by a veth
pair to a bridge in one more namespace (the "switch"). Every host's link is shaped in both directions
with a token bucket (``tbf``: on the host's side for what it sends, on the switch's port for what it
receives), so a host has the given rate up and down at once, as a full-duplex NIC on a switch has.
Addresses are in 198.18.0.0/24 (RFC 2544's benchmarking range); the switch has no other port and no
route leads out of any namespace: no traffic leaves this machine. Everything is created by the script
and removed in a ``finally`` (also on Ctrl-C and SIGTERM); without root, or where ``ip netns`` fails,
it says why and exits 0.

**Latency** (this kernel has no ``netem``, ``fq`` or ``etf``, the qdiscs that delay packets): each
host's arriving packets are queued to user space (iptables ``NFQUEUE`` in the host's raw PREROUTING
chain) and a small process per host (:data:`DELAY_C`, compiled at start where a C compiler is, else
``--role delay`` in Python; SCHED_FIFO; metadata only: no payload is copied) accepts each one
``delay`` after it arrived, in arrival order, by batch verdicts. Every packet,
data and acknowledgement, is held once on arrival: a one-way delay, so the round trip grows by twice
the delay. Packets are held after the kernel has detached them from the sending socket, so TCP's
small-queue limit does not throttle the sender (as it would if they were held on the way out), and
they are queued whole (GSO) so their number stays small. The delay is calibrated: the round trip is
measured with the delay off and on, and the overshoot (the time to wake the process and reinject)
taken off the setting until the round trip is within 5% of its target (:func:`calibrate_delay`);
both round trips are printed. Without ``iptables`` no delay is added
(the script says so) and ``alpha`` is fitted on the path's own latency.

For each network (rate x delay) it prints one TCP stream's throughput and round trip between two
hosts, then runs, for N = ``--ranks`` hosts of one rank each, the allreduce by ring, naive and tree,
ZeRO's reduce-scatter and allgather (ring; allgather also naive), and the broadcast by ring and tree,
for every size; and with ``--hierarchical`` (the default when 4 is among the ranks) four ranks on two
hosts, two each, sharing memory within a host: the hierarchical allreduce against the ring and the
naive one over the same ranks. Sizes are the bytes of the model (K): allreduce, reduce-scatter and
broadcast move a K-byte array, allgather gathers K (K/N from each rank). Each call is timed after a
barrier from the first rank's start to the last rank's return, on the one monotonic clock every
namespace shares; the tables give the median of the repeats ([min-max]: the machine's noise).

Bytes are counted on each host's interface (``/proc/net/dev`` in its namespace: the wire's bytes,
TCP/IP headers and acknowledgements included) and by the communicator (payload), per call.

Then it fits :mod:`sparkdl.collective.cost` (``alpha`` per serial step, ``beta`` per byte on the busiest
link, ``gamma`` per byte reduced or copied, ``delta`` per byte of all links together: the one
machine's CPUs that carry every emulated host's packets) per network: per algorithm, every term
free; and one set for the network, ``beta`` pinned to the measured stream, the rest fitted over every
algorithm. It prints every measured point against its algorithm's fit, the points beyond 25%, the
interfaces' byte counts of ring against naive, and the network's fit (without ``delta``) predicting
N up to 1024 and models up to 1e9 parameters.
``--from-json`` redoes the fits and tables from a saved run without root.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sparkdl.collective import cost  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
SUBNET = "198.18.0"  # RFC 2544: reserved for benchmarking; these addresses exist only in the namespaces
SOCKET_BYTES = 4 << 20  # sparkdl.net.io.SOCKET_BUFFER_BYTES: the probe's sockets are tuned like the links
#: (operation, algorithm) of the one-rank-per-host sessions, in the order each size runs them.
FLAT = (
    ("allreduce", "ring"),
    ("allreduce", "naive"),
    ("allreduce", "tree"),
    ("reduce_scatter", "ring"),
    ("allgather", "ring"),
    ("allgather", "naive"),
    ("broadcast", "ring"),
    ("broadcast", "tree"),
)
#: ... and of the two-ranks-per-host session.
TWO_PER_HOST = (("allreduce", "hierarchical"), ("allreduce", "ring"), ("allreduce", "naive"))
PATTERN = {
    ("allreduce", "ring"): "ring_allreduce",
    ("allreduce", "naive"): "naive_allreduce",
    ("allreduce", "tree"): "tree_allreduce",
    ("allreduce", "hierarchical"): "hierarchical_allreduce",
    ("reduce_scatter", "ring"): "ring_reduce_scatter",
    ("allgather", "ring"): "ring_allgather",
    ("allgather", "naive"): "naive_allgather",
    ("broadcast", "ring"): "ring_broadcast",
    ("broadcast", "tree"): "tree_broadcast",
}
PR_SET_PDEATHSIG, PR_SET_TIMERSLACK = 1, 29


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)B?", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; expected e.g. 100K, 16M, 1G")
    return int(match.group(1)) * UNITS.get(match.group(2), 1)


def parse_rate(text: str) -> float:
    """Bits per second of '1gbit', '500mbit', '10gbit'."""
    match = re.fullmatch(r"([\d.]+)([kmg])bit", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"bad rate {text!r}; expected e.g. 1gbit, 500mbit")
    return float(match.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


def parse_delay(text: str) -> float:
    """Seconds of '0.1ms', '1ms', '50us', '0'."""
    match = re.fullmatch(r"([\d.]+)(ms|us|s)?", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"bad delay {text!r}; expected e.g. 0.1ms, 50us")
    return float(match.group(1)) * {"ms": 1e-3, "us": 1e-6, "s": 1.0, None: 1e-3}[match.group(2)]


def label(nbytes: float) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{int(nbytes) // UNITS[unit]}{unit}"
    return str(int(nbytes))


def rate_label(bits: float) -> str:
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def _die_with_parent() -> None:
    """This process ends with the one that started it (``ip netns exec`` execs in place: that is the script)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# -- the network: namespaces, veths, a bridge, shaping, delay ------------------------------------------


def run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=check)


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
                else [sys.executable, __file__, "--role", "delay", "--delay-s", repr(seconds)]
            )
            daemon = subprocess.Popen(
                ["ip", "netns", "exec", host, *command],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            self._daemons.append(daemon)
            line = _readline(daemon, 30)
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


def _readline(process: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no answer from {process.args} within {timeout} s")
    return process.stdout.readline()


# -- the delay process: NFQUEUE over raw netlink --------------------------------------------------------

NETLINK_NETFILTER, NFNL_SUBSYS_QUEUE = 12, 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 1, 4, 2
SO_RCVBUFFORCE, SOL_NETLINK, NETLINK_NO_ENOBUFS = 33, 270, 5
NF_ACCEPT = 1


def _nlattr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _nfq_message(msg_type: int, attrs: list[bytes], seq: int, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(0)) + b"".join(attrs)  # queue 0
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, seq, 0) + body


#: The same process in C, compiled when a C compiler is at hand: it costs the packets' path a tenth of the CPU time.
DELAY_C = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SLOTS (1 << 20)
static int64_t due[SLOTS];
static uint32_t ids[SLOTS];

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static size_t put_attr(char *at, uint16_t type, const void *data, uint16_t len) {
    struct nlattr *a = (struct nlattr *)at;
    a->nla_len = NLA_HDRLEN + len;
    a->nla_type = type;
    memcpy(at + NLA_HDRLEN, data, len);
    return NLA_ALIGN(a->nla_len);
}

static size_t message(char *buf, uint16_t type, uint16_t flags, uint32_t seq) {
    struct nlmsghdr *h = (struct nlmsghdr *)buf;
    memset(buf, 0, NLMSG_HDRLEN + sizeof(struct nfgenmsg));
    h->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | type;
    h->nlmsg_flags = flags;
    h->nlmsg_seq = seq;
    struct nfgenmsg *g = (struct nfgenmsg *)(buf + NLMSG_HDRLEN);
    g->nfgen_family = AF_UNSPEC;
    g->version = NFNETLINK_V0;
    g->res_id = htons(0);
    return NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(struct nfgenmsg));
}

static void configure(int fd, uint32_t seq, const char *attrs, size_t len) {
    char buf[256], reply[4096];
    size_t n = message(buf, NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, seq);
    memcpy(buf + n, attrs, len);
    ((struct nlmsghdr *)buf)->nlmsg_len = n + len;
    if (send(fd, buf, n + len, 0) < 0) { perror("send"); exit(1); }
    ssize_t got = recv(fd, reply, sizeof reply, 0);
    struct nlmsghdr *h = (struct nlmsghdr *)reply;
    if (got >= (ssize_t)(NLMSG_HDRLEN + sizeof(int)) && h->nlmsg_type == NLMSG_ERROR) {
        int error = ((struct nlmsgerr *)NLMSG_DATA(h))->error;
        if (error) { fprintf(stderr, "NFQUEUE configuration step %u: %s\n", seq, strerror(-error)); exit(1); }
    }
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    int64_t delay = atoll(argv[1]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = socket(AF_NETLINK, SOCK_RAW, NETLINK_NETFILTER);
    if (fd < 0) { perror("socket"); return 1; }
    int size = 16 << 20, one = 1;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof size);
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sockaddr_nl local = {.nl_family = AF_NETLINK};
    if (bind(fd, (struct sockaddr *)&local, sizeof local) < 0) { perror("bind"); return 1; }
    char attrs[64];
    struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND};
    configure(fd, 1, attrs, put_attr(attrs, NFQA_CFG_CMD, &cmd, sizeof cmd));
    struct nfqnl_msg_config_params params = {.copy_range = htonl(0), .copy_mode = NFQNL_COPY_META};
    configure(fd, 2, attrs, put_attr(attrs, NFQA_CFG_PARAMS, &params, sizeof params));
    uint32_t maxlen = htonl(1 << 17), gso = htonl(NFQA_CFG_F_GSO);
    configure(fd, 3, attrs, put_attr(attrs, NFQA_CFG_QUEUE_MAXLEN, &maxlen, sizeof maxlen));
    size_t n = put_attr(attrs, NFQA_CFG_MASK, &gso, sizeof gso);
    n += put_attr(attrs + n, NFQA_CFG_FLAGS, &gso, sizeof gso);
    configure(fd, 4, attrs, n);
    struct sched_param fifo = {.sched_priority = 50};
    sched_setscheduler(0, SCHED_FIFO, &fifo);
    prctl(PR_SET_TIMERSLACK, 1);
    char verdict[64];
    size_t head_len = message(verdict, NFQNL_MSG_VERDICT_BATCH, NLM_F_REQUEST, 0);
    struct nfqnl_msg_verdict_hdr vh = {.verdict = htonl(NF_ACCEPT), .id = 0};
    size_t verdict_len = head_len + put_attr(verdict + head_len, NFQA_VERDICT_HDR, &vh, sizeof vh);
    ((struct nlmsghdr *)verdict)->nlmsg_len = verdict_len;
    uint32_t *verdict_id = (uint32_t *)(verdict + head_len + NLA_HDRLEN + 4);
    static char buf[1 << 16];
    size_t first = 0, last = 0;  /* pending packets: [first, last) modulo SLOTS */
    struct pollfd p = {.fd = fd, .events = POLLIN};
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        if (first != last) {
            int64_t left = due[first % SLOTS] - now_ns();
            if (left > 0) {
                struct timespec t = {left / 1000000000LL, left % 1000000000LL};
                ppoll(&p, 1, &t, NULL);
            }
        } else {
            ppoll(&p, 1, NULL, NULL);
        }
        for (;;) {
            ssize_t got = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            if (got <= 0) break;
            int64_t t = now_ns() + delay;
            for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)got); h = NLMSG_NEXT(h, got)) {
                if (h->nlmsg_type != ((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET)) continue;
                char *a = (char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg));
                char *end = (char *)h + h->nlmsg_len;
                while (a + NLA_HDRLEN <= end) {
                    struct nlattr *attr = (struct nlattr *)a;
                    if (attr->nla_len < NLA_HDRLEN) break;
                    if ((attr->nla_type & NLA_TYPE_MASK) == NFQA_PACKET_HDR) {
                        struct nfqnl_msg_packet_hdr *ph = (struct nfqnl_msg_packet_hdr *)(a + NLA_HDRLEN);
                        if (last - first < SLOTS) {
                            due[last % SLOTS] = t;
                            ids[last % SLOTS] = ph->packet_id;  /* network order, as the verdict wants it */
                            last++;
                        }
                        break;
                    }
                    a += NLA_ALIGN(attr->nla_len);
                }
            }
        }
        int64_t now = now_ns();
        int release = 0;
        while (first != last && due[first % SLOTS] <= now) {
            *verdict_id = ids[first % SLOTS];
            first++;
            release = 1;
        }
        if (release) send(fd, verdict, verdict_len, 0);
    }
}
"""


def compile_delay(folder: str) -> str | None:
    """The C delay process, built in ``folder``; None without a compiler (the Python one runs instead)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source, binary = os.path.join(folder, "delay.c"), os.path.join(folder, "delay")
    with open(source, "w") as out:
        out.write(DELAY_C)
    built = run(compiler, "-O2", "-o", binary, source, check=False)
    return binary if built.returncode == 0 else None


def delay_main(delay: float) -> None:
    """Holds every packet of NFQUEUE 0 for ``delay`` seconds from its arrival, then accepts it (FIFO)."""
    _die_with_parent()
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)  # a lost notice is harmless: a batch verdict covers it
    sock.bind((0, 0))
    config = [
        [_nlattr(1, struct.pack("=BBH", 1, 0, 0))],  # NFQA_CFG_CMD: bind this socket to queue 0
        [_nlattr(2, struct.pack(">IB", 0, 1))],  # NFQA_CFG_PARAMS: copy the metadata only
        [_nlattr(3, struct.pack(">I", 1 << 17))],  # NFQA_CFG_QUEUE_MAXLEN
        [_nlattr(4, struct.pack(">I", 4)), _nlattr(5, struct.pack(">I", 4))],  # NFQA_CFG_MASK, _FLAGS: F_GSO
    ]
    for seq, attrs in enumerate(config, 1):
        sock.send(_nfq_message(NFQNL_MSG_CONFIG, attrs, seq, NLM_F_REQUEST | NLM_F_ACK))
        reply = sock.recv(65536)
        if struct.unpack_from("=H", reply, 4)[0] == NLMSG_ERROR:
            (error,) = struct.unpack_from("=i", reply, 16)
            if error:
                raise OSError(-error, f"NFQUEUE configuration step {seq}: {os.strerror(-error)}")
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))  # wakes on time although the ranks use every core
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    sock.setblocking(False)
    due: collections.deque[float] = collections.deque()
    ids: collections.deque[bytes] = collections.deque()
    buffer = bytearray(1 << 16)
    packet = ((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET).to_bytes(2, sys.byteorder)
    verdict = _nfq_message(NFQNL_MSG_VERDICT_BATCH, [_nlattr(2, struct.pack(">II", NF_ACCEPT, 0))], 0)[:-4]
    recv_into, send, monotonic, wait = sock.recv_into, sock.send, time.monotonic, select.select
    print("ready", flush=True)
    while True:
        if due:
            left = due[0] - monotonic()
            if left > 0:
                wait([sock], [], [], left)
        else:
            wait([sock], [], [])
        while True:
            try:
                recv_into(buffer)
            except BlockingIOError:
                break
            # nlmsghdr (16) + nfgenmsg (4), then NFQA_PACKET_HDR first: its type at 22, the packet id at 24.
            if buffer[4:6] == packet and buffer[22] == 1:
                due.append(monotonic() + delay)
                ids.append(bytes(buffer[24:28]))
        now, last = monotonic(), None
        while due and due[0] <= now:
            due.popleft()
            last = ids.popleft()
        if last is not None:
            send(verdict + last)  # accepts every packet up to this id


# -- probing one link: a TCP stream and a ping-pong between two hosts -----------------------------------


def _tuned_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BYTES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def probe_server_main(host: str) -> None:
    _die_with_parent()
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
    _die_with_parent()
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
        ["ip", "netns", "exec", network.hosts[1], sys.executable, __file__, "--role", "probe-server", "--host", network.addresses[1]],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        port = _readline(server, 30).strip()
        client = run(
            "ip", "netns", "exec", network.hosts[0], sys.executable, __file__, "--role", "probe-client",
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
    network.delay(0)
    base = probe(network, nbytes)
    if delay <= 0:
        return {"base": base, "delayed": base, "set": 0.0}
    target, setting = base["rtt"] + 2 * delay, delay
    for _ in range(3):
        network.delay(setting)
        rtt = probe(network, 1 << 16, pings=100)["rtt"]
        if abs(rtt - target) < 0.05 * target:
            break
        setting = max(0.0, setting + (target - rtt) / 2)
    network.delay(setting)
    delayed = probe(network, nbytes)
    return {"base": base, "delayed": delayed, "set": setting, "target_rtt": target}


# -- a rank: one process in its host's namespace, told what to run over stdin --------------------------


def _interface_bytes() -> tuple[int, int]:
    """(received, sent) bytes of this namespace's eth0, from the kernel's counters."""
    with open("/proc/net/dev") as counters:
        for line in counters:
            name, _, fields = line.partition(":")
            if name.strip() == "eth0":
                values = fields.split()
                return int(values[0]), int(values[8])
    return 0, 0


def _arrays(operation: str, nbytes: int, size: int, rank: int) -> tuple[np.ndarray, np.ndarray | None]:
    count = nbytes // 4
    if operation == "allgather":
        part = count // size
        return np.full(part, rank + 1, np.float32), np.empty((size, part), np.float32)
    data = np.full(count, rank + 1, np.float32)
    if operation == "allreduce":
        return data, np.empty_like(data)
    if operation == "reduce_scatter":
        base, extra = divmod(count, size)
        return data, np.empty(base + (rank < extra), np.float32)
    return data, None


def _call(comm, operation: str, algorithm: str, data: np.ndarray, out: np.ndarray | None):
    if operation == "allreduce":
        return comm.allreduce(data, out=out, algorithm=algorithm)
    if operation == "reduce_scatter":
        return comm.reduce_scatter(data, out=out, algorithm=algorithm)
    if operation == "allgather":
        return comm.allgather(data, out=out, algorithm=algorithm)
    return comm.broadcast(data, root=0, algorithm=algorithm)


def _correct(operation: str, result: np.ndarray, size: int) -> bool:
    if operation in ("allreduce", "reduce_scatter"):
        return bool(np.all(result == size * (size + 1) / 2))
    if operation == "allgather":
        return bool(np.all(result == np.arange(1, size + 1, dtype=np.float32)[:, None]))
    return bool(np.all(result == 1))


def rank_main(host: str) -> None:
    """Listens on ``host``, reads its job (JSON) from stdin, runs it, one JSON line per item on stdout."""
    _die_with_parent()
    from sparkdl.collective import Listener, SparkdlCommunicator

    listener = Listener(host)
    print(json.dumps({"address": listener.address}), flush=True)
    job = json.loads(sys.stdin.readline())
    rank = job["rank"]
    with SparkdlCommunicator.connect(
        rank,
        job["addresses"],
        listener,
        bytes.fromhex(job["secret"]),
        timeout=600.0,
        shared_memory=job["shared_memory"],
    ) as comm:
        size, warmed, cached = comm.size, set(), {}
        for index, (operation, algorithm, nbytes, repeats) in enumerate(job["plan"]):
            if (operation, algorithm) not in warmed:  # opens the links this algorithm uses (a star, a mesh)
                small, small_out = _arrays(operation, 4096 * size, size, rank)
                _call(comm, operation, algorithm, small, small_out)
                warmed.add((operation, algorithm))
            key = (operation, nbytes)
            if key not in cached:
                cached.clear()  # one size's arrays at a time
                cached[key] = _arrays(operation, nbytes, size, rank)
                if cached[key][1] is not None:
                    cached[key][1].fill(0)  # its pages mapped now, not in the first timed call
            data, out = cached[key]
            wire = _interface_bytes()
            payload = comm.traffic()
            starts, ends, ok = [], [], True
            for repeat in range(repeats):
                comm.barrier()
                starts.append(time.clock_gettime(time.CLOCK_MONOTONIC))  # one clock for every namespace
                result = _call(comm, operation, algorithm, data, out)
                ends.append(time.clock_gettime(time.CLOCK_MONOTONIC))
                if repeat == 0:
                    ok = _correct(operation, result, size)
            comm.barrier()  # every byte of the last call has left its sender's socket buffer
            received, sent = (after - before for after, before in zip(_interface_bytes(), wire))
            moved = comm.traffic()
            payload_sent = sum(moved[p][0] - payload.get(p, (0, 0))[0] for p in moved)
            payload_received = sum(moved[p][1] - payload.get(p, (0, 0))[1] for p in moved)
            print(
                json.dumps(
                    {
                        "index": index,
                        "starts": starts,
                        "ends": ends,
                        "ok": ok,
                        "wire_sent": sent / repeats,
                        "wire_received": received / repeats,
                        "payload_sent": payload_sent / repeats,
                        "payload_received": payload_received / repeats,
                    }
                ),
                flush=True,
            )
    print(json.dumps({"done": True}), flush=True)


def session(network: Network, hosts_of_ranks: list[int], plan: list, shared_memory: bool, log) -> list[dict]:
    """Runs ``plan`` on one rank per entry of ``hosts_of_ranks`` (its host's index); one record per item."""
    processes = []
    try:
        for host in hosts_of_ranks:
            processes.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", network.hosts[host], "nice", "-n", "-10", sys.executable, __file__, "--role", "rank", "--host", network.addresses[host]],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )  # fmt: skip
        addresses = [json.loads(_readline(process, 60))["address"] for process in processes]
        secret = secrets.token_hex(32)
        for rank, process in enumerate(processes):
            job = {"rank": rank, "addresses": addresses, "secret": secret, "shared_memory": shared_memory, "plan": plan}
            process.stdin.write(json.dumps(job) + "\n")
            process.stdin.flush()
        records = []
        for operation, algorithm, nbytes, repeats in plan:
            # The slowest case: naive allreduce of 256 MB on 4 ranks at 1 Gbit/s, about 13 s a call.
            budget = 120 + repeats * 8 * (2 * len(processes) * nbytes * 8 / 1e8)
            lines = []
            for rank, process in enumerate(processes):
                line = _readline(process, budget)
                if not line:
                    raise RuntimeError(f"rank {rank} ended early: {process.stderr.read()[-3000:]}")
                lines.append(json.loads(line))
            # From the first rank's start to the last rank's end: a rank that leaves the barrier late (by a one-way
            # latency) would otherwise not count the time the root's first message was on its way.
            starts = [min(per_rank) for per_rank in zip(*(line["starts"] for line in lines))]
            ends = [max(per_rank) for per_rank in zip(*(line["ends"] for line in lines))]
            times = [end - start for start, end in zip(starts, ends)]
            record = {
                "operation": operation,
                "algorithm": algorithm,
                "n": len(processes),
                "hosts": len(set(hosts_of_ranks)),
                "nbytes": nbytes,
                "times": times,
                "ok": all(line["ok"] for line in lines),
                "ranks": [{k: line[k] for k in line if k.startswith(("wire", "payload"))} for line in lines],
            }
            records.append(record)
            log(record)
        for process in processes:
            _readline(process, 60)
            process.wait(timeout=60)
        return records
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def repeats_for(nbytes: int, repeats: int, large: int = 1) -> int:
    """Fewer calls for large arrays: all ``repeats`` to 4 MB, half to 32 MB, ``large`` above (256 MB at 1 Gbit/s:
    2-14 s a call)."""
    if nbytes <= 4 << 20:
        return repeats
    if nbytes <= 32 << 20:
        return max(1, repeats // 2, large)
    return large


# -- fitting and reporting --------------------------------------------------------------------------------


def measurement(record: dict) -> cost.Measurement:
    pattern = PATTERN[(record["operation"], record["algorithm"])]
    options = {"local": record["n"] // record["hosts"]} if pattern == "hierarchical_allreduce" else {}
    return cost.Measurement(pattern, record["n"], record["nbytes"], statistics.median(record["times"]), options)


def key_of(record: dict) -> str:
    """The fit group of a record: its pattern, and for ring and naive allreduce whether ranks share hosts."""
    pattern = PATTERN[(record["operation"], record["algorithm"])]
    return pattern + (f" ({record['n'] // record['hosts']}/host)" if record["hosts"] != record["n"] else "")


def link_beta(run_: dict) -> float:
    """Seconds per byte of one link, from the probe's fastest TCP stream: the link's measured rate."""
    return 1.0 / max(run_["probe"]["delayed"]["stream"])


def fits(run_: dict) -> tuple[dict[str, cost.Params], cost.Params]:
    """Per algorithm (and layout), every term fitted over all its N and K; and one set for the network: beta
    pinned to the link's measured rate (:func:`link_beta`), alpha, gamma and delta fitted over every algorithm
    of one rank per host (the predictions' constants)."""
    records = [r for r in run_["records"] if r["ok"]]
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for record in records:
        groups[key_of(record)].append(record)
    per_algorithm = {key: cost.fit(measurement(r) for r in rows) for key, rows in groups.items()}
    joint = cost.fit((measurement(r) for r in records if r["hosts"] == r["n"]), fixed={"beta": link_beta(run_)})
    run_["fits"] = {key: dataclasses.asdict(params) for key, params in per_algorithm.items()}
    run_["joint"] = dataclasses.asdict(joint)
    return per_algorithm, joint


def _params_cells(params: cost.Params) -> str:
    return (
        f"{params.alpha * 1e6:.0f} | {params.beta * 1e9:.2f} ({params.bandwidth / 1e6:.0f} MB/s) | "
        f"{params.gamma * 1e9:.2f} | {params.delta * 1e9:.2f}"
    )


def report(network_runs: list[dict], args) -> None:
    summary = []
    for run_ in network_runs:
        print(f"\n## {run_['name']}\n")
        base, delayed = run_["probe"]["base"], run_["probe"]["delayed"]
        print(
            f"one TCP stream host 0 -> host 1: {max(delayed['stream']) / 1e6:.1f} MB/s "
            f"(runs: {', '.join(f'{s / 1e6:.0f}' for s in delayed['stream'])}); round trip {delayed['rtt'] * 1e3:.3f} ms "
            f"(min {delayed['rtt_min'] * 1e3:.3f}), without the delay {base['rtt'] * 1e3:.3f} ms; "
            f"delay set per host {run_['probe']['set'] * 1e3:.3f} ms"
        )
        for record in run_["records"]:
            if not record["ok"]:
                print(f"WRONG RESULT, left out: {key_of(record)} N={record['n']} {label(record['nbytes'])}")
        records = [r for r in run_["records"] if r["ok"]]
        per_algorithm, joint = fits(run_)
        print(
            "\nfits: per algorithm, every term fitted; the network's (the last row): beta the stream's measured rate, "
            "alpha, gamma and delta fitted over every algorithm at once\n"
        )
        print(
            "| fit | alpha (us per step) | beta (ns per byte on a link) | gamma (ns/B reduced) | delta (ns/B, all links) |"
        )
        print("|---|---|---|---|---|")
        for key, params in per_algorithm.items():
            print(f"| {key} | {_params_cells(params)} |")
        print(f"| the network's: beta measured, every algorithm of one rank per host | {_params_cells(joint)} |")
        errors = []
        for record in records:
            m = measurement(record)
            own = cost.relative_error(m, per_algorithm[key_of(record)])
            shared = cost.relative_error(m, joint) if record["hosts"] == record["n"] else None
            errors.append((record, m, own, shared))
        matrix(errors)
        over = [(r, own, shared) for r, _, own, shared in errors if abs(own) > 0.25]
        joint_over = [e for e in errors if e[3] is not None and abs(e[3]) > 0.25]
        print(
            f"\npoints beyond 25% of their algorithm's fit: {len(over)} of {len(errors)}; "
            f"of the network's: {len(joint_over)} of {sum(e[3] is not None for e in errors)}"
        )
        for record, own, shared in over:
            joint_text = "" if shared is None else f" (the network's fit: {shared:+.0%})"
            print(f"  N={record['n']} {label(record['nbytes'])} {key_of(record)}: {own:+.0%}{joint_text}")
        traffic_table(records)
        summary.append((run_, joint, errors, over, joint_over))
    print("\n## summary\n")
    print(
        "| network | one stream | round trip | the network's fit: alpha us, beta ns/B (MB/s), gamma, delta | "
        "within 25%: per algorithm | the network's fit |"
    )
    print("|---|---|---|---|---|---|")
    for run_, joint, errors, over, joint_over in summary:
        delayed = run_["probe"]["delayed"]
        joint_points = sum(e[3] is not None for e in errors)
        print(
            f"| {run_['name']} | {max(delayed['stream']) / 1e6:.0f} MB/s | {delayed['rtt'] * 1e3:.2f} ms | "
            f"{_params_cells(joint).replace(' |', ',')} | {len(errors) - len(over)} of {len(errors)} | "
            f"{joint_points - len(joint_over)} of {joint_points} |"
        )
    predictions(network_runs, args)


#: Column names of the tables: allreduce, reduce-scatter, allgather, broadcast.
SHORT = {
    "ring_allreduce": "ring AR",
    "naive_allreduce": "naive AR",
    "tree_allreduce": "tree AR",
    "hierarchical_allreduce": "hierarchical AR",
    "ring_reduce_scatter": "ring RS",
    "ring_allgather": "ring AG",
    "naive_allgather": "naive AG",
    "ring_broadcast": "ring BC",
    "tree_broadcast": "tree BC",
}


def matrix(errors: list) -> None:
    """Measured seconds / the algorithm's fit (error), a row per N and size, a column per pattern; one table per
    layout (one rank per host; two per host)."""
    for shared in (False, True):
        chosen = [e for e in errors if (e[0]["hosts"] != e[0]["n"]) == shared]
        if not chosen:
            continue
        columns = list(dict.fromkeys(measurement(record).pattern for record, *_ in chosen))
        rows = list(dict.fromkeys((record["n"], record["hosts"], record["nbytes"]) for record, *_ in chosen))
        cells = {(r["n"], r["hosts"], r["nbytes"], m.pattern): (m, own) for r, m, own, _ in chosen}
        print(
            f"\n{'two ranks per host, four ranks' if shared else 'one rank per host'}: measured s / predicted by the "
            "algorithm's fit s (error)\n"
        )
        print("| N | K | " + " | ".join(SHORT[c] for c in columns) + " |")
        print("|---|---|" + "---|" * len(columns))
        for n, hosts, nbytes in rows:
            line = []
            for column in columns:
                if (n, hosts, nbytes, column) not in cells:
                    line.append("-")
                    continue
                m, own = cells[(n, hosts, nbytes, column)]
                line.append(f"{m.seconds:.3g} / {m.seconds * (1 + own):.3g} ({own:+.0%})")
            print(f"| {n} | {label(nbytes)} | " + " | ".join(line) + " |")


def traffic_table(records: list[dict]) -> None:
    """Bytes per call on each rank's interface, ring against naive: the lectures' claim, on real counters."""
    sizes = sorted({r["nbytes"] for r in records})
    if not sizes:
        return
    nbytes = min(sizes, key=lambda s: abs(s - (16 << 20)))
    print(f"\nbytes per allreduce of {label(nbytes)} (K) on each host's interface, sent / received, in K:")
    print(
        "| N | algorithm | rank 0 sent | rank 0 received | others sent (max) | others received (max) | formula, rank 0 | formula, others |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for record in records:
        if record["operation"] != "allreduce" or record["nbytes"] != nbytes or record["hosts"] != record["n"]:
            continue
        if record["algorithm"] not in ("ring", "naive"):
            continue
        n, ranks = record["n"], record["ranks"]
        k = float(nbytes)
        root_formula = (
            f"{2 * (n - 1) / n:.2f} / {2 * (n - 1) / n:.2f}" if record["algorithm"] == "ring" else f"{n - 1} / {n - 1}"
        )
        other_formula = f"{2 * (n - 1) / n:.2f} / {2 * (n - 1) / n:.2f}" if record["algorithm"] == "ring" else "1 / 1"
        others = ranks[1:]
        print(
            f"| {n} | {record['algorithm']} | {ranks[0]['wire_sent'] / k:.2f} | {ranks[0]['wire_received'] / k:.2f} | "
            f"{max(r['wire_sent'] for r in others) / k:.2f} | {max(r['wire_received'] for r in others) / k:.2f} | "
            f"{root_formula} | {other_formula} |"
        )


#: The patterns of the prediction table: (column, pattern, options).
PREDICTED = (
    ("ring", "ring_allreduce", {}),
    ("tree", "tree_allreduce", {}),
    ("naive", "naive_allreduce", {}),
    ("hier. 8/host", "hierarchical_allreduce", {"local": 8}),
    ("ZeRO-1", "zero1", {}),
    ("ZeRO-3 24 units", "zero3", {"units": 24}),
    ("PS", "parameter_server", {}),
    ("PS 4 shards", "sharded_ps", {"servers": 4}),
    ("gossip", "gossip", {}),
)
#: Training patterns compared for "fastest mode" (sync is the ring's column, or hierarchical where hosts hold 8).
MODES = ("ring", "hier. 8/host", "ZeRO-1", "ZeRO-3 24 units", "PS", "PS 4 shards", "gossip")


def prediction_params(run_: dict, memory_bandwidth: float) -> cost.Params:
    """The network's fit, without delta (each host its own CPUs), gamma at least one byte per ``memory_bandwidth``:
    at 1 Gbit/s the runs cannot see memory (gamma fits to 0), but a host's shared-memory phases cost it."""
    params = cost.Params(**run_["joint"]).without("delta")
    return dataclasses.replace(params, gamma=max(params.gamma, 1.0 / memory_bandwidth))


def predictions(network_runs: list[dict], args) -> None:
    """The network's fit of each network, used for N up to 1024 and models up to 1e9 float32 parameters."""
    ranks = [2, 4, 8, 16, 64, 256, 1024]
    parameters = [1e6, 1e7, 1e8, 1e9]
    for run_ in network_runs:
        params = prediction_params(run_, args.memory_gbps * 1e9)
        print(f"\n## predicted, {run_['name']} ({params})")
        print(
            f"seconds of communication per step (float32: K = 4 bytes a parameter); sync efficiency: a step computing "
            f"6 x params x {args.tokens} tokens at {args.flops:.0e} FLOP/s a rank, then the ring, without overlap\n"
        )
        header = (
            "| N | params | "
            + " | ".join(name for name, _, _ in PREDICTED)
            + " | fastest allreduce | fastest mode | sync efficiency |"
        )
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for n in ranks:
            for p in parameters:
                k = 4 * p
                seconds: dict[str, float] = {}
                for name, pattern, options in PREDICTED:
                    if pattern == "hierarchical_allreduce" and (n % options["local"] or n == options["local"]):
                        continue
                    seconds[name] = cost.predict(pattern, n, k, params, **options)
                allreduces = [
                    name for name, pattern, _ in PREDICTED if pattern.endswith("allreduce") and name in seconds
                ]
                modes = [name for name in MODES if name in seconds]
                cells = [f"{seconds[name]:.3g}" if name in seconds else "-" for name, _, _ in PREDICTED]
                compute = 6 * p * args.tokens / args.flops
                print(
                    f"| {n} | {p:.0e} | " + " | ".join(cells) + f" | {min(allreduces, key=seconds.__getitem__)} | "
                    f"{min(modes, key=seconds.__getitem__)} | {cost.efficiency(seconds['ring'], compute):.0%} |"
                )


# -- the driver ---------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=parse_rate, nargs="+", default=[1e9, 10e9])
    parser.add_argument("--delays", type=parse_delay, nargs="+", default=[0.1e-3, 1e-3])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument(
        "--sizes", type=parse_size, nargs="+", default=[parse_size(s) for s in "100K 1M 16M 64M".split()]
    )
    parser.add_argument("--repeats", type=int, default=5, help="calls per point up to 4 MB (half to 32 MB)")
    parser.add_argument("--large-repeats", type=int, default=2, help="calls per point above 32 MB")
    parser.add_argument("--hierarchical", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--quick", action="store_true", help="1 Gbit/s at 0.1 ms, N = 2 and 4, 100K 1M 16M 64M")
    parser.add_argument(
        "--patterns", nargs="+", help="only these, as operation:algorithm (allreduce:ring allreduce:hierarchical ...)"
    )
    parser.add_argument("--python-delay", action="store_true", help="the delay process in Python even with a compiler")
    parser.add_argument("--json", help="write every measurement and fit here")
    parser.add_argument("--from-json", help="report a saved run (no namespaces, no root)")
    parser.add_argument(
        "--tokens", type=int, default=65536, help="samples (tokens) per rank per step, for the efficiency column"
    )
    parser.add_argument("--flops", type=float, default=1e14, help="FLOP/s per rank, for the efficiency column")
    parser.add_argument(
        "--memory-gbps", type=float, default=4.0, help="GB/s a host copies through shared memory, at least"
    )
    parser.add_argument("--role", choices=["delay", "probe-server", "probe-client", "rank"], help=argparse.SUPPRESS)
    parser.add_argument("--delay-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pings", type=int, default=200, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "delay":
        return delay_main(args.delay_s)
    if args.role == "probe-server":
        return probe_server_main(args.host)
    if args.role == "probe-client":
        return probe_client_main(args.target, args.bytes, args.pings)
    if args.role == "rank":
        return rank_main(args.host)
    if args.from_json:
        with open(args.from_json) as saved:
            report(json.load(saved)["networks"], args)
        return None
    if args.quick:
        args.rates, args.delays, args.ranks = [1e9], [0.1e-3], [2, 4]
        args.sizes = [parse_size(s) for s in "100K 1M 16M 64M".split()]
    if args.hierarchical is None:
        args.hierarchical = 4 in args.ranks
    why = available()
    if why is not None:
        print(f"network_patterns: skipped: {why}")
        return None
    no_delay = delay_available()
    if no_delay is not None and any(d > 0 for d in args.delays):
        print(f"network_patterns: {no_delay}; alpha is fitted on the path's own latency")
        args.delays = [0.0]

    network = Network(max(max(args.ranks), 2 if args.hierarchical else 0, 2))
    scratch = tempfile.TemporaryDirectory(prefix="sdlnp")
    if not args.python_delay and any(d > 0 for d in args.delays):
        network.delay_binary = compile_delay(scratch.name)
    flat = [pair for pair in FLAT if not args.patterns or f"{pair[0]}:{pair[1]}" in args.patterns]
    two_per_host = [pair for pair in TWO_PER_HOST if not args.patterns or f"{pair[0]}:{pair[1]}" in args.patterns]

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    runs = []
    try:
        network.create()
        print(
            f"machine: {os.cpu_count()} cores; {len(network.hosts)} host namespaces on one bridge, "
            f"addresses {SUBNET}.0/24; load average {os.getloadavg()[0]:.1f}; delay process: "
            f"{'C' if network.delay_binary else 'Python'}"
        )
        for rate in args.rates:
            network.shape(rate)
            for delay in args.delays:
                name = f"{rate_label(rate)}, {delay * 1e3:g} ms one-way delay"
                print(f"\n# {name}", flush=True)
                network_started = time.monotonic()
                calibration = calibrate_delay(network, delay, nbytes=max(16 << 20, int(rate / 8 * 0.5)))
                d = calibration["delayed"]
                print(
                    f"probe: stream {max(d['stream']) / 1e6:.1f} MB/s, round trip {d['rtt'] * 1e3:.3f} ms "
                    f"(without delay {calibration['base']['rtt'] * 1e3:.3f} ms; delay set {calibration['set'] * 1e3:.3f} ms)",
                    flush=True,
                )
                records = []

                def log(record):
                    median = statistics.median(record["times"])
                    flag = "" if record["ok"] else "  WRONG RESULT"
                    print(
                        f"  N={record['n']} hosts={record['hosts']} {label(record['nbytes']):>5} "
                        f"{record['operation']:>14} {record['algorithm']:<12} {median:9.4f} s{flag}",
                        flush=True,
                    )

                for n in args.ranks if flat else []:
                    plan = [
                        [operation, algorithm, nbytes, repeats_for(nbytes, args.repeats, args.large_repeats)]
                        for nbytes in args.sizes
                        for operation, algorithm in flat
                    ]
                    records += session(network, list(range(n)), plan, False, log)
                if args.hierarchical and two_per_host:
                    plan = [
                        [operation, algorithm, nbytes, repeats_for(nbytes, args.repeats, args.large_repeats)]
                        for nbytes in args.sizes
                        for operation, algorithm in two_per_host
                    ]
                    records += session(network, [0, 0, 1, 1], plan, True, log)
                runs.append({"name": name, "rate": rate, "delay": delay, "probe": calibration, "records": records})
                print(f"({name}: {time.monotonic() - network_started:.0f} s)", flush=True)
    finally:
        network.close()
        scratch.cleanup()
        signal.signal(signal.SIGTERM, previous)
        print(f"\nnamespaces removed; measured for {time.monotonic() - started:.0f} s", flush=True)
    save(args.json, runs)
    report(runs, args)
    save(args.json, runs)  # with the fits
    return None


def save(path: str | None, runs: list[dict]) -> None:
    if path:
        with open(path, "w") as out:
            json.dump({"argv": sys.argv[1:], "networks": runs}, out, indent=1)


if __name__ == "__main__":
    main()
