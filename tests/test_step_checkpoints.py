"""Step checkpoints: a fit that loses a worker or its driver mid-epoch resumes inside the epoch, training exactly the
rows the epoch had not trained (counted by row id, as the layer that saw them recorded them), with the weights of the
fit without the fault where the workers are the same and the mode deterministic, and every row once per epoch where
their number changed; ranks that take part in a save take it at the same steps."""

import collections
import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid

import keras
import numpy as np
import pytest
from collective_ranks import run_ranks
from frames import digits_frame
from models import CrashOnFirstAttempt

import sparkdl
from sparkdl.checkpoint import CheckpointInterval, CheckpointStore, StepCheckpoints
from sparkdl.ps.positions import WorkerPositions

ROWS, BATCH, EPOCHS = 300, 16, 2


@dataclasses.dataclass(frozen=True)
class Case:
    """How a barrier mode trains here, on two task slots."""

    options: dict
    calls_per_step: int = 1  # times the id layer runs in one training step (per micro-batch, or again in backward)
    calls_per_row: int = 1  # times it sees each row of a step
    recording: int = 2  # the tasks that run the id layer (a pipeline's first stage only)
    exact: bool = True  # the killed fit ends with the clean fit's weights (updates in a fixed order)
    slow: bool = False  # runs with -m slow: the default suite keeps the cases whose saves differ most
    partitions: int = 3  # the input's: 2 (one a worker) deals each worker its input partition whole, unshuffled


CASES = {
    "sync": Case({"mode": "sync"}),
    "sync, by partition": Case({"mode": "sync"}, partitions=2),
    # a checkpoint holds the replicas' average: the resumed replicas start there, not where each one was
    "gossip": Case({"mode": "gossip"}, exact=False, slow=True),
    "sharded": Case({"mode": "sharded"}),
    # resharding: a unit runs again in its backward pass (tests/test_every_mode.py runs the default, which keeps them)
    "sharded, shard_weights": Case(
        {"mode": "sharded", "shard_weights": True, "reshard_after_forward": True}, calls_per_step=2, calls_per_row=2
    ),
    # one replica of two stages: the first (partition 0) reads the ids, each step in two micro-batches
    "pipeline": Case(
        {"mode": "pipeline", "num_stages": 2, "micro_batches": 2, "cut_points": ["head"]},
        calls_per_step=2,
        recording=1,
        slow=True,  # its position's logic is tests/test_positions.py's, its saves ZeRO-3's
    ),
}


class RecordIds(keras.layers.Layer):
    """Drops the first input column (a row id) after appending, in training, ``<attempt> <retry> <call> <time> <id>``
    lines per row to ``<log_dir>/<pid>``: ``attempt`` ends with ``-<partition>``; ``call`` counts this layer's calls
    in its task attempt, from 0 (``Case.calls_per_step`` a step); ``time`` is the call's (``time.monotonic_ns``: one
    clock for every process of the machine); ``retry`` is 1 where ``marker`` (the crash's) existed at the attempt's
    first call."""

    def __init__(self, log_dir, marker=None, **kwargs):
        super().__init__(**kwargs)
        self.log_dir, self.marker = log_dir, marker
        self._attempt, self._calls = uuid.uuid4().hex, 0

    def _record(self, ids):
        from pyspark import TaskContext

        if self._calls == 0:
            self._retry = int(bool(self.marker) and os.path.exists(self.marker))
        where = f"{self._attempt}-{TaskContext.get().partitionId()} {self._retry}"
        now = time.monotonic_ns()
        with open(os.path.join(self.log_dir, str(os.getpid())), "a") as f:
            f.writelines(f"{where} {self._calls} {now} {int(i)}\n" for i in ids.ravel().tolist())
        self._calls += 1
        return ids

    def call(self, x, training=None):
        import tensorflow as tf

        if training:
            x = tf.concat(
                [tf.ensure_shape(tf.numpy_function(self._record, [x[:, :1]], x.dtype), [None, 1]), x[:, 1:]], 1
            )
        return x[:, 1:]

    def get_config(self):
        return {**super().get_config(), "log_dir": self.log_dir, "marker": self.marker}


