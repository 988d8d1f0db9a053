"""The model's vocabulary: a pattern's counts (:class:`Cost`) and the constants that turn them into seconds."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

#: The names of the model's parameters, in the order of :meth:`Params.vector`.
TERMS = ("alpha", "beta", "gamma", "delta")


@dataclasses.dataclass(frozen=True)
class Cost:
    """One call's (or one training step's) counts: see the module's docstring."""

    steps: float
    link_bytes: float
    memory_bytes: float = 0.0
    messages: float = 0.0
    rank_sent: float = 0.0
    rank_received: float = 0.0
    total_bytes: float = 0.0

    def vector(self) -> np.ndarray:
        """``(steps, link_bytes, memory_bytes, total_bytes)``: what ``alpha``, ``beta``, ``gamma``, ``delta`` multiply."""
        return np.array([self.steps, self.link_bytes, self.memory_bytes, self.total_bytes], dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class Params:
    """The model's constants: seconds per serial step, per byte on a link, per byte reduced or copied."""

    alpha: float
    beta: float
    gamma: float = 0.0
    delta: float = 0.0

    def vector(self) -> np.ndarray:
        return np.array([self.alpha, self.beta, self.gamma, self.delta], dtype=np.float64)

    def without(self, *terms: str) -> Params:
        """These parameters with ``terms`` set to 0 (``without("delta")``: hosts that share nothing)."""
        return dataclasses.replace(self, **{term: 0.0 for term in terms})

    @property
    def bandwidth(self) -> float:
        """Bytes per second of one link (``1 / beta``); infinite when ``beta`` is 0."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def __str__(self) -> str:
        return (
            f"alpha {self.alpha * 1e6:.1f} us, beta {self.beta * 1e9:.3f} ns/B ({self.bandwidth / 1e6:.0f} MB/s), "
            f"gamma {self.gamma * 1e9:.3f} ns/B, delta {self.delta * 1e9:.3f} ns/B"
        )


def total(*costs: Cost) -> Cost:
    """The counts of ``costs`` run one after another."""
    return Cost(*(sum(getattr(c, f.name) for c in costs) for f in dataclasses.fields(Cost)))
