"""The cost model fitted on a run's measurements, every point against its fit, and the predictions for large N."""

from __future__ import annotations

import collections
import dataclasses
import statistics

from netbench.common import label
from netbench.modes import ZERO3_UNITS
from sparkdl.collective import cost
from sparkdl.planner import mode_costs

#: The modes' patterns (``sparkdl.planner.mode_costs``) of each measured ("mode" or "ps", variant), and their
#: options; a collective's record is priced by its own (operation, algorithm).
MODE_PATTERN: dict[tuple[str, str], tuple[str, dict]] = {
    ("mode", "zero1"): ("zero1", {}),
    ("mode", "zero3"): ("zero3", {"units": ZERO3_UNITS}),
    ("mode", "gossip"): ("gossip", {}),
    ("mode", "pipeline"): ("pipeline", {}),
    ("ps", "driver"): ("parameter_server", {}),
    ("ps", "driver, 4 shards"): ("sharded_ps", {"servers": 4}),
    ("ps", "sync_ps"): ("sync_ps", {}),
    ("ps", "spread"): ("spread_ps", {}),
}


def counts(pattern: str | tuple[str, str], n: int, nbytes: float, options: dict) -> cost.Cost:
    """A pattern's counts: a collective's ((operation, algorithm)) or a mode's (its name)."""
    if isinstance(pattern, tuple):
        return cost.collective(*pattern, n, nbytes, **options)
    return mode_costs.cost(pattern, n, nbytes, **options)


def pattern_of(record: dict) -> tuple[str | tuple[str, str], dict]:
    """The cost model's pattern of a record, and its options."""
    key = (record["operation"], record["algorithm"])
    if key in MODE_PATTERN:
        return MODE_PATTERN[key]
    return key, {"local": record["n"] // record["hosts"]} if record["algorithm"] == "hierarchical" else {}


def name_of(record: dict) -> str:
    """A record's pattern as the tables name it: "ring allreduce", "zero1", ..."""
    pattern = pattern_of(record)[0]
    return pattern if isinstance(pattern, str) else f"{pattern[1]} {pattern[0]}"


def measurement(record: dict) -> cost.Measurement:
    pattern, options = pattern_of(record)
    counted = counts(pattern, record["n"], record["nbytes"], options)
    return cost.Measurement(counted, statistics.median(record["times"]))


def key_of(record: dict) -> str:
    """The fit group of a record: its pattern, and for ring and naive allreduce whether ranks share hosts."""
    return name_of(record) + (f" ({record['n'] // record['hosts']}/host)" if record["hosts"] != record["n"] else "")


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
    "ring allreduce": "ring AR",
    "naive allreduce": "naive AR",
    "tree allreduce": "tree AR",
    "hierarchical allreduce": "hierarchical AR",
    "ring reduce_scatter": "ring RS",
    "ring allgather": "ring AG",
    "naive allgather": "naive AG",
    "ring broadcast": "ring BC",
    "tree broadcast": "tree BC",
    "zero1": "ZeRO-1",
    "zero3": f"ZeRO-3 ({ZERO3_UNITS} units)",
    "gossip": "gossip",
    "pipeline": "pipeline",
    "parameter_server": "PS (driver)",
    "sharded_ps": "PS 4 shards (driver)",
    "sync_ps": "sync PS (driver)",
    "spread_ps": "PS spread",
}
#: The tables of :func:`matrix`: (title, ranks share hosts, the records' operations).
TABLES = (
    ("one rank per host, the collectives", False, ("allreduce", "reduce_scatter", "allgather", "broadcast")),
    ("one rank per host, the modes' steps", False, ("mode", "ps")),
    ("two ranks per host, four ranks", True, ("allreduce",)),
)


def matrix(errors: list) -> None:
    """Measured seconds / the algorithm's fit (error), a row per N and size, a column per pattern (:data:`TABLES`)."""
    for title, shared, operations in TABLES:
        chosen = [e for e in errors if (e[0]["hosts"] != e[0]["n"]) == shared and e[0]["operation"] in operations]
        if not chosen:
            continue
        columns = list(dict.fromkeys(name_of(record) for record, *_ in chosen))
        rows = list(dict.fromkeys((record["n"], record["hosts"], record["nbytes"]) for record, *_ in chosen))
        cells = {(r["n"], r["hosts"], r["nbytes"], name_of(r)): (m, own) for r, m, own, _ in chosen}
        print(f"\n{title}: measured s / predicted by the pattern's fit s (error)\n")
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
PREDICTED: tuple[tuple[str, str | tuple[str, str], dict], ...] = (
    ("ring", ("allreduce", "ring"), {}),
    ("tree", ("allreduce", "tree"), {}),
    ("naive", ("allreduce", "naive"), {}),
    ("hier. 8/host", ("allreduce", "hierarchical"), {"local": 8}),
    ("ZeRO-1", "zero1", {}),
    ("ZeRO-3 24 units", "zero3", {"units": 24}),
    ("PS", "parameter_server", {}),
    ("PS 4 shards", "sharded_ps", {"servers": 4}),
    ("sync PS", "sync_ps", {}),
    ("PS spread", "spread_ps", {}),
    ("gossip", "gossip", {}),
)
#: Training patterns compared for "fastest mode" (sync is the ring's column, or hierarchical where hosts hold 8). Not
#: "PS spread": the model leaves out what its 2N messages a worker's step (a push and a pull to each of N shards) and
#: N connections a shard cost, so beyond the few hosts measured its figure is a lower bound.
MODES = ("ring", "hier. 8/host", "ZeRO-1", "ZeRO-3 24 units", "PS", "PS 4 shards", "sync PS", "gossip")


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
                    if pattern == ("allreduce", "hierarchical") and (n % options["local"] or n == options["local"]):
                        continue
                    seconds[name] = cost.predict(counts(pattern, n, k, options), params)
                allreduces = [name for name, pattern, _ in PREDICTED if isinstance(pattern, tuple) and name in seconds]
                modes = [name for name in MODES if name in seconds]
                cells = [f"{seconds[name]:.3g}" if name in seconds else "-" for name, _, _ in PREDICTED]
                compute = 6 * p * args.tokens / args.flops
                print(
                    f"| {n} | {p:.0e} | " + " | ".join(cells) + f" | {min(allreduces, key=seconds.__getitem__)} | "
                    f"{min(modes, key=seconds.__getitem__)} | {cost.efficiency(seconds['ring'], compute):.0%} |"
                )
