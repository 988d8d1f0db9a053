"""The one rule that combines metrics across workers, and the one way histories join across a resume.

Every mode combines its workers' epoch metrics with ``combine_logs``: each worker's value
weighs by the samples behind it, the rows it trained on for training metrics and its held-out
rows for ``val_*`` metrics. So a combined metric is the metric over all those samples (exactly,
for means such as loss and accuracy), and a value with no samples behind it (a sync rank's
stand-in validation, a worker without held-out rows) never leaks in, even as NaN.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def weighted_mean(pairs: Iterable[tuple[float, float]]) -> float:
    """``sum(value * weight) / sum(weight)`` over the ``(value, weight)`` pairs of positive weight; NaN if none."""
    total = weights = 0.0
    for value, weight in pairs:
        if weight > 0:
            total += float(value) * float(weight)
            weights += float(weight)
    return total / weights if weights > 0 else float("nan")


def combine_logs(
    logs: Sequence[dict[str, float]], samples: Sequence[float], validation_rows: Sequence[float]
) -> dict[str, float]:
    """One epoch's metrics over workers: each worker's ``logs`` weighed by its ``samples`` (training metrics)
    or its ``validation_rows`` (``val_*`` metrics). A name some workers lack is combined over the others."""
    combined = {}
    for name in dict.fromkeys(name for worker in logs for name in worker):
        weights = validation_rows if name.startswith("val_") else samples
        combined[name] = weighted_mean(
            (worker[name], weight) for worker, weight in zip(logs, weights) if name in worker
        )
    return combined


def merge_histories(earlier: dict[str, list[float]], later: dict[str, list[float]]) -> dict[str, list[float]]:
    """The history of epochs resumed from a checkpoint followed by this run's (the earlier one alone when this run
    trained nothing)."""
    if not later:
        return {name: list(values) for name, values in earlier.items()}
    return {name: list(earlier.get(name, [])) + list(values) for name, values in later.items()}
