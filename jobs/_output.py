"""What a job prints: its own summary lines by default; with ``--verbose`` also INFO logs and phase times.

Spark's logs are set in ``_spark`` (WARN, or INFO with ``--verbose``); sparkdl prints one line per
epoch by itself. With ``--verbose`` the Python loggers show INFO (sparkdl's, and the job's
``sparkdl-job phase <name>: <seconds>s`` lines, which benchmarks/startup.py parses).
"""

from __future__ import annotations

import contextlib
import logging
import time

logger = logging.getLogger("sparkdl-job")


def configure(verbose: bool) -> None:
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("py4j").setLevel(logging.WARNING)  # a line per gateway connection: not Spark's logs


@contextlib.contextmanager
def phase(name: str):
    """Times a phase of the job; the line shows with ``--verbose``."""
    started = time.perf_counter()
    yield
    logger.info("sparkdl-job phase %s: %.2fs", name, time.perf_counter() - started)
