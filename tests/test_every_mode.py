"""What every training mode promises, checked in every mode the registry holds: a string column reaches the train
step byte for byte, a custom class the executors cannot import is shipped by value, every row is trained exactly once
per epoch on uneven partitions, and a worker killed mid-epoch costs no row twice and, where the mode is deterministic,
not a bit of the weights.

The modes come from ``sparkdl.modes.registry.MODES`` (built-in, entry points, ``register``): a mode registered later
fails here until ``CASES`` says how to train it (or why it is not covered), with no other edit.
"""

import dataclasses
import json
import os
import textwrap
import uuid
from collections import Counter, defaultdict

import keras
import numpy as np
import pytest
from models import CrashOnFirstAttempt

import sparkdl
from sparkdl.modes.registry import MODES


@dataclasses.dataclass(frozen=True)
class Case:
    """How the tests below train one mode (or a variant of it) on two task slots."""

    mode: str  # the registered name
    options: dict = dataclasses.field(default_factory=dict)
    num_workers: int = 2
    calls_per_step: int = 1  # times a layer of stage 0 runs in one training step
    calls_per_row: int = 1  # times a layer sees each row of a step (a resharded unit: forward, and again backward)
    resumes_at_checkpoint: bool = True  # a killed worker's stage starts again at the last checkpoint (else the lost
    # task alone trains its rows again, from the first step)
    exact_resume: bool = True  # the killed fit ends with the clean fit's weights (updates in a fixed order)
    checkpoint_every: int | None = None  # the killed fit's step checkpoints (steps)
    resumes_at_step: bool = False  # each lost task's next attempt goes on at the step after the last one that counts
    # (its own: the parameter server's, or the step checkpoint's; ``stats["resumed_at"]``), not from an epoch's start
    not_covered: str = ""  # why the mode is not trained here


#: async, hogwild and ssp: a lost worker's retry goes on at its own step; the updates come in no fixed order.
AT_ITS_STEP = dict(resumes_at_checkpoint=False, exact_resume=False, checkpoint_every=3, resumes_at_step=True)
CASES = {
    "sync": Case("sync"),
    "sharded": Case("sharded"),
    # a model this small keeps every unit's gathered weights to its backward pass: each layer runs once a step
    "sharded, shard_weights": Case("sharded", {"shard_weights": True}),
    # one replica of two stages; the model's head alone is stage 1, the strings and the custom class stay in stage 0
    "pipeline": Case("pipeline", {"num_stages": 2, "micro_batches": 2, "cut_points": ["head"]}, calls_per_step=2),
    "async": Case("async", **AT_ITS_STEP),
    "hogwild": Case("hogwild", {"num_servers": 2}, **AT_ITS_STEP),
    "ssp": Case("ssp", {"max_staleness": 1}, **AT_ITS_STEP),
    "sync_ps": Case("sync_ps", resumes_at_checkpoint=False, checkpoint_every=3, resumes_at_step=True),
    # the server task beside the one worker: two task slots; the retried stage goes on at the last step checkpoint
    "sync_ps, servers on executors": Case(
        "sync_ps", {"server_placement": "executors"}, num_workers=1, checkpoint_every=3, resumes_at_step=True
    ),
    # the first round ends after the kill: a worker caches its model between rounds, and the kill counts its calls;
    # the lost task's round is trained again by its retry (its step checkpoints are tests/test_step_checkpoints.py's)
    "average": Case("average", {"sync_every": 12}, resumes_at_checkpoint=False, checkpoint_every=3),
    # a checkpoint holds the replicas' average: a resumed stage starts every replica there, not where each one was
    "gossip": Case("gossip", exact_resume=False),
    "tally": Case("tally", not_covered="tests/tally_mode.py's mode trains nothing: it only reports the rows it read"),
}

