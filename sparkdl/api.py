"""``sparkdl.fit``: validate, prepare, run the mode, build the result."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time

from pyspark.sql import DataFrame

from sparkdl import data, launch, tracking
from sparkdl.checkpoint import DEFAULT_INTERVAL, Checkpoint, Checkpointer, CheckpointInterval, CheckpointStore
from sparkdl.data import ColumnSpec
from sparkdl.keras import serialization, shipped_objects
from sparkdl.launch import probe
from sparkdl.launch.errors import SlotsLost
from sparkdl.launch.phases import Phases
from sparkdl.metrics import merge_histories
from sparkdl.modes.base import Job, ModeResult, Plan, Settings
from sparkdl.modes.keywords import with_mode_options
from sparkdl.modes.registry import MODES as _REGISTRY
from sparkdl.modes.registry import check_mode_options
from sparkdl.progress import ProgressMonitor
from sparkdl.validate import check_callbacks, check_settings, check_validation

logger = logging.getLogger(__name__)

MODES = tuple(_REGISTRY)  # the names ``fit(mode=...)`` accepts, from the one registry (``sparkdl.modes.registry``)

__all__ = ["FitResult", "MODES", "check_mode_options", "fit"]


@dataclasses.dataclass
class FitResult:
    """What ``sparkdl.fit`` returns.

    ``model`` is a new ``keras.Model`` on the driver holding the trained
    weights and optimizer state (the model passed in is left untouched);
    ``history`` maps each metric to its per-epoch values averaged over workers;
    ``steps_per_epoch`` the steps each worker ran per epoch (every training row once per epoch: the
    largest partition in batches of ``batch_size``; in async/hogwild/ssp, where each worker runs its own
    partition's steps, the most any worker ran);
    ``stats`` holds the mode's counters (samples, pushes, pulls, bytes,
    highest staleness seen, rounds); ``validation_rows`` the rows held out
    for validation (0 without ``validation_col``/``validation_split``);
    ``initial_epoch`` the epoch training (re)started from: above 0 when it
    resumed from a checkpoint in ``checkpoint_dir``, left by an earlier fit or
    by a failed attempt of this one; ``phases`` where the fit's wall-clock
    seconds went, phase by phase in order, the driver's and rank 0's
    (``settings``, ``slots``, ``checks``, ``probe``, ``serialize``, ``launch``,
    then rank 0's own, e.g. ``import``, ``read``, ``connect``, ``model in``,
    ``train``, ``model out`` in sync mode, then ``result``; see docs/performance.md).
    """

    model: object
    history: dict[str, list[float]]
    num_workers: int
    steps_per_epoch: int
    seconds: float
    stats: dict = dataclasses.field(default_factory=dict)
    validation_rows: int = 0
    initial_epoch: int = 0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


def fit(
    df: DataFrame,
    model,
    *,
    features_col: ColumnSpec = "features",
    label_col: ColumnSpec = "label",
    sample_weight_col: str | None = None,
    num_workers: int = 2,
    mode: str = "sync",
    epochs: int = 1,
    batch_size: int = 32,
    shuffle: bool = True,
    seed: int | None = None,
    validation_col: str | None = None,
    validation_split: float | None = None,
    timeout: float = 600.0,
    custom_objects: dict | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | str | None = None,
    min_workers: int | None = None,
    callbacks: list | None = None,
    progress: bool = True,
    tensorboard_dir: str | None = None,
    log_to_mlflow: bool = False,
    **mode_options,
) -> FitResult:
    """Trains a compiled Keras 3 model on a Spark DataFrame with ``num_workers`` Spark tasks.

    Modes (``mode=``; docs/modes.md compares them):
        {modes}

    Args:
        df: the training data.
        model: a compiled ``keras.Model`` (TensorFlow backend); it is left untouched.
        features_col: the model's input: a number, Vector, (nested) number array or image column
            (Spark's image source), or a list of number columns; for a model with several inputs, a
            mapping from input name to one of those. Each row is reshaped to its input's shape (flat
            rows of the input's size, or nested arrays of its shape); integer columns reach integer
            inputs as integers (ids stay exact); see docs/data.md.
        label_col: the target: a number, Vector or (nested) array column, or a list of number
            columns; for a model with several outputs, a mapping from output name to one of those.
            Integer columns arrive as int64, others as float32.
        sample_weight_col: a number column (>= 0) weighting each row's loss, as Keras's
            ``sample_weight`` does (weighted metrics follow Keras: ``compile(weighted_metrics=...)``).
        num_workers: Spark tasks that train together; at most the cluster's task slots (the fit waits for free
            ones, up to ``timeout``).
        epochs: passes over the whole DataFrame.
        batch_size: rows per worker per step.
        shuffle: reshuffle every worker's rows each epoch.
        seed: makes shuffling and per-worker randomness reproducible.
        validation_col: a boolean column; rows where it is true are held out for validation
            (never trained on). Not together with ``validation_split``.
        validation_split: a fraction in (0, 1) of the rows held out for validation, chosen by a
            hash of each row seeded with ``seed`` (``data.validation_split_mask``): the same rows
            for the same seed and data.
            With either setting, ``history`` also holds ``val_<metric>`` per epoch for every
            metric (``val_loss``, ``val_accuracy``, ...), as Keras's ``fit(validation_data=...)``
            does: the held-out rows evaluated with the epoch's final weights (per mode: sync, the
            replicas' common weights; async/hogwild/ssp, each worker's weights at its epoch end,
            combined weighted by held-out rows; average, the averaged model after the round that
            completes the epoch). Steps per epoch count the training rows only.
        timeout: seconds any single network wait may take before the job fails, and the longest the fit waits for
            task slots that other sparkdl fits or other jobs hold (``sparkdl.launch.slots``). An executor's Python
            starting (its workers, TensorFlow imported: for the check before training, or for a rank's task on a
            new executor, which the other ranks wait for) is given up to five minutes however short
            this is (``sparkdl.launch.worker_python.STARTUP_SECONDS``).
        custom_objects: Keras custom objects (name -> class or function) for ``keras.models.load_model`` on the
            workers. Rarely needed: classes and functions the model uses that the workers cannot import (defined in
            the driver's script or notebook, or registered at run time) are found on the driver and sent with the
            job (``sparkdl.keras.shipped_objects``); one that cannot be found is refused before any Spark job.
        checkpoint_dir: a directory (local path, ``file://``, ``hdfs://``, ``s3://``, ...) where the
            model, its optimizer state and the history are saved after every epoch (by the writer rank
            inside the stage in the barrier modes, by the driver in the others; see ``sparkdl.checkpoint``),
            and mid-epoch every ``checkpoint_every``. A fit pointed at a directory holding checkpoints
            continues from the newest one, and a barrier stage Spark retries after losing a task resumes
            from it. On a cluster it must be storage
            every executor reaches.
        checkpoint_every: with ``checkpoint_dir``, also save mid-epoch: every so many steps (an int), or every so
            long (``"30s"``, ``"10min"``, ``"2h"``; default ``"10min"`` in the modes that take it,
            ``Plan.saves_step_checkpoints``). A fit resumed from such a checkpoint (a retried stage, or the same
            call again) trains exactly the rows its epoch had not trained yet, on as many workers as it has
            (``sparkdl.position``; docs/checkpoints.md).
        min_workers: the fewest workers the fit goes on with (default: ``num_workers``, as before). Where a lost
            executor's task slots do not come back within ``timeout``, a fit of a mode that resumes mid-epoch
            (``checkpoint_every``; needs ``checkpoint_dir``) starts again from its newest checkpoint on the slots
            there are, at least ``min_workers``: the epoch's untrained rows dealt over them, the global batch kept
            where ``num_workers * batch_size`` divides among them (each worker's batch grows), else the nearest
            larger one; the log and ``FitResult.stats["workers_lost"]`` say what changed. In async, hogwild and
            ssp (servers on the driver) the other workers go on without a lost one, whose task Spark retries when a
            slot is free, from its own step: ssp sets a worker silent for ``timeout`` aside rather than failing
            (``FitResult.stats["workers_set_aside"]``). sync_ps and average refuse it.
        callbacks: Keras callbacks to run inside every worker (sync mode: after the metrics are
            averaged over workers, so every rank sees, and decides on, the same values).
        progress: show progress on the console: a bar where one can be seen (terminal, notebook) and
            one line per epoch (docs/output.md). Epoch lines are logged on the ``sparkdl.progress``
            logger (INFO) either way.
        tensorboard_dir: write per-epoch metrics and throughput there for TensorBoard (needs the
            ``tensorboard`` package), from the driver.
        log_to_mlflow: log the settings and per-epoch metrics to MLflow (the active run, or a new
            one), from the driver.
        **mode_options: the settings only some modes take (below; docs/modes.md), each declared by its
            mode (``sparkdl.modes.base.Option``); one the chosen mode does not take is an error.

    Mode options:
        {mode_options}

    Example:
        >>> result = sparkdl.fit(df, model, features_col="features", label_col="label",
        ...                      num_workers=2, epochs=20, batch_size=16, seed=0)
        >>> result.history["loss"][-1]
    """
    arguments = dict(locals())  # this call's, for a fit that goes on with fewer workers (``_with_fewer_workers``)
    phases = Phases()
    check_settings(df, model, num_workers=num_workers, epochs=epochs, batch_size=batch_size, timeout=timeout, seed=seed)
    values = check_mode_options(mode, **mode_options)
    plan = _REGISTRY[mode].configure(mode, model, values)
    plan.check_fit(num_workers=num_workers, batch_size=batch_size, weighted=sample_weight_col is not None)
    layout = plan.layout(num_workers)
    check_validation(validation_col, validation_split)
    interval = _checkpoint_interval(plan, checkpoint_dir, checkpoint_every)
    _check_min_workers(plan, min_workers, num_workers, batch_size, sample_weight_col is not None, checkpoint_dir)
    worker_callbacks = check_callbacks(callbacks, plan.refuses_callbacks())
    if not isinstance(progress, bool):
        raise ValueError(f"Expected `progress` to be True or False. Received: progress={progress!r}")
    tracking.check_available(tensorboard_dir, log_to_mlflow)
    custom_objects = shipped_objects.for_model(model, custom_objects)  # what the workers cannot find themselves
    checkpoints = CheckpointStore.open(checkpoint_dir) if checkpoint_dir is not None else None
    resumed = _newest_checkpoint(checkpoints, model, custom_objects)
    phases.end("settings")

    # Prepare: the slots, the data, the executors' Python, the job.
    # The slots are held from here to the end of the fit: other fits running now cannot take them.
    try:
        with launch.claim_slots(df.sparkSession, layout.slots, why=plan.why_all_at_once, timeout=timeout):
            seed = secrets.randbelow(2**31) if seed is None else seed
            planned = data.plan(
                df,
                model,
                features_col,
                label_col,
                sample_weight_col=sample_weight_col,
                validation_col=validation_col,
                validation_split=validation_split,
                seed=seed,
            )  # the columns, matched to the model's inputs and outputs: no Spark job
            # The rows are checked where the training tasks read them: no pass over the data of their own.
            training = planned.training()
            asked = time.perf_counter()
            workers = probe.start_check(df.sparkSession, layout.slots, probe.startup_timeout(timeout))
            try:  # by whole input partitions where it can, no shuffle (a persisted input's count job beside the probe)
                read_as = resumed.read_as if resumed is not None else None
                layout, frame, deal = layout.dealt(
                    df, training.frame, read_as, tasks_read_files=plan.reads_rows_in_its_stage
                )
                training = dataclasses.replace(training, frame=frame)
            except Exception:
                workers.wait()  # a broken executor Python fails the count job too: the probe's error names why
                raise
            phases.end("slots")
            settings = Settings.for_data(
                training,
                num_workers=num_workers,
                shards=layout.shards,
                by_partition=layout.by_partition,
                epochs=epochs,
                batch_size=batch_size,
                seed=seed,
                shuffle=shuffle,
                custom_objects=custom_objects,
                timeout=timeout,
                initial_epoch=resumed.epoch if resumed is not None else 0,
                initial_position=resumed.checkpoint.position if resumed is not None else None,
                checkpoint_every=interval,
                min_workers=min_workers,
                callbacks=worker_callbacks,
            )
            steps = settings.steps_per_epoch  # an estimate: the workers count their rows and report the exact steps
            if resumed is not None and resumed.epoch >= epochs:
                logger.info(
                    "sparkdl: %s already holds %d trained epochs (epochs=%d): nothing to train",
                    checkpoint_dir,
                    resumed.epoch,
                    epochs,
                )
                workers.wait()  # its job ends with the fit's claim on the slots
                return _result(
                    ModeResult(resumed.model, {}, {}, resumed.epoch),
                    resumed.checkpoint,
                    num_workers=num_workers,
                    steps_per_epoch=steps,
                    seconds=0.0,
                    validation_rows=0,
                    phases=phases,
                )
            start = (
                resumed.checkpoint
                if resumed is not None
                else Checkpoint(0, serialization.model_to_bytes(model), {}, mode)
            )
            logger.info(
                "sparkdl: %s training on %d workers, %d epochs%s",
                mode,
                num_workers,
                epochs,
                f", resuming after epoch {start.epoch}" if start.epoch else "",
            )
            monitor = ProgressMonitor(
                epochs=epochs,
                steps_per_epoch=steps,
                initial_epoch=start.epoch,
                reporting_ranks=plan.reporting_ranks(num_workers),
                console=progress,
                listeners=_listeners(tensorboard_dir, log_to_mlflow, mode=mode, settings=settings, values=values),
                description=f"sparkdl {mode} x{num_workers}",
                watch=phases.watch,
            )
            phases.end("serialize")
            waited = workers.wait()  # the executors' Python checked (and TensorFlow loaded) while the driver prepared
            phases.end("probe")

            # Run the mode; the driver's checkpointer (for modes that save there) is closed once it returns,
            # raising what it could not write.
            started = time.perf_counter()
            on_driver = checkpoints if plan.saves_checkpoints == "driver" else None
            with (
                monitor,
                Checkpointer(on_driver, start, mode) if on_driver else contextlib.nullcontext() as checkpointer,
            ):
                result = plan.run(
                    Job(
                        training=training,
                        start=start,
                        settings=settings,
                        plan=plan,
                        monitor=monitor,
                        layout=layout,
                        checkpoints=checkpoints,
                        checkpointer=checkpointer,
                    )
                )
            seconds = time.perf_counter() - started
            phases.end("result")
            logger.info("sparkdl: phases %s; rows %s; %s", phases, deal, workers.summary(waited, asked))
            return _result(
                result,
                start,
                num_workers=num_workers,
                steps_per_epoch=monitor.steps_per_epoch,
                seconds=seconds,
                validation_rows=monitor.counted_rows[1],
                phases=phases,
            )
    except SlotsLost as lost:
        if min_workers is None or min_workers >= num_workers:
            raise
        weighted = sample_weight_col is not None
        going_on = _fewer_workers(plan, num_workers, batch_size, weighted, at_most=lost.available, at_least=min_workers)
        if going_on is None:
            raise
        return _with_fewer_workers(arguments, going_on)


def _result(
    result: ModeResult,
    start: Checkpoint,
    *,
    num_workers: int,
    steps_per_epoch: int,
    seconds: float,
    validation_rows: int,
    phases: Phases,
) -> FitResult:
    """The one place a ``FitResult`` is built: the mode's result, behind the history of the epochs it resumed
    after (``start``'s, or the newer checkpoint's the mode resumed from: ``ModeResult.resumed_history``)."""
    earlier = start.history if result.resumed_history is None else result.resumed_history
    return FitResult(
        model=result.model,
        history=merge_histories(earlier, result.history),
        num_workers=num_workers,
        steps_per_epoch=steps_per_epoch,
        seconds=seconds,
        stats=result.stats,
        validation_rows=validation_rows,
        initial_epoch=result.initial_epoch,
        phases=phases.seconds(),
    )


fit = with_mode_options(fit)


def _listeners(
    tensorboard_dir: str | None, log_to_mlflow: bool, *, mode: str, settings: Settings, values: dict
) -> list:
    """The driver's epoch listeners: TensorBoard, MLflow."""
    listeners: list = []
    if tensorboard_dir is not None:
        listeners.append(tracking.TensorBoardLogger(tensorboard_dir))
    if log_to_mlflow:
        listeners.append(
            tracking.MLflowLogger(
                dict(
                    mode=mode,
                    num_workers=settings.num_workers,
                    epochs=settings.epochs,
                    batch_size=settings.batch_size,
                    seed=settings.seed,
                    shuffle=settings.shuffle,
                    **{k: v for k, v in values.items() if v is not None},
                )
            )
        )
    return listeners


def _check_min_workers(
    plan: Plan, min_workers, num_workers: int, batch_size: int, weighted: bool, checkpoint_dir
) -> None:
    if min_workers is None:
        return
    if isinstance(min_workers, bool) or not isinstance(min_workers, int) or not 1 <= min_workers <= num_workers:
        raise ValueError(
            f"Expected `min_workers` to be an int from 1 to num_workers={num_workers}. Received: "
            f"min_workers={min_workers!r}"
        )
    if min_workers == num_workers:
        return
    why = plan.refuses_fewer_workers(checkpoint_dir is not None)
    if why is not None:
        raise ValueError(
            f"Expected a mode that can go on with fewer workers with min_workers={min_workers} < "
            f"num_workers={num_workers}. Received: mode={plan.mode!r}, where {why}."
        )
    if plan.resumes_on_other_workers and not _fewer_workers(
        plan, num_workers, batch_size, weighted, at_most=num_workers - 1, at_least=min_workers
    ):
        refusal = _refusal(plan, min_workers, _grown_batch(num_workers, batch_size, min_workers), weighted)
        raise ValueError(
            f"Expected min_workers={min_workers} to leave a number of workers from {min_workers} to "
            f"{num_workers - 1} that mode={plan.mode!r} can go on with. Received: none of them runs ({refusal})."
        )


def _grown_batch(num_workers: int, batch_size: int, workers: int) -> int:
    """Each of ``workers`` workers' batch where ``num_workers`` had ``batch_size``: the global batch kept where it
    divides among them, else the nearest larger one."""
    return -(-num_workers * batch_size // workers)


def _refusal(plan: Plan, workers: int, batch_size: int, weighted: bool) -> str | None:
    """Why ``plan`` cannot run ``workers`` workers at ``batch_size`` rows a step (None: it can)."""
    try:
        plan.check_fit(num_workers=workers, batch_size=batch_size, weighted=weighted)
    except ValueError as refused:
        return str(refused)
    return None


def _fewer_workers(
    plan: Plan, num_workers: int, batch_size: int, weighted: bool, *, at_most: int, at_least: int
) -> int | None:
    """The most workers from ``at_least`` to ``at_most`` (fewer than ``num_workers``) that ``plan`` runs at the grown
    batch (:func:`_grown_batch`), if any."""
    for workers in range(min(at_most, num_workers - 1), at_least - 1, -1):
        if _refusal(plan, workers, _grown_batch(num_workers, batch_size, workers), weighted) is None:
            return workers
    return None


def _with_fewer_workers(arguments: dict, workers: int) -> FitResult:
    """The fit of ``arguments`` again, from its newest checkpoint, on ``workers`` of the workers the cluster has
    left: each worker's batch grown to keep the global batch where it divides, else the nearest larger."""
    num_workers, batch_size = arguments["num_workers"], arguments["batch_size"]
    global_batch = num_workers * batch_size
    grown = _grown_batch(num_workers, batch_size, workers)
    changed = {"num_workers": [num_workers, workers], "batch_size": [batch_size, grown]}
    changed["global_batch"] = [global_batch, workers * grown]
    logger.warning(
        "sparkdl: going on with %d workers instead of %d (min_workers=%d), from the newest checkpoint: batch_size "
        "%d -> %d a worker, global batch %d -> %d",
        workers,
        num_workers,
        arguments["min_workers"],
        batch_size,
        grown,
        global_batch,
        workers * grown,
    )
    settings = {name: value for name, value in arguments.items() if name != "mode_options"}
    again = {**settings, **arguments["mode_options"], "num_workers": workers, "batch_size": grown}
    result = fit(**again)
    result.stats.setdefault("workers_lost", []).insert(0, changed)
    return result


def _checkpoint_interval(plan: Plan, checkpoint_dir, checkpoint_every) -> CheckpointInterval | None:
    """How often the fit saves step checkpoints (None: at epoch ends only); refuses ``checkpoint_every`` where the
    mode cannot take it."""
    if checkpoint_every is not None:
        interval = CheckpointInterval.parse(checkpoint_every)
        if not plan.saves_step_checkpoints:
            raise ValueError(
                f"Expected `checkpoint_every` only with a mode that saves step checkpoints. Received: "
                f"checkpoint_every={checkpoint_every!r} with mode={plan.mode!r}, which checkpoints at epoch ends only."
            )
        if checkpoint_dir is None:
            raise ValueError(
                f"Expected `checkpoint_dir` with `checkpoint_every`. Received: checkpoint_every={checkpoint_every!r} "
                "and no checkpoint_dir: say where the checkpoints go."
            )
        return interval
    if checkpoint_dir is None or not plan.saves_step_checkpoints:
        return None
    return CheckpointInterval.parse(DEFAULT_INTERVAL)


@dataclasses.dataclass(frozen=True)
class _Resumed:
    checkpoint: Checkpoint
    model: object  # the checkpoint's model, loaded to compare it with the user's

    @property
    def epoch(self) -> int:
        return self.checkpoint.epoch

    @property
    def read_as(self) -> int | None:
        """The partitions the epoch it resumes in was first read as, whole, one a worker (its rows' keys); None where
        it was not (or it resumes at an epoch's start)."""
        position = self.checkpoint.position
        first = position.segments[0] if position is not None else None
        return first.shards if first is not None and first.by_partition else None


def _newest_checkpoint(checkpoints: CheckpointStore | None, model, custom_objects) -> _Resumed | None:
    """The checkpoint a fit continues from (read once, here); refuses one of a different model rather than
    train that instead."""
    if checkpoints is None:
        return None
    latest = checkpoints.latest()
    if latest is None:
        return None
    saved = serialization.model_from_bytes(latest.model_bytes, custom_objects)
    expected = [tuple(w.shape) for w in model.weights]
    found = [tuple(w.shape) for w in saved.weights]
    if expected != found:
        raise ValueError(
            f"checkpoint_dir={checkpoints.uri!r} holds a checkpoint (epoch {latest.epoch}) of a different "
            f"model: its weights have shapes {found}, the model's {expected}. Use another directory "
            "for this model, or empty this one."
        )
    logger.info("sparkdl: found a checkpoint after epoch %d in %s", latest.epoch, checkpoints.uri)
    return _Resumed(latest, saved)
