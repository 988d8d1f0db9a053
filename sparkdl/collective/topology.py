"""Where each rank runs, from one rendezvous record per rank: hosts, local and cross ranks, a ring host by host.

Spark interleaves partitions across executors, so ranks in partition order
would cross hosts at almost every step of a ring; ordering the ring host by
host crosses each host boundary once. Every rank derives the same topology
from the same records.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence


def host_identity(address_host: str) -> str:
    """This host's key: the task's address plus the kernel's boot id (two containers on one address differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = socket.gethostname()
    return f"{address_host}/{boot_id}"


def record(address: str, host: str) -> str:
    """What a rank publishes at the rendezvous: its listener address and host key (no separator in either)."""
    return f"{address} {host}"


def parse_records(records: Sequence[str]) -> tuple[list[str], list[str]]:
    """(addresses, hosts) by rank from the published records."""
    fields = [entry.split(" ") for entry in records]
    return [f[0] for f in fields], [f[1] for f in fields]


@dataclasses.dataclass(frozen=True)
class Topology:
    """The host key of every rank of the job."""

    hosts: tuple[str, ...]

    def ring(self, members: Sequence[int]) -> tuple[int, ...]:
        """Positions 0..len(members)-1 of ``members`` (global ranks) in ring order: host by host, then by rank."""
        first_seen: dict[str, int] = {}
        for member in members:
            first_seen.setdefault(self.hosts[member], len(first_seen))
        return tuple(sorted(range(len(members)), key=lambda i: (first_seen[self.hosts[members[i]]], i)))

    def local(self, members: Sequence[int], rank: int) -> list[int]:
        """The members (global ranks) on ``rank``'s host, in rank order."""
        return [m for m in members if self.hosts[m] == self.hosts[rank]]

    def cross(self, members: Sequence[int], rank: int) -> list[int]:
        """One member per host: those whose local rank equals ``rank``'s, in host order."""
        local_rank = self.local(members, rank).index(rank)
        hosts = list(dict.fromkeys(self.hosts[m] for m in members))
        by_host = {host: [m for m in members if self.hosts[m] == host] for host in hosts}
        return [by_host[host][local_rank] for host in hosts if len(by_host[host]) > local_rank]

    def balanced(self, members: Sequence[int]) -> bool:
        """Every host holds the same number of the members."""
        counts = {self.hosts[m]: 0 for m in members}
        for m in members:
            counts[self.hosts[m]] += 1
        return len(set(counts.values())) == 1
