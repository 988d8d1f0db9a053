"""Checkpoints and resume, on real Spark. (Surviving a worker killed mid-epoch, in every mode, is
tests/test_every_mode.py's.)"""

import json
import os

import keras
import numpy as np
import pytest
from frames import digits_frame
from models import make_mlp
from pyspark.sql import functions as F
from spark_jobs import no_spark_job

import sparkdl
from sparkdl.checkpoint import KEEP, Checkpoint, CheckpointStore
from sparkdl.ml import KerasEstimator


def _files(directory):
    return sorted(name for name in os.listdir(directory))


def test_store_keeps_the_newest_complete_checkpoints_and_never_a_partial_one(tmp_path):
    store = CheckpointStore.open(f"file://{tmp_path}")
    assert store.latest() is None
    for epoch in range(1, 6):
        store.save(
            Checkpoint(
                epoch,
                f"model {epoch}".encode(),
                {"loss": [1.0] * epoch},
                "sync",
                {"shard0/0": np.full(3, epoch, np.float32)},
            )
        )
    assert _files(tmp_path) == [f"epoch-{e:06d}.{ext}" for e in range(6 - KEEP, 6) for ext in ("json", "keras", "npz")]
    # A writer that died mid-checkpoint: a temporary file, and a model whose .json marker never came.
    (tmp_path / ".tmp-abc-epoch-000006.keras").write_bytes(b"half")
    (tmp_path / "epoch-000007.keras").write_bytes(b"no marker")
    latest = CheckpointStore.open(str(tmp_path)).latest()  # a plain path works as well as file://
    assert (latest.epoch, latest.model_bytes, latest.history, latest.mode) == (
        5,
        b"model 5",
        {"loss": [1.0] * 5},
        "sync",
    )
    np.testing.assert_array_equal(latest.arrays["shard0/0"], np.full(3, 5, np.float32))
    assert not (tmp_path / ".tmp-abc-epoch-000006.keras").exists()  # cleared when a job opens the store


