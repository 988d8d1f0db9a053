"""Where a hand-written training step's time goes, by kind, and its waits on collectives, whose errors say who waited
for what (the pipeline's stages and the fully sharded replicas run such steps)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sparkdl.collective.api import Work
from sparkdl.net.errors import CollectiveError


class StepClock:
    """Seconds per kind of work (``kinds``) over every step so far; ``who`` names the waiter in wait errors."""

    def __init__(self, who: str, kinds: Sequence[str]):
        self.who = who
        self.seconds = dict.fromkeys(kinds, 0.0)

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """Counts the block's time as ``kind``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - start

    def wait(self, work: Work, what: str, kind: str, timeout: float) -> Any:
        """``work``'s result, waited for at most ``timeout`` seconds, the wait counted as ``kind``; a failed or
        timed-out wait raises its error again, prefixed by who waited and for ``what``."""
        return self.run(lambda: work.wait(timeout), what, kind)

    def run(self, call: Callable[[], Any], what: str, kind: str) -> Any:
        """``call()`` (a blocking collective operation), counted as ``kind``; its CollectiveError raised again,
        prefixed by who called and for ``what``."""
        with self.timing(kind):
            try:
                return call()
            except CollectiveError as exc:
                raise type(exc)(f"{self.who}: {what}: {exc}") from exc
