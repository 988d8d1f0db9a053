"""``sparkdl.plan``: the predicted time of an epoch for every mode, number of workers and batch size, and the pick.

From the probe (``probe.measure``: one worker's step time by batch size, the links' latency and
bandwidth) and the cost model of each mode's communication (``sparkdl.collective.cost``), a step of
mode m on N workers of B rows each is predicted to take

    compute(B) [x 4/3 for sharded weights: every layer's forward runs again] + communication(m, N, K)

with K the model's gradient bytes, and an epoch ``ceil(rows / (N B))`` such steps. The communication
is counted in full, as if nothing of it overlapped the compute (sync's buckets hide part of it behind
backprop, so its figure is an upper bound). Scaling efficiency is one worker's epoch over N times the
N workers' epoch. Memory per worker counts the weights, the optimizer's slots and the gradients, as
each mode splits them; a mode that does not fit ``worker_memory`` is shown but not picked, and so is one
whose fit would claim more task slots than the cluster has (servers beside the workers: two a worker).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from sparkdl.collective import cost
from sparkdl.collective.cost import modes as mode_patterns
from sparkdl.launch.layout import TaskLayout
from sparkdl.modes.parameter_server import placement
from sparkdl.planner.probe import Probe
from sparkdl.ps import sharding


@dataclasses.dataclass(frozen=True)
class PlannedMode:
    """A mode the planner weighs: its ``fit`` keywords and its pattern in ``cost.modes.PATTERNS``."""

    keywords: dict
    pattern: str
    shard_per_worker: bool = False  # one parameter-server shard beside each worker: num_servers = num_workers

    def fit_keywords(self, num_workers: int) -> dict:
        """The ``fit`` keywords of this mode on ``num_workers`` workers."""
        return {**self.keywords, "num_servers": num_workers} if self.shard_per_worker else dict(self.keywords)

    def runs(self, num_workers: int, trainable_variables: int) -> bool:
        """Whether ``fit`` takes it for a model of ``trainable_variables``: a server shard holds whole variables."""
        return not self.shard_per_worker or sharding.holds_whole_variables(num_workers, trainable_variables)

    def task_slots(self, num_workers: int) -> int:
        """The task slots its ``fit`` claims on ``num_workers`` workers: the fit's own task layout (with a shard per
        worker, a server task beside each one)."""
        if self.shard_per_worker:
            return placement.layout(num_workers, num_workers).slots
        return TaskLayout.data_parallel(num_workers).slots


#: The modes the planner compares, by label.
MODES: dict[str, PlannedMode] = {
    "sync": PlannedMode({"mode": "sync"}, "sync"),
    "sharded": PlannedMode({"mode": "sharded"}, "zero1"),
    "sharded, shard_weights=True": PlannedMode({"mode": "sharded", "shard_weights": True}, "zero3"),
    "async": PlannedMode({"mode": "async"}, "parameter_server"),
    "async, servers on executors": PlannedMode(
        {"mode": "async", "server_placement": "executors"}, "spread_ps", shard_per_worker=True
    ),
    "sync_ps": PlannedMode({"mode": "sync_ps"}, "sync_ps"),
    "gossip": PlannedMode({"mode": "gossip"}, "gossip"),
}
_RECOMPUTE = 4.0 / 3.0  # a step with every forward pass run twice: forward + backward (twice a forward) + forward
_TIE = 0.05  # epoch times within 5% of the best: the fewest workers among them is picked
#: The least scaling efficiency a batch size must reach to be picked over a larger one.
EFFICIENT = 0.8


@dataclasses.dataclass(frozen=True)
class Choice:
    """One configuration and what the model predicts for it."""

    mode: str  # a label of :data:`MODES`
    num_workers: int
    batch_size: int  # rows per worker per step
    step_seconds: float
    epoch_seconds: float
    efficiency: float  # one worker's epoch / (N x this epoch)
    memory_bytes: int  # a worker's weights, optimizer state and gradients
    fits: bool  # within the worker memory given (True when none was)
    task_slots: int  # the task slots its fit claims
    on_cluster: bool  # the cluster has that many slots (True where its slots cannot be read)

    @property
    def fit_arguments(self) -> dict:
        """The ``sparkdl.fit`` keywords of this choice."""
        keywords = MODES[self.mode].fit_keywords(self.num_workers)
        return {**keywords, "num_workers": self.num_workers, "batch_size": self.batch_size}


@dataclasses.dataclass(frozen=True)
class Plan:
    """``sparkdl.plan``'s answer: the :attr:`recommended` choice, every choice it weighed, and the probe."""

    recommended: Choice
    choices: tuple[Choice, ...]
    probe: Probe
    rows: int

    def __str__(self) -> str:
        link = self.probe.link
        lines = [
            f"sparkdl.plan: {self.rows} rows, {self.probe.gradient_bytes / 1e6:.1f} MB of gradients; one worker's step "
            + ", ".join(f"{s * 1000:.1f} ms at {b} rows" for b, s in sorted(self.probe.step_seconds.items()))
            + (f"; links: {link.alpha * 1e6:.0f} us a message, {link.bandwidth / 1e9:.2f} GB/s" if link.beta else ""),
            f"{'mode':<30}{'workers':>8}{'batch':>7}{'step ms':>10}{'epoch s':>10}{'efficiency':>12}{'MB/worker':>11}",
        ]
        for c in sorted(self.choices, key=lambda c: (c.mode, c.num_workers, c.batch_size)):
            mark = " <- recommended" if c == self.recommended else _unfit(c)
            lines.append(
                f"{c.mode:<30}{c.num_workers:>8}{c.batch_size:>7}{c.step_seconds * 1000:>10.1f}"
                f"{c.epoch_seconds:>10.2f}{c.efficiency:>12.2f}{c.memory_bytes / 1e6:>11.1f}{mark}"
            )
        return "\n".join(lines)


