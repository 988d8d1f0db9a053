"""Sync mode when something goes wrong inside the workers: a rank that raises, replicas that diverge, a
checkpoint that cannot be written; and EarlyStopping, which must stop every rank at the same epoch."""

import glob
import json
import os
import time

import keras
import pytest
from frames import digits_frame
from models import RecordEpochs, make_mlp
from worker_callbacks import FailOrBlockAtStart, PerturbWeightsOnRank, ReplaceDirectoryWithFile

import sparkdl


@pytest.fixture(scope="module")
def small_df(spark, digits):
    x_train, _, y_train, _ = digits
    return digits_frame(spark, x_train[:128], y_train[:128]).cache()


def _gone(pid):
    """True once process ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_raising_rank_cancels_the_job_while_another_rank_is_blocked_outside_any_collective(spark, small_df, tmp_path):
    """Rank 0 raises in on_train_begin while rank 1 waits in its own on_train_begin, where no broken ring can wake it:
    fit raises rank 0's error, the stage ran once (no retry of a job that was cancelled; a failed barrier stage
    left to Spark would run spark.stage.maxConsecutiveAttempts times), and rank 1's process was killed mid-wait."""
    retries = int(spark.sparkContext.getConf().get("spark.stage.maxConsecutiveAttempts", "4"))
    assert retries > 1, "with a single stage attempt, the attempt count below proves nothing"
    callback = FailOrBlockAtStart(str(tmp_path), failing=0, block_seconds=300)

    with pytest.raises(sparkdl.WorkerError, match="rank 0 gives up on purpose") as caught:
        sparkdl.fit(
            small_df,
            make_mlp(hidden=(8,)),
            num_workers=2,
            epochs=2,
            batch_size=8,
            seed=0,
            timeout=600,
            callbacks=[callback],
            progress=False,
        )
    assert caught.value.rank == 0 and isinstance(caught.value, ValueError)

    begun = {rank: len(glob.glob(str(tmp_path / f"begin-rank{rank}-*"))) for rank in (0, 1)}
    assert begun == {0: 1, 1: 1}, f"training began per rank {begun}: the job was retried instead of cancelled"
    blocked = int((tmp_path / "pid-rank1").read_text())
    deadline = time.monotonic() + 120  # a wait with a bound, not a timing claim: the kill is asynchronous
    while not _gone(blocked) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(blocked), f"rank 1's Python worker (pid {blocked}) is still running: its task was not cancelled"
    (tmp_path / "release").touch()  # were it still alive, rank 1 would now finish its wait
    assert not (tmp_path / "finished-rank1").exists(), "rank 1 ran its wait to the end"

    after = sparkdl.fit(small_df, make_mlp(hidden=(8,)), num_workers=2, epochs=1, batch_size=8, seed=0, progress=False)
    assert len(after.history["loss"]) == 1  # the session is usable after the cancelled job


def test_diverged_replicas_fail_the_fit(small_df):
    """Rank 1 changes its weights after the last step: the end-of-training check must refuse to ship rank 0's model."""
    with pytest.raises(sparkdl.WorkerError, match=r"Replicas diverged: the largest difference from rank 0's weights"):
        sparkdl.fit(
            small_df,
            make_mlp(hidden=(8,)),
            num_workers=2,
            epochs=1,
            batch_size=8,
            seed=0,
            progress=False,
            callbacks=[PerturbWeightsOnRank(rank=1, delta=1.0)],
        )


def test_a_failed_checkpoint_write_fails_the_fit(small_df, tmp_path):
    """After epoch 1's checkpoint, the checkpoint directory becomes a file: the next write fails, and so must fit."""
    directory = tmp_path / "ckpt"
    with pytest.raises(sparkdl.WorkerError) as caught:
        sparkdl.fit(
            small_df,
            make_mlp(hidden=(8,)),
            num_workers=2,
            epochs=3,
            batch_size=8,
            seed=0,
            progress=False,
            checkpoint_dir=str(directory),
            callbacks=[ReplaceDirectoryWithFile(str(directory), epoch=1)],
        )
    assert directory.is_file(), caught.value
    assert caught.value.rank == 0
    assert "checkpoint" in str(caught.value).lower() or "ckpt" in str(caught.value), caught.value


def test_early_stopping_stops_every_rank_at_the_same_epoch(small_df, tmp_path):
    """EarlyStopping sees the loss averaged over ranks, so every rank stops after the same epoch and the job ends
    cleanly: with patience 0 and an improvement no epoch can make, training stops after epoch 2 of 6."""
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=100.0)
    result = sparkdl.fit(
        small_df,
        make_mlp(hidden=(8,)),
        num_workers=2,
        epochs=6,
        batch_size=8,
        seed=0,
        timeout=120,
        progress=False,
        callbacks=[stop, RecordEpochs(str(tmp_path))],
    )

    assert len(result.history["loss"]) == 2
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}-epoch{e}.json" for r in (0, 1) for e in (0, 1)]
    for epoch in (0, 1):  # both ranks saw, and decided on, the same (averaged) loss
        seen = [json.loads((tmp_path / f"rank{r}-epoch{epoch}.json").read_text())["loss"] for r in (0, 1)]
        assert seen[0] == seen[1] == pytest.approx(result.history["loss"][epoch])
    assert int(result.model.optimizer.iterations.numpy()) == 2 * result.steps_per_epoch
