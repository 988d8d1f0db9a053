"""One fit on the emulated cluster with a fault struck in the middle of its training, and what became of it.

:func:`run_trial` runs the fit in a thread of its own while an :class:`~hostnet.faults.Injection` strikes host
``host`` once training has begun, and sorts the end into one :class:`Outcome`:

- ``same weights``: the fit completed with the weights of the clean run it is compared with (to float32 rounding,
  :data:`ROUNDING`; ``max_difference`` says how close);
- ``different weights``: it completed with other weights (a defect: a silently different model);
- ``failed``: it raised; ``names_host`` and ``names_rank`` say whether the error names the broken host (its
  address) and a rank;
- ``hang``: it neither returned nor raised within ``hang_after`` seconds (its jobs are then cancelled);
- ``not struck``: the fit's training ended (its last epoch line) before the fault could strike: the trial proves
  nothing.

Whatever the end, the trial then looks for what the fit left behind (:func:`hostnet.leftovers.left_behind`).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from hostnet.faults import Fault, Injection, TrainingStarted
from hostnet.leftovers import left_behind
from hostnet.spark_cluster import SparkCluster

RANK = re.compile(r"\branks? \d+")
#: The largest difference of a weight that still counts as the clean run's: float32 rounding. A retried stage whose
#: ranks land on other hosts sums each step's gradients in another order (the hierarchical allreduce adds a host's
#: ranks first), which moves the weights by a few units in the last place (7e-8 seen), not by what training does.
ROUNDING = 1e-5
CANCELLED_WITHIN = 60.0  # seconds a hung fit has to return once its jobs are cancelled


@dataclasses.dataclass
class Outcome:
    fault: str
    kind: str  # "same weights", "different weights", "failed", "hang", "not struck"
    seconds: float  # from the fit's call to its return or raise (to the hang's cut-off for a hang)
    struck_at: float | None = None  # seconds from the fit's call to the fault
    what: str = ""  # what the fault did
    message: str = ""  # the error (its first 8000 characters), for a failed fit
    error_type: str = ""
    names_host: bool = False
    names_rank: bool = False
    max_difference: float | None = None  # the largest difference of a weight from the clean run's
    epoch_seconds: float | None = None  # the median time between two epoch lines of the fit
    trained_until: float = 0.0  # seconds from the fit's call to its last epoch line (0: none)
    epochs_before: int = 0  # epoch lines before the fault struck: between 1 and the fit's epochs, it struck mid-fit
    initial_epoch: int | None = None
    leftovers: list[str] = dataclasses.field(default_factory=list)
    stuck: bool = False  # a hang whose fit did not return even after its jobs were cancelled
    result: object = dataclasses.field(default=None, repr=False)  # the FitResult of a fit that completed

    def to_json(self) -> dict:
        """Every field but the result, as JSON takes it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "result"}

    @property
    def summary(self) -> str:
        """The outcome in a few words, for a table cell."""
        if self.kind == "failed":
            named = " and ".join(n for n, ok in (("host", self.names_host), ("rank", self.names_rank)) if ok)
            return f"failed ({self.error_type}{', names ' + named if named else ', names neither host nor rank'})"
        return self.kind


def weights_difference(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> float:
    """The largest absolute difference between two models' weights, weight by weight."""
    return max(float(np.max(np.abs(a - b))) if a.size else 0.0 for a, b in zip(got, want, strict=True))


def run_trial(
    cluster: SparkCluster,
    fault: Fault,
    fit: Callable[[], object],
    *,
    host: int,
    reference: Sequence[np.ndarray] | None,
    checkpoint_dirs: Sequence[str] = (),
    hang_after: float = 300.0,
    after: float = 0.5,
    tolerance: float = ROUNDING,
) -> Outcome:
    """``fit()`` (a ``sparkdl.fit`` call) with ``fault`` struck at host ``host`` ``after`` seconds past the start of
    training; its weights compared with ``reference`` (None: not compared) to ``tolerance``."""
    ended: dict = {}

    def call() -> None:
        try:
            ended["result"] = fit()
        except BaseException as error:  # the trial's subject: reported, not raised
            ended["error"] = error
        ended["at"] = time.monotonic()

    thread = threading.Thread(target=call, name=f"fit under {fault.name}", daemon=True)
    started = time.monotonic()
    with TrainingStarted() as training, Injection(fault, cluster, host=host, when=training.event, after=after) as hit:
        thread.start()
        thread.join(hang_after)
        hung = thread.is_alive()
        if hung:
            cluster.session().sparkContext.cancelAllJobs()
            thread.join(CANCELLED_WITHIN)
    if hit.error is not None:
        raise RuntimeError(f"{fault.name} could not be injected: {hit.error!r}") from hit.error
    outcome = Outcome(
        fault.name,
        "hang" if hung else "",
        hang_after if hung else ended["at"] - started,
        struck_at=None if hit.struck is None else hit.struck - started,
        what=hit.done,
        epoch_seconds=training.epoch_seconds(),
        trained_until=max(training.epoch_ends, default=started) - started,
        epochs_before=sum(1 for end in training.epoch_ends if hit.struck is not None and end < hit.struck),
        stuck=thread.is_alive(),
    )
    if not hung:
        _sort(outcome, ended, cluster.network.addresses[host], reference, tolerance)
    if not outcome.stuck:
        outcome.leftovers = left_behind(cluster, *checkpoint_dirs)
    return outcome


def _sort(outcome: Outcome, ended: dict, address: str, reference, tolerance: float) -> None:
    if "error" in ended:
        error = ended["error"]
        text = str(error)
        outcome.kind = "failed"
        outcome.error_type = type(error).__name__
        outcome.message = text[:8000]
        outcome.names_host = re.search(rf"\b{re.escape(address)}(?![\d])", text) is not None  # not .2 in .254
        outcome.names_rank = RANK.search(text) is not None
        return
    result = outcome.result = ended["result"]
    outcome.initial_epoch = result.initial_epoch
    if outcome.struck_at is None or outcome.struck_at > outcome.trained_until:
        outcome.kind = "not struck"
    elif reference is None:
        outcome.kind = "completed"
    else:
        outcome.max_difference = weights_difference(result.model.get_weights(), reference)
        outcome.kind = "same weights" if outcome.max_difference <= tolerance else "different weights"