def _unfit(choice: Choice) -> str:
    """Why the table's line of a choice that cannot be recommended is not: "" where it could be."""
    if not choice.fits:
        return "  (does not fit)"
    return "" if choice.on_cluster else f"  (needs {choice.task_slots} task slots)"


def weigh(
    probe: Probe,
    *,
    rows: int,
    worker_counts: Sequence[int],
    batch_sizes: Sequence[int],
    optimizer_slots: int,
    largest_layers_bytes: int,
    trainable_variables: int,
    worker_memory: int | None = None,
    cluster_slots: int | None = None,
    modes: Sequence[str] = tuple(MODES),
) -> Plan:
    """Every mode x workers x batch size, predicted from ``probe``, and the recommended one.

    For each mode and number of workers, the batch is the smallest of ``batch_sizes`` whose scaling efficiency
    reaches :data:`EFFICIENT` (communication under a fifth of the step; the largest where none does): a larger
    batch is faster per epoch but changes the training itself, which the planner does not predict. Among
    those, the recommendation is the least epoch time of the modes that fit ``worker_memory`` and claim at most
    ``cluster_slots`` task slots (None: unknown, any) (the fewest workers within 5%). A mode ``fit`` would refuse
    for a model of ``trainable_variables`` (more server shards than variables) is not weighed.
    """
    choices = []
    for mode in modes:
        planned = MODES[mode]
        pattern = planned.pattern
        for n in (n for n in worker_counts if planned.runs(n, trainable_variables)):
            for batch in batch_sizes:
                compute = probe.compute_seconds(batch) * (_RECOMPUTE if pattern == "zero3" else 1.0)
                communication = (
                    cost.predict(mode_patterns.cost(pattern, n, probe.gradient_bytes), probe.link) if n > 1 else 0.0
                )
                step = compute + communication
                epoch = math.ceil(rows / (n * batch)) * step
                alone = math.ceil(rows / batch) * probe.compute_seconds(batch)
                memory = _memory(pattern, n, probe.gradient_bytes, optimizer_slots, largest_layers_bytes)
                fits = worker_memory is None or memory <= worker_memory
                slots = planned.task_slots(n)
                on_cluster = cluster_slots is None or slots <= cluster_slots
                efficiency = alone / (n * epoch) if epoch else 1.0
                choices.append(Choice(mode, n, batch, step, epoch, efficiency, memory, fits, slots, on_cluster))
    fitting = [c for c in choices if c.fits and c.on_cluster]
    if not fitting:
        raise ValueError(_nothing_fits(choices, worker_memory, cluster_slots))
    picked = []
    for mode, n in {(c.mode, c.num_workers) for c in fitting}:
        options = sorted((c for c in fitting if (c.mode, c.num_workers) == (mode, n)), key=lambda c: c.batch_size)
        picked.append(next((c for c in options if c.efficiency >= EFFICIENT), options[-1]))
    best = min(c.epoch_seconds for c in picked)
    near = [c for c in picked if c.epoch_seconds <= best * (1 + _TIE)]
    recommended = min(near, key=lambda c: (c.num_workers, c.epoch_seconds))
    return Plan(recommended, tuple(choices), probe, rows)


def _nothing_fits(choices: list[Choice], worker_memory: int | None, cluster_slots: int | None) -> str:
    """The error of a plan none of whose choices could be recommended."""
    on_cluster = [c for c in choices if c.on_cluster]
    if not on_cluster:
        return (
            f"Expected some mode to run on the cluster's {cluster_slots} task slots. Received: the modes weighed "
            f"claim at least {min(c.task_slots for c in choices)}; weigh other `modes` or add executors/cores"
        )
    return (
        f"Expected some mode to fit worker_memory={worker_memory} bytes. Received: the least a worker needs is "
        f"{min(c.memory_bytes for c in on_cluster)} bytes; use mode='pipeline', more workers or larger workers"
    )


def _memory(pattern: str, n: int, weights: int, slots: int, largest_layers: int) -> int:
    """A worker's bytes of weights, optimizer slots and gradients under ``pattern`` (activations left out)."""
    if pattern == "zero1":
        return weights + slots * weights // n + weights
    if pattern == "zero3":
        return weights // n + slots * weights // n + largest_layers + weights // n
    return weights + slots * weights + weights
