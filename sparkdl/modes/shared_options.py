"""The options more than one mode takes, declared once so that every mode taking one declares it the same way."""

from __future__ import annotations

from sparkdl.collective import compression
from sparkdl.modes.base import Option

COMPRESSION = Option(
    "compression",
    "gradients on the wire as 'bf16' or 'fp16' (half the bytes), added and applied in float32",
    kind=str,
    choices=compression.NAMES,
    check=compression.check,  # None means float32 gradients: its error says so
)
PROFILE = Option(
    "profile",
    "record where each step's time goes on every worker (sync: each step's phases, FitResult.stats['step_profile']; "
    "pipeline: when each micro-batch's passes start and end on each stage, FitResult.stats['pipeline']['timeline'])",
    kind=bool,
    default=False,
)
