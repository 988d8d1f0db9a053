"""The short probe ``sparkdl.plan`` runs on the cluster: one worker's training step at two batch sizes, and the
links between ``num_workers`` tasks.

- Step: ``sparkdl.fit`` on one worker (a task of the cluster, with the threads a task gets) for a few
  steps of the user's own rows, with ``profile=True``: the milliseconds a step spends on everything
  but communication (input, forward and backward, optimizer, Keras), at two batch sizes; a step's
  time is taken as linear in the batch between and beyond them.
- Links: ``sparkdl.run`` on ``num_workers`` tasks timing the ring allreduce (``algorithm="ring"``,
  sparkdl's TCP links) of a few sizes, from a few bytes to the model's gradients and at least 8 MiB; the
  latency-bandwidth constants are fitted on them (``cost.fit``). At 1 MiB a loopback allreduce moves its bytes in
  about a call's fixed cost, so on a busy machine the noise decided whether bandwidth came out as zero: 8 MiB
  takes several times the fixed cost everywhere, so the bandwidth is measured. On one host sparkdl would use
  shared memory instead, which is faster: the ring's constants are what a fit across machines meets.
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from sparkdl.collective import cost

_STEPS = 10  # steps of each probing fit: the profile leaves out the first three (tracing)
_REPEATS = 5  # timed calls of each allreduce size
_LEAST_LARGEST = 8 << 20  # bytes of the largest allreduce timed, whatever the model's size


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the probe measured: a step's seconds on one worker by batch size, and the links' constants."""

    step_seconds: dict[int, float]  # per-worker batch size -> seconds of one step, communication left out
    link: cost.Params  # the ring's fitted constants between the probe's tasks (zero with one task)
    measurements: tuple[cost.Measurement, ...]  # the allreduce timings the constants were fitted on
    gradient_bytes: int  # the model's trainable float32 bytes: what a step's gradients or weights weigh

    def compute_seconds(self, batch_size: int) -> float:
        """One worker's step at ``batch_size`` rows: linear through the two measured sizes (never below zero)."""
        (small, t_small), (large, t_large) = (
            sorted(self.step_seconds.items())[:1] + sorted(self.step_seconds.items())[-1:]
        )
        if large == small:
            return t_small * batch_size / small
        slope = max((t_large - t_small) / (large - small), 0.0)
        return max(t_small + slope * (batch_size - small), 0.0)


def measure(df, model, *, num_workers: int, batch_sizes: tuple[int, int], fit_settings: dict, timeout: float) -> Probe:
    """Runs the probe: a profiled fit on one worker per batch size, and the links between ``num_workers`` tasks."""
    steps = {size: _step_seconds(df, model, size, fit_settings, timeout) for size in batch_sizes}
    gradient_bytes = 4 * int(sum(np.prod(v.shape) for v in model.trainable_variables))
    measurements = _link_measurements(df.sparkSession, num_workers, gradient_bytes, timeout) if num_workers > 1 else ()
    link = cost.fit(measurements, terms=("alpha", "beta")) if measurements else cost.Params(0.0, 0.0)
    return Probe(steps, link, tuple(measurements), gradient_bytes)


def _step_seconds(df, model, batch_size: int, fit_settings: dict, timeout: float) -> float:
    import keras

    import sparkdl

    copy = keras.models.clone_model(model)  # the user's model keeps its weights and optimizer state
    copy.set_weights(model.get_weights())
    copy.compile_from_config(model.get_compile_config())
    rows = df.limit(_STEPS * batch_size)
    result = sparkdl.fit(
        rows,
        copy,
        mode="sync",
        num_workers=1,
        epochs=1,
        batch_size=batch_size,
        profile=True,
        progress=False,
        timeout=timeout,
        seed=0,
        **fit_settings,
    )
    return result.stats["step_profile"]["step_median"][0] / 1000.0  # one worker: no communication in it


def _link_measurements(spark, num_workers: int, gradient_bytes: int, timeout: float) -> list[cost.Measurement]:
    import sparkdl

    largest = max(min(gradient_bytes, 64 << 20), _LEAST_LARGEST)
    sizes = sorted({4096, 1 << 20, largest})
    seconds = sparkdl.run(
        _time_allreduces, num_workers=num_workers, args=(sizes, _REPEATS), timeout=timeout, spark=spark
    )
    return [
        cost.Measurement(cost.collective("allreduce", "ring", num_workers, size), s) for size, s in zip(sizes, seconds)
    ]


def _time_allreduces(sizes: list[int], repeats: int) -> list[float]:
    """In every task: the median seconds of a ring allreduce of each size (every rank in step: a barrier first)."""
    import time

    from sparkdl import collective

    comm = collective.communicator()
    medians = []
    for size in sizes:
        values = np.ones(size // 4, np.float32)
        comm.allreduce(values, algorithm="ring")  # the links' first use
        times = []
        for _ in range(repeats):
            comm.barrier()
            started = time.perf_counter()
            comm.allreduce(values, algorithm="ring")
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
    slowest = comm.allreduce(np.array(medians), collective.ReduceOp.MAX)  # the step waits for the slowest rank
    return [float(s) for s in slowest]
