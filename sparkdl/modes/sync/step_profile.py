"""Where a sync step's time goes, phase by phase, on every rank: what ``fit(profile=True)`` reports.

A step is cut by clock readings taken in order: Keras starts the step (a callback, first of
all), the step's data reaches the compiled step (a stamp in the graph, on the data), the
gradients are ready (the reducer's call, which also notes whether the first bucket, the last
layers', has already been averaged), every rank has reached a blocking exchange (a barrier, taken
only while profiling so that waiting for a slower peer is not counted as communication; with
buckets in flight there is no such wait), the averaged gradients are back, the optimizer has applied them (a stamp after its updates),
Keras hands the step back to Python, and the next step starts (the same callback):

| phase              | from                      | to                                      |
|--------------------|---------------------------|-----------------------------------------|
| ``input``          | Keras starts the step     | the data reaches the step               |
| ``forward_backward``| the data                 | all gradients ready                     |
| ``wait_for_peers`` | the gradients             | every rank ready (no stamp with overlap: 0) |
| ``collective``     | every rank ready          | averages back (with overlap: the part not hidden behind backprop) |
| ``optimizer``      | averages back             | the updates applied (sharded: this rank's shard's) |
| ``allgather``      | the shard's update        | the weights gathered from every rank (sharded mode; 0 in sync) |
| ``keras``          | the updates               | Keras back in Python with the logs      |
| ``callbacks``      | Keras back in Python      | the next step starts                    |

Each stamp charges the time since the previous one to the phase it ends, so the phases add up
to the wall time of the steps, also when Keras runs several steps per call (``steps_per_execution``:
``input`` then holds the next step's wait for data, ``keras`` and ``callbacks`` are paid once per
call). The stamps are Python calls inside the compiled step, so profiling costs a little (tens of
microseconds a stamp, one barrier a blocking exchange). The first steps (tracing) and epoch boundaries
(validation, epoch-end callbacks) are left out.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

PHASES = ("input", "forward_backward", "wait_for_peers", "collective", "optimizer", "allgather", "keras", "callbacks")
# Each stamp ends a phase: the time since the previous stamp is charged to it.
_ENDS = {
    "data": "input",
    "gradients": "forward_backward",
    "peers": "wait_for_peers",
    "reduced": "collective",
    "applied": "optimizer",
    "gathered": "allgather",
    "returned": "keras",
    "began": "callbacks",
}
_WARMUP_STEPS = 3  # the first steps of a fit trace the graph: not what a step costs


class StepProfile:
    """Collects one rank's stamps; :meth:`summary` gives every rank's mean milliseconds per phase."""

    def __init__(self):
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._last: float | None = None  # the previous stamp; None at the start of an epoch
        self._applied = 0  # steps done, warm-up included
        self._buckets = 0  # a step's gradient buckets
        self._buckets_done = 0  # buckets averaged before backprop ended, over the counted steps
        self._first_bucket_early: list[bool] = []  # per counted step: the last layers' bucket averaged by then
        self._nbytes = 0  # a step's gradient bytes, at their width on the wire
        self.compiled_update = False  # the optimizer's update runs XLA-compiled (``keras.compiled_update``)
        self._last_applied: float | None = None  # the previous step's "applied" stamp, in this epoch
        self._step_seconds: list[float] = []  # each counted step's wall time: from one "applied" stamp to the next

    def _stamp(self, name: str) -> float:
        now = time.perf_counter()
        if self._last is not None and self._applied > _WARMUP_STEPS:
            self._totals[_ENDS[name]] += now - self._last
        self._last = now
        return now

    # -- stamps, in the order a step takes them ------------------------------------------------------

    def step_began(self) -> None:
        self._stamp("began")

    def data_ready(self, *_) -> np.int32:
        self._stamp("data")
        return np.int32(0)

    def gradients_ready(self, *, done: list[bool], nbytes: int) -> None:
        """Backprop is over; ``done[b]``: whether the step's bucket ``b`` (the last layers' first; ``nbytes`` to
        average, as they go on the wire) has already been averaged (overlap at work)."""
        self._stamp("gradients")
        if self._applied >= _WARMUP_STEPS:
            self._buckets, self._nbytes, self._buckets_done = len(done), nbytes, self._buckets_done + sum(done)
            self._first_bucket_early.append(done[0])

    def peers_ready(self, comm) -> None:
        """Waits for every rank (a barrier on ``comm``) before a blocking exchange, charged to ``wait_for_peers``."""
        comm.barrier()
        self._stamp("peers")

    def exchange_done(self) -> None:
        self._stamp("reduced")

    def applied(self) -> np.int32:
        now = self._stamp("applied")
        if self._last_applied is not None and self._applied > _WARMUP_STEPS:
            self._step_seconds.append(now - self._last_applied)
        self._last_applied = now
        self._applied += 1
        return np.int32(0)

    def gathered(self) -> np.int32:
        """Sharded mode: every rank's updated shard is in this rank's weights."""
        self._stamp("gathered")
        return np.int32(0)

    def step_returned(self) -> None:
        self._stamp("returned")

    def epoch_ended(self) -> None:
        """An epoch boundary: validation and epoch-end callbacks are not a step's."""
        self._last = None
        self._last_applied = None

    @property
    def _steps(self) -> int:
        return max(self._applied - _WARMUP_STEPS, 0)

    # -- results -----------------------------------------------------------------------------------

    def summary(self, comm) -> dict:
        """Every rank's mean milliseconds per phase, its median milliseconds per step (whole steps: unlike a
        mean, a stall of the machine in a few steps leaves it as it is), its mean buckets per step already averaged
        when backprop ended, and its steps whose first bucket (the last layers') was: ``{"steps": n, "buckets": b,
        "gradient_bytes": g, "compiled_update": c, phase: [rank 0, rank 1, ...], "step_median": [...],
        "buckets_done_early": [...], "steps_overlapped": [...]}`` (``g``: a step's gradients as they go on the wire, before the allreduce's
        2(N-1)/N; ``c``: the optimizer's update ran XLA-compiled). Collective: every rank calls it."""
        steps = max(self._steps, 1)
        mine = [1000.0 * self._totals[phase] / steps for phase in PHASES]
        mine += [1000.0 * float(np.median(self._step_seconds)) if self._step_seconds else 0.0]
        mine += [self._buckets_done / steps, sum(self._first_bucket_early), self._steps, self._buckets, self._nbytes]
        everyone = comm.allgather(np.array(mine, np.float64))
        summary: dict[str, Any] = {
            "steps": int(everyone[:, -3].min()),
            "buckets": int(everyone[0, -2]),
            "gradient_bytes": int(everyone[0, -1]),
            "compiled_update": self.compiled_update,
        }
        summary.update({phase: [round(float(v), 3) for v in everyone[:, i]] for i, phase in enumerate(PHASES)})
        summary["step_median"] = [round(float(v), 3) for v in everyone[:, len(PHASES)]]
        summary["buckets_done_early"] = [round(float(v), 3) for v in everyone[:, len(PHASES) + 1]]
        summary["steps_overlapped"] = [int(v) for v in everyone[:, len(PHASES) + 2]]
        return summary

    # -- what Keras runs ---------------------------------------------------------------------------

    def wrap_train_step(self, train_step):
        """``train_step`` with the data-ready stamp taken before it (on the data, so once it is there)."""
        import tensorflow as tf

        def profiled_train_step(data):
            first = tf.nest.flatten(data)[0]
            stamp = tf.numpy_function(self.data_ready, [first], tf.int32, stateful=True, name="sparkdl_profile_data")
            with tf.control_dependencies([stamp]):
                data = tf.nest.map_structure(tf.identity, data)
            return train_step(data)

        return profiled_train_step

    def callback(self):
        """The Keras callback that stamps a step's start and return; it must run first of all."""
        import keras

        profile = self

        class StepStamps(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                profile.step_began()

            def on_train_batch_end(self, batch, logs=None):
                profile.step_returned()

            def on_epoch_end(self, epoch, logs=None):
                profile.epoch_ended()

        return StepStamps()
