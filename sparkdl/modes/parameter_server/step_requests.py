"""A worker's side of the parameter server's step checkpoints: when one of its pushes asks the driver for one.

The driver saves the servers' state, with where every worker stands (``sparkdl.ps.positions``), when a worker asks
(a progress event, sent after the push of its step and the pull that follows, so that the state holds that step).
Each worker asks every ``checkpoint_every`` (of its own steps, or time), never at an epoch's last step (that epoch's
own checkpoint follows) nor at its last one, and the driver saves once for the requests that came since its last
save. Under sync_ps the workers step together: worker 0 alone asks, and before its push holds the rounds after that
step (``Msg.HOLD``) until the driver has read the state, so that every shard's state is the one after that step.
"""

from __future__ import annotations

from collections.abc import Callable

from sparkdl.checkpoint import CheckpointInterval, StepCheckpoints

#: The progress event of a worker asking for a step checkpoint: ``{"event": REQUEST_EVENT, "step": steps done}``.
REQUEST_EVENT = "checkpoint"


class StepRequests:
    """When a worker whose global steps are ``steps_per_epoch`` an epoch, starting at global step ``first``, asks for a
    step checkpoint every ``interval`` (``report`` sends the request); ``holds``: it holds the rounds (sync_ps)."""

    def __init__(
        self,
        interval: CheckpointInterval,
        *,
        steps_per_epoch: int,
        first: int,
        holds: bool,
        report: Callable[[dict], None],
    ):
        self._checkpoints = StepCheckpoints(interval)
        self._steps_per_epoch, self._first = steps_per_epoch, first
        self.holds = holds
        self._report = report

    def due(self, step: int) -> bool:
        """Whether its push of global ``step`` asks for a step checkpoint of the state after it."""
        epoch = step // self._steps_per_epoch
        start = max(self._first, epoch * self._steps_per_epoch)  # this run's first step of the epoch
        return self._checkpoints.due(epoch, step + 1 - start, (epoch + 1) * self._steps_per_epoch - start)

    def ask(self, step: int) -> None:
        """Asks the driver for the step checkpoint after global ``step`` (pushed and pulled by now)."""
        with self._checkpoints.saving():
            self._report({"event": REQUEST_EVENT, "step": step + 1})