def test_sync_resume_continues_exactly_where_the_first_fit_stopped(spark, digits, tmp_path):
    """2 epochs through the estimator's checkpointDir, then 2 more with fit: the same weights as 4 at once."""
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:320], y_train[:320])
    settings = dict(numWorkers=2, mode="sync", batchSize=16, seed=5)
    sgd = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731 - momentum: optimizer state must carry over
    directory = tmp_path / "ckpt"

    first = KerasEstimator(
        model=make_mlp(hidden=(32,), optimizer=sgd(), seed=1), epochs=2, checkpointDir=str(directory), **settings
    ).fit(df)
    assert [n for n in _files(directory) if n.endswith(".json")] == ["epoch-000001.json", "epoch-000002.json"]
    resumed = sparkdl.fit(
        df,
        make_mlp(hidden=(32,), optimizer=sgd(), seed=1),
        num_workers=2,
        epochs=4,
        batch_size=16,
        seed=5,
        checkpoint_dir=str(directory),
    )
    uninterrupted = sparkdl.fit(
        df, make_mlp(hidden=(32,), optimizer=sgd(), seed=1), num_workers=2, epochs=4, batch_size=16, seed=5
    )

    assert resumed.initial_epoch == 2 and uninterrupted.initial_epoch == 0
    assert len(resumed.history["loss"]) == 4 and resumed.history["loss"][:2] == first.history["loss"]
    np.testing.assert_allclose(resumed.history["loss"], uninterrupted.history["loss"], rtol=1e-4)
    for got, want in zip(resumed.model.get_weights(), uninterrupted.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert int(resumed.model.optimizer.iterations.numpy()) == 4 * resumed.steps_per_epoch

    done = sparkdl.fit(
        df,
        make_mlp(hidden=(32,), optimizer=sgd(), seed=1),
        num_workers=2,
        epochs=4,
        batch_size=16,
        seed=5,
        checkpoint_dir=str(directory),
    )
    assert done.initial_epoch == 4 and done.seconds == 0.0  # nothing left to train
    for got, want in zip(done.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode, options", [("async", {"num_servers": 2}), ("average", {"sync_every": 9})])
def test_server_and_average_modes_checkpoint_and_resume(spark, digits, tmp_path, mode, options):
    x_train, _, y_train, _ = digits
    rows = 288  # 144 a worker: 9 steps of 16 an epoch, which sync_every=9 divides
    df = digits_frame(spark, x_train[:rows], y_train[:rows])
    first = sparkdl.fit(
        df,
        make_mlp(),
        num_workers=2,
        mode=mode,
        epochs=3,
        batch_size=16,
        seed=0,
        checkpoint_dir=str(tmp_path),
        **options,
    )
    saved = CheckpointStore.open(str(tmp_path)).latest()
    assert saved.epoch == 3 and saved.mode == mode
    assert saved.history.keys() == first.history.keys()  # the driver's checkpoints hold the final history
    for name, values in first.history.items():
        assert saved.history[name] == pytest.approx(values)
    if mode == "async":  # the shards' optimizer state (Adam's moments and step count) travels beside the model
        assert sorted(saved.arrays)[:2] == ["shard0/0", "shard0/1"] and any(
            k.startswith("shard1/") for k in saved.arrays
        )

    resumed = sparkdl.fit(
        df,
        make_mlp(),
        num_workers=2,
        mode=mode,
        epochs=5,
        batch_size=16,
        seed=0,
        checkpoint_dir=str(tmp_path),
        **options,
    )
    assert resumed.initial_epoch == 3 and len(resumed.history["loss"]) == 5
    # The saved optimizer state was restored, not started afresh: Adam's step count runs on from the checkpoint's.
    steps = resumed.steps_per_epoch
    if mode == "async":  # every push (one per worker step) steps every shard's own Adam
        final = np.load(tmp_path / "epoch-000005.npz", allow_pickle=False)
        assert [int(final[f"shard{i}/0"]) for i in (0, 1)] == [5 * steps * 2] * 2  # afresh: 2 * steps * 2
    else:  # the averaged model's optimizer: sync_every=9 divides the 9-step epoch, so a checkpoint holds 3 epochs
        assert int(first.model.optimizer.iterations.numpy()) == 3 * steps
        assert int(resumed.model.optimizer.iterations.numpy()) == 5 * steps  # afresh: 2 * steps
    assert resumed.history["loss"][:3] == pytest.approx(first.history["loss"])
    assert resumed.stats["samples"] == 2 * rows  # only the 2 new epochs were trained, every row once
    assert resumed.history["loss"][-1] < first.history["loss"][-1]


def _adam_moments(optimizer_variables) -> dict[str, np.ndarray]:
    """Adam's step count and moments by name, from ``(name, value)`` pairs in its variables' order."""
    return {
        name: value for name, value in optimizer_variables if name.endswith(("iteration", "_momentum", "_velocity"))
    }


@pytest.mark.parametrize("mode, options", [("async", {}), ("average", {"sync_every": 4})])
def test_resume_restores_adams_moments_not_only_its_step_count(spark, digits, tmp_path, mode, options):
    """A fit saves Adam's state after one epoch; a second fit resumes it for another on rows weighted 0, where
    every gradient is exactly 0: Adam then only decays its moments (m <- beta_1 m, v <- beta_2 v per step), in any
    order the steps come in. So every moment after the resume is the checkpoint's times beta^steps, and one restarted
    at 0 (only the step count restored) stays 0. Async: the server shards' optimizers, saved beside the model;
    average: the averaged model's own."""
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:128], y_train[:128]).coalesce(1).withColumn("nothing", F.lit(0.0))
    settings = dict(num_workers=2, mode=mode, batch_size=16, seed=0, checkpoint_dir=str(tmp_path), **options)
    model = make_mlp(hidden=(16,))

    def names():  # the optimizer's variables in order; one server shard builds it over the same variables
        adam = keras.optimizers.Adam.from_config(model.optimizer.get_config())
        adam.build(model.trainable_variables)
        return [v.path for v in adam.variables]

    def saved(epoch):
        if mode == "async":
            arrays = np.load(tmp_path / f"epoch-{epoch:06d}.npz", allow_pickle=False)
            return _adam_moments((name, arrays[f"shard0/{j}"]) for j, name in enumerate(names()))
        optimizer = keras.models.load_model(tmp_path / f"epoch-{epoch:06d}.keras").optimizer
        return _adam_moments((v.path, np.asarray(v.numpy())) for v in optimizer.variables)

    sparkdl.fit(df, model, epochs=1, **settings)
    before = saved(1)
    resumed = sparkdl.fit(df, make_mlp(hidden=(16,)), epochs=2, sample_weight_col="nothing", **settings)
    after = saved(2)

    assert resumed.initial_epoch == 1 and resumed.history["loss"][1] == 0.0
    steps = resumed.stats["versions"][0] if mode == "async" else resumed.steps_per_epoch  # Adam steps since resume
    assert steps == (2 * 4 if mode == "async" else 4)  # 64 rows per worker in batches of 16: 4 steps, each a push
    assert len(before) == 1 + 2 * len(model.trainable_variables) and after.keys() == before.keys()
    for name, value in before.items():
        if name.endswith("iteration"):
            assert int(after[name]) == int(value) + steps
            continue
        assert np.abs(value).max() > 1e-6, f"{name} is 0 in the checkpoint: the test could not tell it was restored"
        beta = 0.9 if name.endswith("_momentum") else 0.999
        np.testing.assert_allclose(after[name], value * beta**steps, rtol=1e-5, atol=0, err_msg=name)


