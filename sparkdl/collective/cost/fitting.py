"""Every pattern by name, its predicted time, and the model's constants fitted on measured times."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from sparkdl.collective.cost import collectives, modes
from sparkdl.collective.cost.model import TERMS, Cost, Params

#: Every pattern: ``name -> function(n, nbytes, **options) -> Cost``.
PATTERNS: dict[str, Callable[..., Cost]] = {
    "ring_allreduce": collectives.ring_allreduce,
    "naive_allreduce": collectives.naive_allreduce,
    "tree_allreduce": collectives.tree_allreduce,
    "hierarchical_allreduce": collectives.hierarchical_allreduce,
    "ring_reduce_scatter": collectives.ring_reduce_scatter,
    "ring_allgather": collectives.ring_allgather,
    "naive_allgather": collectives.naive_allgather,
    "ring_broadcast": collectives.ring_broadcast,
    "tree_broadcast": collectives.tree_broadcast,
    "naive_broadcast": collectives.naive_broadcast,
    "sync": modes.sync,
    "zero1": modes.zero1,
    "zero3": modes.zero3,
    "parameter_server": modes.parameter_server,
    "sharded_ps": modes.sharded_ps,
    "sync_ps": modes.sync_ps,
    "spread_ps": modes.spread_ps,
    "gossip": modes.gossip,
    "pipeline": modes.pipeline,
}


def cost(pattern: str, n: int, nbytes: float, **options: Any) -> Cost:
    """The counts of ``pattern`` over ``n`` ranks on ``nbytes`` (see :data:`PATTERNS` for the options)."""
    if pattern not in PATTERNS:
        raise ValueError(f"Expected `pattern` to be one of {sorted(PATTERNS)}. Received: pattern={pattern!r}")
    if n < 1 or nbytes < 0:
        raise ValueError(f"Expected n >= 1 and nbytes >= 0. Received: n={n}, nbytes={nbytes}")
    return PATTERNS[pattern](n, float(nbytes), **options)


def predict(pattern: str, n: int, nbytes: float, params: Params, **options: Any) -> float:
    """Seconds ``pattern`` takes over ``n`` ranks on ``nbytes`` by the model: alpha·steps + beta·bytes + gamma·memory."""
    return float(cost(pattern, n, nbytes, **options).vector() @ params.vector())


def fit(
    measurements: Iterable[Measurement], terms: Sequence[str] = TERMS, fixed: Mapping[str, float] | None = None
) -> Params:
    """The ``alpha``, ``beta``, ``gamma`` and ``delta`` that fit ``measurements`` best, none negative.

    Least squares on the relative error, sum(((predicted - measured) / measured)^2), so that a 100 KB
    call weighs as much as a 256 MB one; non-negative by trying every subset of the free terms (four at
    most: the exact non-negative least squares of so small a problem). ``fixed`` pins terms to known
    values (``{"beta": 1 / measured_bandwidth}``); the other terms not in ``terms`` are 0. Where two
    counts are proportional over the measurements (a ring's link and memory bytes), the fit cannot tell
    them apart and puts the time on one of them.
    """
    rows = list(measurements)
    fixed = dict(fixed or {})
    unknown = (set(terms) | set(fixed)) - set(TERMS)
    if unknown or not (terms or fixed):
        raise ValueError(f"Expected `terms` and `fixed` among {TERMS}. Received: {list(terms)}, {sorted(fixed)}")
    if not rows:
        raise ValueError("Expected at least one measurement to fit")
    if any(m.seconds <= 0 for m in rows):
        raise ValueError("Expected every measurement's seconds to be positive")
    design = np.array([m.cost().vector() for m in rows])
    weights = 1.0 / np.array([m.seconds for m in rows])
    known = np.zeros(len(TERMS))
    for term, value in fixed.items():
        known[TERMS.index(term)] = value
    a, b = design * weights[:, None], 1.0 - (design @ known) * weights
    columns = [TERMS.index(t) for t in terms if t not in fixed]
    best = (float(np.sum(b**2)), known.copy())  # the free terms all 0
    for size in range(1, len(columns) + 1):
        for subset in itertools.combinations(columns, size):
            chosen = list(subset)
            if not np.any(a[:, chosen]):
                continue
            solution, *_ = np.linalg.lstsq(a[:, chosen], b, rcond=None)
            if np.any(solution < 0):
                continue
            full = known.copy()
            full[chosen] = solution
            residual = float(np.sum((a @ (full - known) - b) ** 2))
            if residual < best[0] - 1e-15:
                best = (residual, full)
    if not np.any(best[1]):
        raise ValueError("No non-negative fit: every count of the measurements is zero")
    return Params(*(float(v) for v in best[1]))


def relative_error(measurement: Measurement, params: Params) -> float:
    """(predicted - measured) / measured for one measurement."""
    predicted = predict(measurement.pattern, measurement.n, measurement.nbytes, params, **measurement.options)
    return (predicted - measurement.seconds) / measurement.seconds


def efficiency(step_seconds: float, compute_seconds: float) -> float:
    """Weak-scaling efficiency of a step that computes for ``compute_seconds`` and then communicates for
    ``step_seconds`` without overlap: compute / (compute + communication); 1 with nothing to communicate."""
    total = compute_seconds + step_seconds
    return 1.0 if total == 0 else compute_seconds / total


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured time: ``pattern`` over ``n`` ranks on ``nbytes``, with the pattern's options."""

    pattern: str
    n: int
    nbytes: float
    seconds: float
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def cost(self) -> Cost:
        return cost(self.pattern, self.n, self.nbytes, **self.options)
