"""Refused connections, counted and logged at a bounded rate: a flood of them must not flood the driver's log.

A listener under attack refuses thousands of connections a second (a 10 s hog
once wrote 79,284 warnings). :class:`RefusalLog` logs the first refusal of an
interval in full (its reason and who it came from), counts the rest by reason,
and sums them up in one warning once the interval (``LOG_INTERVAL``) is over:
"refused 7,412 more connections in the last 5.0 s: 7,400 × evicted: ..., 12 ×
bad authentication code ...". A flood writes at most two lines per interval;
a refusal after a quiet interval is logged in full at once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

_log = logging.getLogger(__name__)

#: Seconds over which refusals after the first one are counted, then logged as one summary.
LOG_INTERVAL = 5.0


class RefusalLog:
    """The refusals of one listener named ``name``: how many (``total``) and the last one's reason (``last``), with
    warnings logged at a bounded rate (see the module doc). Used from the listener's accept thread only."""

    def __init__(self, name: str):
        self.name = name
        self.total = 0
        self.last = ""
        self._interval = LOG_INTERVAL
        self._interval_start = -math.inf
        self._unlogged: Counter[str] = Counter()

    def refuse(self, reason: str, detail: str = "") -> None:
        """Counts a refused connection; ``reason`` is what the summaries count by, ``detail`` adds who and how."""
        now = time.monotonic()
        self.total += 1
        self.last = f"{reason} ({detail})" if detail else reason
        self.flush(now)
        if now - self._interval_start >= self._interval:
            self._interval_start = now
            _log.warning("%s: refused a connection: %s", self.name, self.last)
        else:
            self._unlogged[reason] += 1

    def due(self) -> float:
        """When the summary of the refusals not yet logged is due (``math.inf`` when there are none)."""
        return self._interval_start + self._interval if self._unlogged else math.inf

    def flush(self, now: float, *, final: bool = False) -> None:
        """Logs the summary of the refusals not yet logged, once it is due at ``now`` (or at once when ``final``)."""
        if not self._unlogged or (now < self.due() and not final):
            return
        count = sum(self._unlogged.values())
        reasons = ", ".join(f"{n:,} × {reason}" for reason, n in self._unlogged.most_common())
        _log.warning(
            "%s: refused %s more connection%s in the last %.1f s: %s",
            self.name,
            f"{count:,}",
            "" if count == 1 else "s",
            now - self._interval_start,
            reasons,
        )
        self._unlogged.clear()
