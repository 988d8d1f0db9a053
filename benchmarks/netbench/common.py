"""What every part of the emulated-network benchmark shares: sizes and rates as text, subprocesses, counters."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

from hostnet.network import Network
from hostnet.processes import readline

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCHMARKS)
#: The script every namespace's process runs, with ``--role``.
SCRIPT = os.path.join(BENCHMARKS, "network_patterns.py")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


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


def start_role(network: Network, host: int, role: str) -> subprocess.Popen:
    """``network_patterns.py --role ROLE`` in host ``host``'s namespace at ``nice -10``, on its address; JSON lines
    in and out."""
    return subprocess.Popen(
        [*network.exec_in(host), "nice", "-n", "-10", sys.executable, SCRIPT, "--role", role, "--host", network.addresses[host]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def interface_bytes() -> tuple[int, int]:
    """(received, sent) bytes of this namespace's eth0, from the kernel's counters."""
    with open("/proc/net/dev") as counters:
        for line in counters:
            name, _, fields = line.partition(":")
            if name.strip() == "eth0":
                values = fields.split()
                return int(values[0]), int(values[8])
    return 0, 0


def tell(process: subprocess.Popen, message: dict) -> None:
    """One JSON line to a role process's stdin."""
    process.stdin.write(json.dumps(message) + "\n")
    process.stdin.flush()


def hear(process: subprocess.Popen, timeout: float, who: str) -> dict:
    """The next JSON line of a role process; its stderr's end in the error if it ended instead."""
    line = readline(process, timeout)
    if not line:
        raise RuntimeError(f"{who} ended early: {process.stderr.read()[-3000:]}")
    return json.loads(line)


def messages() -> Iterator[dict]:
    """In a role process: the JSON lines of the parent, up to its ``{"done": true}``."""
    while True:
        message = json.loads(sys.stdin.readline())
        if message.get("done"):
            return
        yield message


@contextlib.contextmanager
def role_processes() -> Iterator[list[subprocess.Popen]]:
    """A list for the role processes a session starts; whichever are still running at its end are killed."""
    processes: list[subprocess.Popen] = []
    try:
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
