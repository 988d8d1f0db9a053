"""``sparkdl.plan``: the predicted time of an epoch for every mode, number of workers and batch size, and the pick.

From the probe (``cluster_probe.measure``: one worker's step time by batch size, the links' latency and
bandwidth) and the cost of each planned mode's communication (:mod:`.planned`, :mod:`.mode_costs`), a
step of mode m on N workers of B rows each is predicted to take

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
from sparkdl.planner.cluster_probe import Probe
from sparkdl.planner.planned import PLANNED

_TIE = 0.05  # epoch times within 5% of the best: the fewest workers among them is picked
#: The least scaling efficiency a batch size must reach to be picked over a larger one.
EFFICIENT = 0.8


@dataclasses.dataclass(frozen=True)
class Choice:
    """One configuration and what the model predicts for it."""

    mode: str  # a label of :data:`~sparkdl.planner.planned.PLANNED`
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
        keywords = PLANNED[self.mode].fit_keywords(self.num_workers)
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
    modes: Sequence[str] | None = None,
) -> Plan:
    """Every mode x workers x batch size, predicted from ``probe``, and the recommended one.

    For each mode and number of workers, the batch is the smallest of ``batch_sizes`` whose scaling efficiency
    reaches :data:`EFFICIENT` (communication under a fifth of the step; the largest where none does): a larger
    batch is faster per epoch but changes the training itself, which the planner does not predict. Among
    those, the recommendation is the least epoch time of the modes that fit ``worker_memory`` and claim at most
    ``cluster_slots`` task slots (None: unknown, any) (the fewest workers within 5%). A mode ``fit`` would refuse
    for a model of ``trainable_variables`` (more server shards than variables) is not weighed. ``modes``: labels of
    :data:`~sparkdl.planner.planned.PLANNED`, by default all.
    """
    choices = []
    for mode in tuple(PLANNED) if modes is None else modes:
        planned = PLANNED[mode]
        for n in (n for n in worker_counts if planned.runs(n, trainable_variables)):
            for batch in batch_sizes:
                compute = probe.compute_seconds(batch) * planned.compute_factor
                communication = cost.predict(planned.cost(n, float(probe.gradient_bytes)), probe.link) if n > 1 else 0.0
                step = compute + communication
                epoch = math.ceil(rows / (n * batch)) * step
                alone = math.ceil(rows / batch) * probe.compute_seconds(batch)
                memory = planned.memory(n, probe.gradient_bytes, optimizer_slots, largest_layers_bytes)
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
