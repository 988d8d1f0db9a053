"""One epoch of one pipeline stage: its steps on its replica's schedule, its held-out rows, and the epoch's logs
combined over the stages (the loss is every stage's share summed) and over the replicas (weighted by rows)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from sparkdl import schedule
from sparkdl.collective import ReduceOp
from sparkdl.keras import random_state, serialization
from sparkdl.keras.callbacks import STEP_REPORT_SECONDS

if TYPE_CHECKING:
    from sparkdl.checkpoint import Checkpointer, StepCheckpoints
    from sparkdl.modes.barrier import Ranks
    from sparkdl.position import EpochRest


def train_epochs(
    epochs: StageEpochs,
    ranks: Ranks,
    first_epoch: int,
    own_rows: tuple,
    saves: AssembledCheckpoints | None,
    *,
    rest: EpochRest | None = None,
    step_checkpoints: StepCheckpoints | None = None,
) -> dict[str, list[float]]:
    """Runs ``epochs`` from ``first_epoch`` on ``own_rows`` (``(training, held-out)``, or ``(None, None)`` for a stage
    that reads none): first the steps left of a resumed epoch (``rest``, where it resumed mid-epoch), then the whole
    epochs. The writer reports each epoch's end, and ``saves`` saves after each epoch (on every rank that contributes
    to the checkpoints). Every rank asks ``step_checkpoints`` after each step (they agree on the steps), and where a
    step checkpoint is due ``saves`` saves one. Returns the history."""
    history: dict[str, list[float]] = {}

    def after_step(epoch: int, steps: int, planned: int) -> None:
        if step_checkpoints is None or not step_checkpoints.due(epoch, steps, planned):
            return
        with step_checkpoints.saving():
            if saves is not None:
                saves.save_step(epoch, steps)

    for epoch in range(first_epoch, ranks.settings.epochs):
        started = time.monotonic()
        steps = rest if rest is not None and rest.epoch == epoch else None
        logs = epochs.run(epoch, *own_rows, rest=steps, after_step=after_step)
        for name, value in logs.items():
            history.setdefault(name, []).append(value)
        ranks.report_epoch(epoch, logs, time.monotonic() - started)
        if saves is not None:
            saves.save(epoch, logs)
    return history


class AssembledCheckpoints:
    """The checkpoints of a fit whose writer assembles the whole model from the ranks' parts (a pipeline's stages, a
    fully sharded replica's shards): ``assemble()``, run on every rank that holds a part (collective), gives the
    writer's whole model (None on the other ranks), which the writer's ``checkpointer`` saves (None elsewhere),
    mid-epoch with where the epoch stands (``rest``: the epoch the fit resumed inside, if it did), and with the
    layers' random state where ``seed_draws()`` gives the writer its generators' draws (``keras.random_state``)."""

    def __init__(
        self,
        ranks: Ranks,
        checkpointer: Checkpointer | None,
        assemble: Callable,
        rest: EpochRest | None,
        seed_draws: Callable[[], np.ndarray] | None = None,
    ):
        self.ranks, self.checkpointer, self.assemble, self.rest = ranks, checkpointer, assemble, rest
        self.seed_draws = seed_draws

    def save(self, epoch: int, logs: dict) -> None:
        """After epoch ``epoch``, whose combined metrics are ``logs``."""
        whole = self.assemble()
        if self.checkpointer is not None:
            self.checkpointer.record(logs)
            self.checkpointer.save(epoch + 1, serialization.model_to_bytes(whole), self._arrays())

    def save_step(self, epoch: int, steps: int) -> None:
        """After ``steps`` of the fit's steps in epoch ``epoch``."""
        whole = self.assemble()
        if self.checkpointer is not None:
            position = self.ranks.position_at(self.rest, epoch, steps)
            self.checkpointer.save(epoch, serialization.model_to_bytes(whole), self._arrays(), position=position)

    def _arrays(self) -> dict[str, np.ndarray]:
        draws = np.empty(0, np.int64) if self.seed_draws is None else self.seed_draws()
        return {random_state.DRAWS: draws} if len(draws) else {}  # a model without generators: nothing to carry


