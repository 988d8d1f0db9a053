"""A pattern's predicted time, and the model's constants fitted on measured times."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from sparkdl.collective.cost.model import TERMS, Cost, Params


def predict(counts: Cost, params: Params) -> float:
    """Seconds a pattern of ``counts`` takes by the model: alpha·steps + beta·bytes + gamma·memory + delta·total."""
    return float(counts.vector() @ params.vector())


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
    design = np.array([m.counts.vector() for m in rows])
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
    return (predict(measurement.counts, params) - measurement.seconds) / measurement.seconds


def efficiency(step_seconds: float, compute_seconds: float) -> float:
    """Weak-scaling efficiency of a step that computes for ``compute_seconds`` and then communicates for
    ``step_seconds`` without overlap: compute / (compute + communication); 1 with nothing to communicate."""
    total = compute_seconds + step_seconds
    return 1.0 if total == 0 else compute_seconds / total


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured time of a pattern whose counts are ``counts`` (``collective(...)``, a mode's, ...)."""

    counts: Cost
    seconds: float
