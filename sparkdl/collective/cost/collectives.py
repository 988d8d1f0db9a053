"""The collectives' counts by (operation, algorithm): each registered algorithm's own (``Algorithm.costs``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparkdl.collective.cost.model import Cost


def priced() -> dict[tuple[str, str], Callable[..., Cost]]:
    """Every (operation, algorithm) the cost model counts: ``function(n, nbytes, **options) -> Cost``, one for each
    operation a registered algorithm gives a cost, registered later ones included."""
    from sparkdl.collective import algorithms  # the registry's algorithms import this package's model

    return {
        (operation, name): counts
        for name, algorithm in algorithms.registered().items()
        for operation, counts in algorithm.costs.items()
    }


def collective(operation: str, algorithm: str, n: int, nbytes: float, **options: Any) -> Cost:
    """The counts of one call of ``operation`` run by ``algorithm`` over ``n`` ranks on ``nbytes``."""
    counted = priced()
    if (operation, algorithm) not in counted:
        raise ValueError(
            f"Expected (operation, algorithm) to be one the cost model counts, one of {sorted(counted)}. "
            f"Received: ({operation!r}, {algorithm!r})"
        )
    if n < 1 or nbytes < 0:
        raise ValueError(f"Expected n >= 1 and nbytes >= 0. Received: n={n}, nbytes={nbytes}")
    return counted[(operation, algorithm)](n, float(nbytes), **options)
