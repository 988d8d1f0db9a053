"""The driver's checkpoints of the parameter server's state, in both placements, with where every worker stood.

The driver saves the shards' state each time every worker has finished an epoch, and when workers ask for a step
checkpoint (``step_requests``); every checkpoint also holds the workers' positions (``sparkdl.ps.positions``), so
that a fit resumed from it (the same call again, or a stage Spark retried with ``server_placement="executors"``)
starts every worker at its own next step: each shard applies each worker's step once. A step checkpoint is named by
where its epoch stands (``WorkerPositions.epoch_position``: under sync_ps the steps every worker trained into it,
else the workers' steps summed), and only a place after the last one saved is saved (in async, hogwild and ssp the
workers' epochs differ: a request that finds the slowest worker where it was is skipped).

:func:`resume_positions` is the other side: the positions a fit resumes from, checked against its workers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import numpy as np

from sparkdl.checkpoint import Checkpoint, Checkpointer
from sparkdl.modes.base import Settings
from sparkdl.ps.positions import WorkerPositions

logger = logging.getLogger(__name__)


class ServerCheckpoints:
    """The driver's writer of the servers' checkpoints (the fit's ``checkpointer``), for workers of ``settings``
    stepping in ``lockstep`` (sync_ps) or each its own steps; ``start``: the checkpoint the fit started from."""

    def __init__(self, checkpointer: Checkpointer, settings: Settings, *, lockstep: bool, start: Checkpoint):
        self.checkpointer = checkpointer  # records the epochs' metrics (the callers, before a save)
        self._settings = settings
        self._lockstep = lockstep
        self._lock = threading.Lock()
        self._place = start.place  # the last checkpoint's
        self._saves = 0
        self._asked: dict[int, int] = {}  # worker -> the saves there had been at its last request
        self.step_saves = 0

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """One checkpoint's state read and save at a time."""
        with self._lock:
            yield

    def wants_step(self, worker: int) -> bool:
        """Whether ``worker``'s request is one the driver saves for: under sync_ps every one (worker 0's, whose rounds
        wait for it), else one with no save since the worker's request before (the others' requests of the same
        interval then find this save)."""
        asked, self._asked[worker] = self._asked.get(worker, 0), self._saves
        return self._lockstep or asked == self._saves

    def save(
        self,
        model_bytes: bytes,
        arrays: dict[str, np.ndarray],
        positions: tuple[list[int], list[int], list[list[int]]] | None,
        *,
        epochs: int | None = None,
    ) -> None:
        """Saves the shards' state (``model_bytes``, the optimizers' ``arrays``) with the workers' ``positions``
        (``ParameterServer.positions``: rows, key sums, next steps per shard; None: every worker at its last step)
        after ``epochs`` complete epochs, or (None) as a step checkpoint where the epoch stands, if that is after
        the last checkpoint."""
        position = None
        if positions is not None:
            rows, key_sums, next_steps = positions
            settings = self._settings
            where = WorkerPositions(
                settings.seed,
                settings.shuffle,
                self._lockstep,
                tuple(rows),
                tuple(key_sums),
                tuple(tuple(steps) for steps in next_steps),
            )
            arrays = {**arrays, where.ARRAY: where.to_vector()}
            if epochs is None:
                stands = where.epoch_position(settings.batch_size, settings.initial_epoch, settings.by_partition)
                if stands is None or stands[1] is None or (stands[0], stands[1].steps) <= self._place:
                    logger.debug("sparkdl: no step checkpoint: the workers stand where the last one was (%s)", stands)
                    return
                epochs, position = stands
                self.step_saves += 1
        assert epochs is not None, "a step checkpoint has the workers' positions"
        self.checkpointer.save(epochs, model_bytes, arrays, position=position)
        self._place = (epochs, position.steps if position is not None else 0)
        self._saves += 1


def resume_positions(
    start: Checkpoint, settings: Settings, *, lockstep: bool, num_servers: int
) -> WorkerPositions | None:
    """Where the workers of a fit resumed from ``start`` begin (its positions on ``num_servers`` shards), or None: a
    fresh fit, or an epoch checkpoint without positions the workers can take (of another mode, or as many workers),
    which they start at its epoch's first step. Refuses a step checkpoint they cannot resume."""
    vector = start.arrays.get(WorkerPositions.ARRAY)
    positions = WorkerPositions.from_vector(vector) if vector is not None else None
    usable = positions is not None and positions.num_workers == settings.num_workers and positions.lockstep == lockstep
    if start.position is not None and not usable:
        saved = "no worker positions" if positions is None else f"{positions.num_workers} workers' positions"
        raise ValueError(
            f"Expected a step checkpoint of this mode's schedule and {settings.num_workers} workers. Received: "
            f"{start.mode!r}'s checkpoint {start.stem} with {saved}. The parameter-server modes resume mid-epoch "
            "where each worker stood, on as many workers and in the schedule it was taken in (sync_ps's, or async, "
            "hogwild and ssp's): resume with those, or start another checkpoint_dir."
        )
    if positions is not None and not usable:
        logger.warning(
            "sparkdl: the checkpoint after epoch %d holds the positions of %d workers of %s; this fit's %d start at "
            "the epoch's first step",
            start.epoch,
            positions.num_workers,
            "sync_ps" if positions.lockstep else "async, hogwild or ssp",
            settings.num_workers,
        )
        return None
    return positions.on_shards(num_servers) if positions is not None else None