def _model(log_dir, crash_at=0, marker=None, dropout=True):
    keras.utils.set_random_seed(0)
    # Dropout's random state resumes too: the same masks as the run without the fault
    noise = [keras.layers.Dropout(0.2)] if dropout else []
    model = keras.Sequential(
        [
            keras.Input((65,)),
            RecordIds(str(log_dir), marker),
            CrashOnFirstAttempt(partition=0 if crash_at else -1, at_call=crash_at, marker=marker),
            keras.layers.Dense(16, activation="relu"),
            *noise,
            keras.layers.Dense(10, activation="softmax", name="head"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy")
    return model


def _ids_in_partitions(spark, digits, partitions):
    """Digits whose first feature is the row's id (0..ROWS-1), in ``partitions`` input partitions."""
    x_train, _, y_train, _ = digits
    x = np.concatenate([np.arange(ROWS, dtype=np.float32)[:, None], x_train[:ROWS]], 1)
    return digits_frame(spark, x, y_train[:ROWS]).repartition(partitions).cache()


@pytest.fixture(scope="module")
def ids_df(spark, digits):
    return _ids_in_partitions(spark, digits, 3)


@pytest.fixture(scope="module")
def ids_df_by_partition(spark, digits):
    return _ids_in_partitions(spark, digits, 2)


def _attempts(log_dir):
    """Each task attempt's recorded ``(call, id)`` pairs, by ``(attempt, retry)``."""
    lines = collections.defaultdict(list)
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                attempt, retry, call, _, row = line.split()
                lines[attempt, retry == "1"].append((int(call), int(row)))
    return lines


def _in_order(log_dir):
    """The ids each partition trained on, in the order it trained them (over task attempts and processes), by
    ``(retry, partition)``."""
    lines = collections.defaultdict(list)
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                attempt, retry, _, at, row = line.split()
                lines[retry == "1", int(attempt.rsplit("-", 1)[1])].append((int(at), int(row)))
    return {where: [row for _, row in sorted(pairs, key=lambda pair: pair[0])] for where, pairs in lines.items()}


def _fit(df, model, **settings):
    return sparkdl.fit(df, model, epochs=EPOCHS, batch_size=BATCH, seed=3, progress=False, **settings)


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if case.slow else []) for name, case in sorted(CASES.items())]
)
def test_a_worker_lost_mid_epoch_costs_only_the_steps_since_the_last_step_checkpoint(request, tmp_path, name):
    case = CASES[name]
    ids_df = request.getfixturevalue("ids_df" if case.partitions == 3 else "ids_df_by_partition")
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean_dir.mkdir(), faulty_dir.mkdir()
    clean = _fit(ids_df, _model(clean_dir), num_workers=2, **case.options)  # through Dropout: its masks resume too
    steps = clean.steps_per_epoch
    crash = steps + steps // 2 + 2  # partition 0 dies inside epoch 1, after a step checkpoint
    model = _model(faulty_dir, crash_at=crash * case.calls_per_step, marker=str(tmp_path / "crashed"))

    faulty = _fit(
        ids_df, model, num_workers=2, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3, **case.options
    )

    assert (tmp_path / "crashed").exists(), "the worker never died"
    resumed = faulty.stats["resumed_at"]
    assert resumed["epoch"] == 1 and 0 < resumed["step"] < crash - steps  # mid-epoch, before the crash
    saved = resumed["epoch"] * steps + resumed["step"]  # the global steps the checkpoint holds
    attempts = _attempts(faulty_dir)
    # each recording partition's first attempt, and its retry
    assert sorted(retry for _, retry in attempts) == [False] * case.recording + [True] * case.recording
    # the first attempts' calls count global steps (they started at step 0): the checkpoint holds those before `saved`
    counted = collections.Counter(
        row
        for (_, retry), calls in attempts.items()
        for call, row in calls
        if retry or call // case.calls_per_step < saved
    )
    assert counted == collections.Counter({row: EPOCHS * case.calls_per_row for row in range(ROWS)})  # none twice
    assert faulty.model.optimizer.iterations.numpy() == clean.model.optimizer.iterations.numpy() == EPOCHS * steps
    if case.exact:
        for got, want in zip(faulty.model.get_weights(), clean.model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert faulty.stats["step_checkpoints"]["saved"] >= 1


def test_ranks_that_take_part_in_a_save_take_it_at_the_writers_steps():
    """Every so long, each rank's clock would say other steps (here the writer, rank 0, takes 30 ms a step, the others
    no time): they all take the writer's decision; every so many steps they count alike without a word."""
    steps = 12

    def decisions(comm, interval, agrees=True):
        def agree(due):
            return bool(comm.broadcast(np.array([due], np.uint8), root=0)[0])

        checkpoints = StepCheckpoints(interval, agree if agrees else None)
        taken = []
        for epoch in range(2):
            for step in range(1, steps + 1):
                time.sleep(0.03 if comm.rank == 0 else 0)
                if checkpoints.due(epoch, step, steps):
                    with checkpoints.saving():
                        taken.append((epoch, step))
        return taken

    alone = run_ranks(3, lambda comm: decisions(comm, CheckpointInterval(seconds=0.05), agrees=False))
    assert alone[0] and not alone[1] and not alone[2]  # what each rank's clock says alone
    by_time = run_ranks(3, lambda comm: decisions(comm, CheckpointInterval(seconds=0.05)))
    assert by_time[0] and by_time[0] == by_time[1] == by_time[2]
    assert all(step < steps for _, step in by_time[0])  # never at an epoch's last step
    by_steps = run_ranks(2, lambda comm: decisions(comm, CheckpointInterval(steps=5)))
    assert by_steps[0] == by_steps[1] == [(0, 5), (0, 10), (1, 3), (1, 8)]


DRIVER = """
import sys, time
sys.path[:0] = {paths!r}
import keras, numpy as np
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits
import sparkdl
from frames import digits_frame
from test_step_checkpoints import ROWS, _fit, _model, _ids_frame

class Slow(keras.callbacks.Callback):  # time for the test to see a step checkpoint and kill this driver
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.2)

spark = SparkSession.builder.master("local[3]").config("spark.ui.enabled", "false").getOrCreate()
_fit(_ids_frame(spark, {table!r}), _model({log_dir!r}, marker={marker!r}), num_workers={workers},
     checkpoint_dir={ckpt!r}, checkpoint_every=2, callbacks=[Slow()])
print("finished")
"""


def _ids_frame(spark, table=None):
    """The ids' rows in one input partition, in row order, whatever the session's parallelism (the same row keys in
    both drivers); or, with ``table``, read from the Parquet files there (``_write_ids``)."""
    from sklearn.datasets import load_digits

    if table is not None:
        return spark.read.parquet(table)
    x, y = load_digits(return_X_y=True)
    x = np.concatenate([np.arange(ROWS, dtype=np.float32)[:, None], (x[:ROWS] / 16.0).astype(np.float32)], 1)
    return digits_frame(spark, x, y[:ROWS].astype(np.int64)).coalesce(1)


def _write_ids(spark, table, files):
    """The ids' rows written to ``table`` as ``files`` Parquet files of as many rows; each file's ids."""
    from pyspark.sql import functions as F

    _ids_frame(spark).repartition(files).write.parquet(table)
    by_file = collections.defaultdict(set)
    read = _ids_frame(spark, table).select(F.input_file_name().alias("file"), F.col("features")[0].alias("id"))
    for row in read.collect():
        by_file[row.file].add(int(row.id))
    return list(by_file.values())


@pytest.mark.slow
@pytest.mark.parametrize("before, after, files", [(3, 2, None), (1, 2, None), (3, 2, 6)])
def test_a_driver_killed_mid_epoch_and_started_again_on_other_workers_trains_every_row_once(
    spark, tmp_path, before, after, files
):
    """The driver dies (SIGKILL, its whole process group) inside epoch 1; the same call, on another number of
    workers, resumes inside that epoch: the rows the killed run trained up to its last step checkpoint and the rows
    the new run trained make every row once per epoch, none twice. From ``files`` Parquet files, the killed run's
    workers read whole files (no shuffle), and the new run reads them in the same partitions (the same keys) and
    deals them to its workers."""
    ckpt, log_dir, second_run = tmp_path / "ckpt", tmp_path / "rows", tmp_path / "second-run"
    log_dir.mkdir()
    table = str(tmp_path / "table") if files else None
    by_file = _write_ids(spark, table, files) if files else []
    # the resumed fit trains the checkpoint's model, whose layer logs where the first one did: the lines of the
    # second run are those whose attempt found `second_run`
    script = DRIVER.format(
        paths=[os.path.dirname(__file__)],
        log_dir=str(log_dir),
        marker=str(second_run),
        workers=before,
        ckpt=str(ckpt),
        table=table,
    )
    driver = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240  # a bound on a wait, not a timing claim
        while not (ckpt.exists() and any(n.startswith("epoch-000001-step-") for n in os.listdir(ckpt))):
            assert driver.poll() is None, "the first driver ended before a step checkpoint of epoch 1"
            assert time.monotonic() < deadline, "no step checkpoint of epoch 1 within 240 s"
            time.sleep(0.05)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()

    second_run.touch()
    resumed = _fit(_ids_frame(spark, table), _model(log_dir), num_workers=after, checkpoint_dir=str(ckpt))

    at = resumed.stats["resumed_at"]
    assert at["epoch"] == 1 and at["step"] > 0
    saved = CheckpointStore.open(str(ckpt)).latest()
    assert saved.epoch == EPOCHS and len(saved.history["loss"]) == EPOCHS
    (shards, first_steps, done), *_ = at["segments"]
    assert shards == before and done == at["step"]
    kept = at["epoch"] * first_steps + at["step"]  # the killed run's steps the checkpoint holds (global, from 0)
    attempts = _attempts(log_dir)
    assert sorted(second for _, second in attempts) == [False] * before + [True] * after
    counted = collections.Counter(
        row for (_, second), calls in attempts.items() for call, row in calls if second or call < kept
    )
    assert counted == collections.Counter({row: EPOCHS for row in range(ROWS)})
    first_run = [{row for _, row in calls} for (_, second), calls in attempts.items() if not second]
    for ids in by_file:  # each file's rows were one worker's in the killed run
        assert sum(bool(ids & rows) for rows in first_run) == 1


#: The modes whose driver saves the step checkpoints: their options, their workers, whether a resumed fit's weights
#: are the uninterrupted fit's (updates in a fixed order), and whether the model trains through Dropout (average mode
#: seeds each round's draws by its first step; a parameter-server worker's draws are its own, not in the checkpoint).
#: The server task beside one worker: two task slots.
DRIVER_SAVES = {
    "sync_ps": ({}, 2, True, False),
    "sync_ps, servers on executors": ({"server_placement": "executors"}, 1, True, False),
    "average": ({"sync_every": 3}, 2, True, True),
    "async": ({"num_servers": 2}, 2, False, False),
}


@pytest.mark.parametrize("case", list(DRIVER_SAVES))
def test_the_same_call_again_resumes_at_a_step_checkpoint_of_the_driver(ids_df, tmp_path, case):
    """The driver saves step checkpoints every 3 steps (sync_ps: rounds; average: after the rounds; async: of each
    worker's steps, its positions in the checkpoint). The same call again, after a driver that died right after the
    oldest step checkpoint of epoch 1 (the later ones removed, as if never written), trains on from it: each
    worker's rows of the steps before its position there, trained by the first fit, and the rows the second fit
    trained make every row once per epoch, none twice; where updates come in a fixed order, the weights are the
    uninterrupted fit's."""
    options, workers, exact, dropout = DRIVER_SAVES[case]
    mode = case.split(",")[0]
    ckpt, log_dir, second = tmp_path / "ckpt", tmp_path / "rows", tmp_path / "second-run"
    log_dir.mkdir()
    settings = dict(num_workers=workers, mode=mode, checkpoint_dir=str(ckpt), checkpoint_every=3, **options)
    first = _fit(ids_df, _model(log_dir, marker=str(second), dropout=dropout), **settings)
    assert first.stats["step_checkpoints"]["saved"] >= 2
    mid = sorted(
        name[: -len(".json")]
        for name in os.listdir(ckpt)
        if name.startswith("epoch-000001-step-") and name.endswith(".json")
    )
    assert mid, sorted(os.listdir(ckpt))
    for name in os.listdir(ckpt):  # as if the driver had died right after the oldest step checkpoint of epoch 1
        if name.split(".")[0] > mid[0]:
            os.remove(ckpt / name)
    saved = CheckpointStore.open(str(ckpt)).latest()
    assert saved.position is not None and saved.position.steps > 0 and saved.stem == mid[0]

    second.touch()
    resumed = _fit(ids_df, _model(log_dir, dropout=dropout), **settings)

    assert resumed.initial_epoch == 1 and len(resumed.history["loss"]) == EPOCHS
    ordered = _in_order(log_dir)
    kept = []
    for partition in range(workers):  # the first fit's rows of each worker's steps before where the checkpoint had it
        rows = ordered[False, partition]
        per_worker = len(rows) // EPOCHS
        if mode == "average":  # every worker at the checkpoint's global step of the one schedule
            steps, step = first.steps_per_epoch, saved.epoch * first.steps_per_epoch + saved.position.steps
        else:  # the worker's own position (sync_ps: every worker's), on its schedule, and where it resumed
            positions = WorkerPositions.from_vector(saved.arrays[WorkerPositions.ARRAY])
            steps, step = positions.steps_per_epoch(BATCH)[partition], positions.resumed(partition)
            assert resumed.stats["resumed_at"]["workers"][partition] == step
        kept += rows[: (step // steps) * per_worker + (step % steps) * per_worker // steps]
    counted = collections.Counter(kept + [row for p in range(workers) for row in ordered.get((True, p), [])])
    assert counted == collections.Counter({row: EPOCHS for row in range(ROWS)})  # none twice, none skipped
    if exact:
        for got, want in zip(resumed.model.get_weights(), first.model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_step_checkpoint_resumes_on_its_own_workers_only_in_the_driver_saving_modes(tmp_path):
    """Their tasks share no collective that could find which rows an epoch trained on other workers
    (``sparkdl.position``): average mode and the parameter-server modes refuse a step checkpoint of another number
    of workers, or of another schedule, on the driver, naming what they expect."""
    from sparkdl.checkpoint import Checkpoint
    from sparkdl.modes.average.rounds import position_step
    from sparkdl.modes.base import Settings
    from sparkdl.modes.parameter_server.checkpoints import resume_positions
    from sparkdl.position import EpochPosition, Segment

    settings = Settings(rules=None, num_workers=2, epochs=2, batch_size=16, steps_per_epoch=10, seed=3)
    segment = Segment(3, (50, 50, 50), 4, 2)
    position = EpochPosition(1, 3, True, 7, (segment,))
    checkpoint = Checkpoint(1, b"", {}, "average", position=position)
    with pytest.raises(ValueError, match=r"3 workers holding \[50, 50, 50\] rows.* Received: 2 workers"):
        position_step(settings, checkpoint, [75, 75], 7)
    assert position_step(dataclasses.replace(settings, num_workers=3, steps_per_epoch=4), checkpoint, [50] * 3, 7) == 6

    lockstep = WorkerPositions(3, True, True, (80, 70), (1, 6), ((12, 12),))
    ps = Checkpoint(1, b"", {}, "sync_ps", {WorkerPositions.ARRAY: lockstep.to_vector()}, position=position)
    assert resume_positions(ps, settings, lockstep=True, num_servers=2).next_steps == ((12, 12), (12, 12))
    with pytest.raises(ValueError, match="Expected a step checkpoint of this mode's schedule and 3 workers"):
        resume_positions(ps, dataclasses.replace(settings, num_workers=3), lockstep=True, num_servers=1)
    with pytest.raises(ValueError, match="'sync_ps''s checkpoint epoch-000001-step-000000002"):
        resume_positions(ps, settings, lockstep=False, num_servers=1)  # async's steps are each worker's own
