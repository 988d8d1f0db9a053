"""Every collective pattern on emulated networks, measured side by side, and the cost model fitted on them.

Usage (as root): python benchmarks/network_patterns.py [--rates 1gbit 10gbit] [--delays 0.1ms 1ms]
       [--ranks 2 3 4] [--sizes 100K 1M 16M 64M] [--repeats 5] [--large-repeats 2] [--no-hierarchical]
       [--patterns allreduce:ring mode:gossip ps:spread ...] [--no-modes] [--json results.json]
       [--from-json results.json] [--quick]

The defaults take about 25 minutes on a 2-core machine, 5 with ``--no-modes`` (the collectives only);
``--quick`` (1 Gbit/s, 0.1 ms, N = 2 and 4, to 64 MB) about 6.

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
chain) and a small process per host (``hostnet.nfqueue``: in C, compiled at start where a C compiler is, else
in Python; SCHED_FIFO; metadata only: no payload is copied) accepts each one
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
naive one over the same ranks. Unless ``--no-modes``, every training mode's step follows, on the same
hosts (``netbench.modes``): ZeRO-1 and ZeRO-3, gossip and the pipeline among the ranks, and the
parameter server with its servers on one more host (the driver's) or beside the workers. Sizes are the
bytes of the model (K): allreduce, reduce-scatter and broadcast move a K-byte array, allgather gathers
K (K/N from each rank), a mode's step moves its model of K (the pipeline, an activation of K). Each
call is timed after a
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
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # sparkdl from this checkout

from hostnet.network import Network, available, impairment_available
from netbench.collectives import FLAT, TWO_PER_HOST, rank_main, repeats_for, session
from netbench.common import label, parse_delay, parse_rate, parse_size, rate_label
from netbench.modes import COMMUNICATOR_MODES, PS_LAYOUTS, ps_session, server_main, worker_main
from netbench.probe import calibrate_delay, probe_client_main, probe_server_main
from netbench.report import report


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
        "--patterns",
        nargs="+",
        help="only these, as operation:algorithm (allreduce:ring allreduce:hierarchical mode:zero1 ps:spread ...)",
    )
    parser.add_argument("--no-modes", action="store_true", help="the collectives only: no mode:* and ps:* patterns")
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
    parser.add_argument(
        "--role",
        choices=["probe-server", "probe-client", "rank", "ps-server", "ps-worker"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pings", type=int, default=200, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "probe-server":
        return probe_server_main(args.host)
    if args.role == "probe-client":
        return probe_client_main(args.target, args.bytes, args.pings)
    if args.role == "rank":
        return rank_main(args.host)
    if args.role == "ps-server":
        return server_main(args.host)
    if args.role == "ps-worker":
        return worker_main(args.host)
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
    no_delay = impairment_available()
    if no_delay is not None and any(d > 0 for d in args.delays):
        print(f"network_patterns: {no_delay}; alpha is fitted on the path's own latency")
        args.delays = [0.0]

    modes = [] if args.no_modes else [("mode", pattern) for pattern in COMMUNICATOR_MODES]
    chosen = lambda pairs: [pair for pair in pairs if not args.patterns or f"{pair[0]}:{pair[1]}" in args.patterns]
    flat, two_per_host = chosen([*FLAT, *modes]), chosen(TWO_PER_HOST)
    ps_layouts = [layout for _, layout in chosen([] if args.no_modes else [("ps", layout) for layout in PS_LAYOUTS])]
    # the driver's host for the parameter servers: one more than the ranks
    network = Network(
        max(max(args.ranks) + bool(ps_layouts), 2 if args.hierarchical else 0, 2), python_program=args.python_delay
    )

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    runs = []
    try:
        network.start()
        print(
            f"machine: {os.cpu_count()} cores; {len(network.hosts)} host namespaces on one bridge, "
            f"addresses {network.subnet}.0/24; load average {os.getloadavg()[0]:.1f}; delay process: "
            f"{'C' if network.program() else 'Python'}"
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
                    if "phases" in record:
                        flag = " (" + ", ".join(f"{k} {v:.4f} s" for k, v in record["phases"].items()) + ")" + flag
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
                for n in args.ranks:
                    for layout in ps_layouts:
                        plan = [
                            [nbytes, max(2, repeats_for(nbytes, args.repeats, args.large_repeats))]
                            for nbytes in args.sizes
                        ]
                        records += ps_session(network, n, layout, plan, log)
                runs.append({"name": name, "rate": rate, "delay": delay, "probe": calibration, "records": records})
                print(f"({name}: {time.monotonic() - network_started:.0f} s)", flush=True)
    finally:
        network.close()
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