@pytest.mark.slow  # three fits of 7 to 9 averaging rounds, each a Spark job
def test_average_mode_resumes_exactly_from_a_checkpoint_taken_mid_round(digits_df, tmp_path):
    """sync_every=20 does not divide the 45-step epoch: the checkpoint of epoch 2 (step 90) is the averaged state
    after the round of steps 80..99, 10 steps into epoch 3, and says so (its position: 10 steps into the epoch
    after epoch 2). A fit that died in epoch 3 resumes at step 100 with that state's optimizer, in the rounds of an
    uninterrupted fit: its weights are that fit's, and nothing is trained twice."""
    settings = dict(num_workers=2, mode="average", batch_size=16, seed=0, sync_every=20)
    first = sparkdl.fit(digits_df, make_mlp(), epochs=3, checkpoint_dir=str(tmp_path), **settings)
    steps = first.steps_per_epoch
    assert steps == 45 and first.stats["rounds"] == -(-3 * steps // 20)
    for name in _files(tmp_path):  # as if the first fit had died during epoch 3
        if name.startswith("epoch-000003."):
            os.remove(tmp_path / name)
    saved = keras.models.load_model(tmp_path / "epoch-000002-step-000000010.keras")
    assert int(saved.optimizer.iterations.numpy()) == 100  # the round that ended epoch 2 ran on to step 100
    assert CheckpointStore.open(str(tmp_path)).latest().position.steps == 10
    assert (tmp_path / "epoch-000001-step-000000015.json").exists()  # round 40..59 ended epoch 1

    resumed = sparkdl.fit(digits_df, make_mlp(), epochs=4, checkpoint_dir=str(tmp_path), **settings)
    whole = sparkdl.fit(digits_df, make_mlp(), epochs=4, **settings)
    assert resumed.initial_epoch == 2 and len(resumed.history["loss"]) == 4
    assert resumed.history["loss"][:2] == pytest.approx(first.history["loss"][:2])
    # Steps 100..179 in the rounds 100..119, ..., 160..179 of the uninterrupted fit, each trained once.
    assert resumed.stats["steps"] == 2 * (4 * steps - 100) and resumed.stats["rounds"] == 4
    assert int(resumed.model.optimizer.iterations.numpy()) == 4 * steps == int(whole.model.optimizer.iterations)
    for mine, theirs in zip(resumed.model.get_weights(), whole.model.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    assert resumed.history["loss"][3] == pytest.approx(whole.history["loss"][3], rel=1e-5)  # a whole epoch in both


def test_a_checkpoint_without_a_step_resumes_at_its_epoch_start(tmp_path):
    """Checkpoints written before the step was recorded (and other modes') resume at the epoch's first step; so does
    one whose step lies outside the epoch (the steps per epoch changed), rather than skip or repeat steps."""
    from sparkdl.keras import serialization
    from sparkdl.modes.average.rounds import resume_step
    from sparkdl.modes.base import Settings

    store = CheckpointStore.open(str(tmp_path))
    store.save(Checkpoint(2, serialization.model_to_bytes(make_mlp(hidden=(8,))), {"loss": [1.0, 0.5]}, "average"))
    meta = json.loads((tmp_path / "epoch-000002.json").read_text())
    del meta["step"]  # the format before this field
    (tmp_path / "epoch-000002.json").write_text(json.dumps(meta))
    old = store.latest()
    assert old.epoch == 2 and old.step is None
    settings = Settings(rules=None, num_workers=2, epochs=4, batch_size=16, steps_per_epoch=45, seed=0, initial_epoch=2)
    assert resume_step(settings, old.step) == 90
    assert resume_step(settings, 100) == 100
    assert resume_step(settings, 140) == 90  # not in epoch 2's steps 90..134


@pytest.mark.parametrize(
    "location, message",
    [
        ("", "Expected `checkpoint_dir` to be a path or URI"),
        ("nosuchscheme://bucket/dir", "Cannot use checkpoint_dir='nosuchscheme://bucket/dir'"),
    ],
)
def test_bad_checkpoint_dir_fails_on_the_driver_before_any_job(spark, digits_df, location, message):
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        sparkdl.fit(digits_df, make_mlp(), checkpoint_dir=location)


def test_a_checkpoint_of_another_model_is_refused_before_any_job(spark, digits_df, tmp_path):
    from sparkdl.keras import serialization

    CheckpointStore.open(str(tmp_path)).save(
        Checkpoint(1, serialization.model_to_bytes(make_mlp(hidden=(8,))), {"loss": [1.0]}, "sync")
    )
    with no_spark_job(spark), pytest.raises(ValueError, match="holds a checkpoint .* of a different model"):
        sparkdl.fit(digits_df, make_mlp(hidden=(16,)), checkpoint_dir=str(tmp_path))


def test_a_step_checkpoint_holds_the_epochs_whose_ends_arrive_after_it_is_due(tmp_path):
    """The parameter servers save a step checkpoint into epoch 1 when a worker asks, on another thread than the one
    the epochs' ends arrive on: the checkpoint waits for epoch 0's end and holds its history, and only its."""
    import threading

    from sparkdl.checkpoint import Checkpointer
    from sparkdl.position import EpochPosition, Segment

    store = CheckpointStore.open(str(tmp_path))
    position = EpochPosition(1, 0, True, 7, (Segment(2, (10, 10), 5, 2),))
    with Checkpointer(store, Checkpoint(0, b"model", {}, "async"), "async") as checkpointer:
        late = threading.Timer(0.5, lambda: checkpointer.record({"loss": 2.0}))
        late.start()
        checkpointer.save(1, b"model", position=position)  # due before epoch 0's end reached the driver
        late.join()
        checkpointer.record({"loss": 1.0})  # epoch 1's end, before the save was written: not the checkpoint's
    saved = store.latest()
    assert saved.position == position and saved.history == {"loss": [2.0]}
