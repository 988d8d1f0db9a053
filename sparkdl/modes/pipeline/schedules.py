"""The order in which a pipeline stage runs its micro-batches' forward and backward passes in one step.

A schedule is a function ``(stage, stages, micro_batches) -> [(pass, micro-batch), ...]`` that every stage of a
replica applies to itself; :data:`SCHEDULES` names them (``fit(schedule=...)``). Both built-in ones have the same
bubble, (S-1)/(M+S-1) of a step on equal stages, and differ in the activations a stage holds at once: a micro-batch's
activations (its tape) are kept from its forward pass to its backward one.

- ``"gpipe"`` (GPipe): every micro-batch forward, then every one back, the last first. Each stage holds all ``M``
  micro-batches' activations at its peak.
- ``"1f1b"`` (PipeDream-Flush, one forward one backward): stage ``s`` runs ``S - s - 1`` forwards to fill the
  pipeline, then alternates one forward and one backward, then drains the backwards. Stage ``s`` holds at most
  ``min(S - s, M)`` micro-batches' activations: the first stage ``S``, the last one; the same gradients in the end.
"""

from __future__ import annotations

from collections.abc import Callable

FORWARD, BACKWARD = "forward", "backward"

Schedule = Callable[[int, int, int], list[tuple[str, int]]]


def gpipe(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Every forward, then every backward from the last micro-batch: the last stage starts back at once."""
    return [(FORWARD, m) for m in range(micro_batches)] + [(BACKWARD, m) for m in reversed(range(micro_batches))]


def one_forward_one_backward(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Warm-up forwards (as many as the stages after this one), then a forward and a backward in turn, then the
    backwards left."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [(FORWARD, m) for m in range(warmup)]
    for m in range(micro_batches - warmup):
        order += [(FORWARD, warmup + m), (BACKWARD, m)]
    return order + [(BACKWARD, m) for m in range(micro_batches - warmup, micro_batches)]


SCHEDULES: dict[str, Schedule] = {"gpipe": gpipe, "1f1b": one_forward_one_backward}