class StageMetrics:
    """The last stage's compiled metrics (the model's ``metrics=``), over the micro-batches they see.

    Updated by one compiled function: Keras updates them op by op when called eagerly, which was a third of a
    digits pipeline step's time (profiled with py-spy: 1,381 of 4,833 samples of the stages' training). The first
    update runs eagerly, so that the metrics build their variables outside the function.
    """

    def __init__(self, model) -> None:
        self.model = model
        self._compiled: Callable | None = None

    def update(self, y: np.ndarray, outputs) -> None:
        if self._compiled is not None:
            self._compiled(y, outputs)
            return
        import tensorflow as tf

        self.update_state(y, outputs)
        self._compiled = tf.function(self.update_state, reduce_retracing=True)

    def update_state(self, y, outputs) -> None:
        """The update itself, to be traced into a compiled step (``update`` compiles it on its own)."""
        self.model.compute_metrics(None, y, outputs, None)

    def reset(self) -> None:
        for metric in self.model.metrics:
            metric.reset_state()

    def result(self) -> dict[str, float]:
        return {name: float(value) for name, value in self.model.get_metrics_result().items() if name != "loss"}


class StageEpochs:
    """Runs a stage's epochs. ``shard_rows`` are the training and held-out rows of the replica's shard: the
    first and last stage hold them, every stage knows how many (the middle stages walk the schedule by count).

    ``pipeline``: the replica's stages, whose loss shares sum to the replica's loss (None: the runner is the whole
    model, as a fully sharded replica is, and each replica's loss is combined over ``replicas`` by rows).
    ``settle``: called after each epoch's last step, before validation (averaging the replicas' statistics).
    ``validation_steps``: where every replica's runner must take part in every evaluation step (a fully sharded
    replica gathers its weights from all), the most steps any replica's held-out rows take; a replica with fewer
    runs the rest with no rows (``runner.evaluate_nothing``), and one with none weighs nothing.
    """

    def __init__(
        self,
        runner,
        settings,
        *,
        replica: int,
        shard_rows: tuple[int, int],
        pipeline,
        replicas,
        metrics,
        report=None,
        settle=None,
        validation_steps: int | None = None,
    ):
        self.runner, self.settings, self.replica = runner, settings, replica
        self.rows, self.validation_rows = shard_rows
        self.pipeline, self.replicas, self.metrics = pipeline, replicas, metrics
        self.report = report  # the reporting task's: a progress event (at most one a second, for the steps)
        self.settle, self.validation_steps = settle, validation_steps

    def run(
        self,
        epoch: int,
        rows,
        held_out,
        *,
        rest: EpochRest | None = None,
        after_step: Callable[[int, int, int], None] | None = None,
    ) -> dict[str, float]:
        """Trains epoch ``epoch`` (``rows``/``held_out``: the shard's, on the first and last stage; None elsewhere),
        its steps left only where it resumed mid-epoch (``rest``); its logs, complete on the last stage (loss, metrics,
        ``val_*``), the loss alone elsewhere. ``after_step(epoch, steps, planned)`` after each of its ``planned``
        steps."""
        logs = self._train(epoch, rows, rest, after_step)
        if self.settle is not None:
            self.settle()
        if self.settings.validate:
            logs.update(self._validate(held_out))
        return logs

    def _train(self, epoch: int, rows, rest: EpochRest | None, after_step) -> dict[str, float]:
        settings, runner = self.settings, self.runner
        if rest is None:
            start, stop = epoch * settings.steps_per_epoch, (epoch + 1) * settings.steps_per_epoch
            parts = list(
                schedule.epoch_steps(
                    self.rows,
                    keys=None,
                    steps=settings.steps_per_epoch,
                    seed=settings.seed,
                    shuffle=settings.shuffle,
                    start=start,
                    stop=stop,
                )
            )
            batches = iter(settings.batches(rows, start, stop)) if rows is not None else None
        else:
            parts = rest.parts()
            batches = iter(rows.batches(parts)) if rows is not None else None
        sizes = [end - begin for part in parts for begin, end in part.spans]
        if self.metrics is not None:
            self.metrics.reset()
        total, reported, rows_since = 0.0, time.monotonic(), 0
        replicas = self.replicas.size if self.replicas is not None else 1
        for step, size in enumerate(sizes):
            x, y = next(batches)[:2] if batches is not None else (None, None)
            share = runner.train_step(*self._ends(x, y), micro_batches=min(size, runner.micro_batches), rows=size)
            total += share * size  # weighted by rows, as Keras's loss tracker weighs its steps
            rows_since, now = rows_since + size * replicas, time.monotonic()
            if self.report is not None and now - reported >= STEP_REPORT_SECONDS:
                rate = rows_since / (now - reported)
                self.report({"event": "step", "epoch": epoch, "step": step + 1, "logs": {}, "samples_per_second": rate})
                reported, rows_since = now, 0
            if after_step is not None:
                after_step(epoch, step + 1, len(sizes))
        metrics = self.metrics.result() if self.metrics is not None else {}
        weight = self.rows if rest is None else rest.rows_left  # the shard's rows these steps trained
        if self.pipeline is None:  # this replica's own loss: combined over the replicas like its metrics
            return self._over_replicas({"loss": total / sum(sizes), **metrics}, weight)
        loss = float(self.pipeline.allreduce(np.array([total], np.float64), ReduceOp.SUM)[0]) / sum(sizes)
        return {"loss": loss, **self._over_replicas(metrics, weight)} if self.metrics is not None else {"loss": loss}

    def _validate(self, held_out) -> dict[str, float]:
        runner, batch, count = self.runner, self.settings.batch_size, self.validation_rows
        if count == 0 and self.validation_steps is None:
            raise ValueError(
                f"Pipeline replica {self.replica}'s shard got no validation row: every shard needs held-out rows "
                "(use more rows, a larger validation_split, or fewer data replicas)."
            )
        if self.metrics is not None:
            self.metrics.reset()
        total = 0.0
        for begin in range(0, count, batch):
            size = min(batch, count - begin)
            x, y = held_out.take(np.arange(begin, begin + size))[:2] if held_out is not None else (None, None)
            loss = runner.evaluate_step(*self._ends(x, y), micro_batches=min(size, runner.micro_batches), rows=size)
            total += loss * size
        for _ in range(-(-count // batch), self.validation_steps or 0):  # the other replicas' steps
            runner.evaluate_nothing()
        if self.metrics is None:
            return {}
        values = {"val_loss": total / max(count, 1), **{f"val_{k}": v for k, v in self.metrics.result().items()}}
        return self._over_replicas(values, count)

    def _ends(self, x, y):
        return (x if self.runner.first else None), (y if self.runner.last else None)

    def _over_replicas(self, values: dict[str, float], weight: int) -> dict[str, float]:
        """``values`` averaged over this stage's replicas, each weighted by ``weight`` (its rows)."""
        if self.replicas is None:
            return values
        names = sorted(values)
        sums = self.replicas.allreduce(np.array([*(weight * values[n] for n in names), weight], np.float64))
        return {name: float(sums[i] / sums[-1]) for i, name in enumerate(names)}

    def summary_row(self) -> np.ndarray:
        """This stage's timings and memory, one row of the table every task gathers (:meth:`stats`)."""
        summary, model = self.runner.summary(), self.runner.model
        weight_bytes = sum(np.asarray(v.numpy()).nbytes for v in model.weights)
        optimizer_bytes = sum(np.asarray(v.numpy()).nbytes for v in model.optimizer.variables)
        keys = ("compute_seconds", "wait_seconds", "allreduce_seconds", "steps")
        row = [*(float(summary[k]) for k in keys), weight_bytes, optimizer_bytes, _peak_resident_bytes()]
        return np.array(row, np.float64)

    def stats(self, plan, rows: np.ndarray) -> dict:
        """``FitResult.stats["pipeline"]``: per stage of replica 0 (``rows``), its parameters, the bytes of weights
        and optimizer state its task held, its process's peak resident memory, its seconds computing and waiting,
        its idle fraction; the schedule, and the bound on the idle fraction (GPipe's, 1F1B's too)."""
        stages = []
        for parameters, row in zip(plan.parameters, rows):
            compute, wait, allreduce, steps, weight_bytes, optimizer_bytes, peak = row.tolist()
            stages.append(
                {
                    "parameters": parameters,
                    "weight_bytes": int(weight_bytes),
                    "optimizer_bytes": int(optimizer_bytes),
                    "peak_resident_bytes": int(peak),
                    "compute_seconds": compute,
                    "wait_seconds": wait,
                    "allreduce_seconds": allreduce,
                    "idle_fraction": wait / (compute + wait) if compute + wait else 0.0,
                }
            )
        summary = self.runner.summary()
        return {
            "stages": stages,
            "micro_batches": self.runner.micro_batches,
            "schedule": self.runner.schedule,
            "steps": int(summary["steps"]),
            "idle_fraction": float(np.mean([s["idle_fraction"] for s in stages])),
            "gpipe_bound": summary["gpipe_bound"],
        }

    def close(self) -> None:
        self.runner.close()


def _peak_resident_bytes() -> int:
    """The most memory this process has had resident, as the kernel counts it (``getrusage``'s ``ru_maxrss``): the
    stage task's peak, or its Python worker's since it started where Spark reuses workers."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