# Every kind of string Spark holds: accents, other scripts, emoji, an empty one, control characters, a NUL inside.
ODD_STRINGS = ["naïve café", "日本語のテキスト", "Москва", "emoji 🎉🚀", "", "tab\tand\nnewline", "nul\x00inside", "  "]
ROWS = 101  # odd: the two workers' shards cannot be the same size
STRINGS = [odd if i < len(ODD_STRINGS) else f"{odd} {i}" for i, odd in enumerate(ODD_STRINGS * (ROWS // 8 + 1))][:ROWS]
EPOCHS, BATCH = 2, 8

# A user's module beside the driver's script, importable on the driver only: its layer reaches the workers by value.
USER_MODULE = '''
import os

import keras
import tensorflow as tf


class RecordRows(keras.layers.Layer):
    """Identity on a string tensor that, in training, appends a line per value it gets to ``<log_dir>/<pid>``:
    ``<stage> <task attempt> <partition> <the value's bytes in hex>``."""

    def __init__(self, log_dir, **kwargs):
        super().__init__(**kwargs)
        self.log_dir = log_dir

    def _record(self, values):
        from pyspark import TaskContext

        task = TaskContext.get()
        where = f"{task.stageId()} {task.taskAttemptId()} {task.partitionId()}"
        with open(os.path.join(self.log_dir, str(os.getpid())), "a") as f:
            f.writelines(f"{where} {value.hex()}\\n" for value in values.ravel().tolist())
        return values

    def call(self, x, training=None):
        if not training:
            return x
        return tf.ensure_shape(tf.numpy_function(self._record, [x], tf.string, stateful=True), x.shape)

    def get_config(self):
        return {**super().get_config(), "log_dir": self.log_dir}
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("beside_the_script")
    name = f"user_layers_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield __import__(name)


@pytest.fixture(scope="module")
def strings_df(spark):
    """``text string, label int`` in 3 input partitions, every text distinct (ROWS is odd: the workers' shards differ
    in size whatever Spark deals them)."""
    rows = [(text, i % 2) for i, text in enumerate(STRINGS)]
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, 3), "text string, label int")


def _model(user_module, log_dir, crash_at=0, marker=None):
    """Strings through the user's layer (and a layer that kills its worker at call ``crash_at``: 0, never), a
    StringLookup's one-hot rows (an Embedding's sparse gradients are not in every mode yet) and two dense layers."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((1,), dtype="string", name="text"),
            user_module.RecordRows(str(log_dir)),
            CrashOnFirstAttempt(partition=0 if crash_at else -1, at_call=crash_at, marker=marker),
            keras.layers.StringLookup(vocabulary=STRINGS, output_mode="one_hot"),
            keras.layers.Flatten(),
            keras.layers.Dense(4, activation="relu"),
            keras.layers.Dense(2, activation="softmax", name="head"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    return model


def _fit(case, df, model, **settings):
    return sparkdl.fit(
        df,
        model,
        features_col="text",
        num_workers=case.num_workers,
        mode=case.mode,
        epochs=EPOCHS,
        batch_size=BATCH,
        seed=0,
        timeout=120,
        progress=False,
        custom_objects={"CrashOnFirstAttempt": CrashOnFirstAttempt},
        **case.options,
        **settings,
    )


def _trained(log_dir) -> tuple[dict[int, list[bytes]], list[tuple[int, list[bytes]]]]:
    """The strings each partition's successful task attempts trained on, in order, and those of each task attempt
    that trained and was lost (a later one of the same stage and partition trained), by partition, in order."""
    attempts: dict[tuple[int, int, int], list[bytes]] = defaultdict(list)  # (stage, attempt, partition): strings
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            for line in f.read().splitlines():
                stage, attempt, partition, value = line.split(" ")
                attempts[int(stage), int(attempt), int(partition)].append(bytes.fromhex(value))
    last = {}
    for stage, attempt, partition in attempts:
        last[stage, partition] = max(attempt, last.get((stage, partition), attempt))
    kept: dict[int, list[bytes]] = defaultdict(list)
    lost = []
    for stage, attempt, partition in sorted(attempts):  # stages (average's rounds) in the order they ran
        if last[stage, partition] == attempt:
            kept[partition] += attempts[stage, attempt, partition]
        else:
            lost.append((partition, attempts[stage, attempt, partition]))
    return dict(kept), lost


def _case(name) -> Case:
    if name not in CASES:
        pytest.fail(
            f"The registered mode {name!r} is not in CASES of tests/test_every_mode.py: add how to train it there "
            "(its options and task counts), or a Case with `not_covered` saying why it cannot be."
        )
    case = CASES[name]
    assert case.mode in MODES, f"CASES[{name!r}] trains {case.mode!r}, which no mode registers"
    return case


_CLEAN: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def clean_fit(user_module, strings_df, tmp_path_factory):
    """The fit of a case without a fault, run once for both tests: its result and its log directory."""

    def fit(name):
        if name not in _CLEAN:
            log_dir = tmp_path_factory.mktemp("clean")
            _CLEAN[name] = _fit(CASES[name], strings_df, _model(user_module, log_dir)), log_dir
        return _CLEAN[name]

    yield fit
    _CLEAN.clear()


#: Every registered mode and every case, less those that say why they are not covered (a mode missing from CASES
#: fails both tests, naming what to add).
NAMES = sorted(name for name in set(MODES) | set(CASES) if name not in CASES or not CASES[name].not_covered)


def test_every_registered_mode_is_trained_here_or_says_why_not():
    """(tests/tally_mode.py's mode is registered only while tests/test_mode_protocol.py runs: it says why not.)"""
    missing = sorted(set(MODES) - set(CASES))
    assert not missing, f"add these registered modes to CASES (how to train them, or why not): {missing}"
    for name in NAMES:
        assert CASES[name].mode in MODES, f"CASES[{name!r}] trains {CASES[name].mode!r}, which no mode registers"


@pytest.mark.parametrize("name", NAMES)
def test_every_mode_trains_every_string_once_per_epoch_through_a_class_shipped_by_value(clean_fit, name):
    """The user's layer, importable on the driver only, records what reaches the train step inside the tasks: every
    string, byte for byte (UTF-8, NUL, newline, empty), once per epoch in each partition's epoch, on partitions of
    uneven sizes; and the trained model comes back holding that class."""
    case = _case(name)
    result, log_dir = clean_fit(name)
    trained, lost = _trained(log_dir)
    assert not lost
    expected = {text.encode(): EPOCHS * case.calls_per_row for text in STRINGS}
    assert Counter(value for values in trained.values() for value in values) == expected
    sizes = []
    for partition, values in trained.items():  # each epoch of a partition is its rows, each once (per layer call)
        size = len(values) // (EPOCHS * case.calls_per_row)
        per_epoch = size * case.calls_per_row
        first = Counter(values[:per_epoch])
        assert set(first.values()) == {case.calls_per_row}, (partition, first)
        for epoch in range(1, EPOCHS):
            assert Counter(values[epoch * per_epoch : (epoch + 1) * per_epoch]) == first, (partition, epoch)
        sizes.append(size)
    assert len(sizes) == 1 or len(set(sizes)) == len(sizes), sizes  # ROWS is odd: no even split exists
    assert result.steps_per_epoch == -(-max(sizes) // BATCH)
    assert len(result.history["loss"]) == EPOCHS and np.isfinite(result.history["loss"]).all()
    assert result.stats.get("samples", EPOCHS * ROWS) == EPOCHS * ROWS
    assert type(result.model.layers[0]).__module__.startswith("user_layers_")


@pytest.mark.parametrize("name", NAMES)
def test_every_mode_finishes_a_fit_whose_worker_was_killed_mid_epoch(
    clean_fit, user_module, strings_df, tmp_path, name
):
    """Partition 0's Python worker dies hard halfway through epoch 2: Spark runs it again, from the checkpoint of
    epoch 1 where the mode resumes its stage from the checkpoints, else the lost task alone from its first step; or,
    where it resumes at a step (``resumes_at_step``), from the step after the last one the server applied, or the
    last step checkpoint. The attempts that trained to the end, with the lost ones' steps before where their next
    attempts went on, trained every row once per epoch they ran, and a mode whose updates come in a fixed order ends
    with the weights, losses and optimizer steps of the fit without the fault."""
    case = _case(name)
    clean, clean_log = clean_fit(name)
    steps = clean.steps_per_epoch
    marker, log_dir = tmp_path / "crashed", tmp_path / "rows"
    log_dir.mkdir()
    model = _model(user_module, log_dir, crash_at=(steps + steps // 2) * case.calls_per_step, marker=str(marker))
    every = {} if case.checkpoint_every is None else {"checkpoint_every": case.checkpoint_every}

    faulty = _fit(case, strings_df, model, checkpoint_dir=str(tmp_path / "ckpt"), **every)

    assert marker.exists(), "the worker never died"
    trained, lost = _trained(log_dir)
    assert lost, "no task attempt was lost"
    start = 1 if case.resumes_at_checkpoint else 0
    assert faulty.initial_epoch == start
    counted = [value for values in trained.values() for value in values]
    if case.resumes_at_step:  # what the lost attempts trained before the step their next ones started at counts
        at, (rows_of, _) = faulty.stats["resumed_at"], _trained(clean_log)
        for partition, values in lost:
            rows, step, per_epoch = (
                len(rows_of[partition]) // EPOCHS,
                at["workers"][partition],
                at["steps_per_epoch"][partition],
            )
            assert 0 < step < EPOCHS * per_epoch and values, (partition, step)  # the lost attempt started at step 0
            counted += values[: (step // per_epoch) * rows + (step % per_epoch) * rows // per_epoch]
        start = 0
    expected = {text.encode(): (EPOCHS - start) * case.calls_per_row for text in STRINGS}
    assert Counter(counted) == expected
    assert len(faulty.history["loss"]) == EPOCHS
    assert json.loads((tmp_path / "ckpt" / f"epoch-{EPOCHS:06d}.json").read_text())["epoch"] == EPOCHS
    if case.exact_resume:
        assert int(faulty.model.optimizer.iterations.numpy()) == int(clean.model.optimizer.iterations.numpy())
        for got, want in zip(faulty.model.get_weights(), clean.model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if case.exact_resume and case.resumes_at_checkpoint and not case.resumes_at_step:  # whole epochs' losses
        np.testing.assert_allclose(faulty.history["loss"], clean.history["loss"], rtol=1e-5)
