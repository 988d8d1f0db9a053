"""Checkpoint folders and files on a local filesystem are private to the user: they hold the model and its optimizer."""

import os
import stat

import numpy as np
import pytest

from sparkdl.checkpoint import Checkpoint, Checkpointer, CheckpointStore


@pytest.fixture
def permissive_umask():
    """A umask that would make new files world-readable, so that privacy must come from sparkdl."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_created_folders_are_0700_and_files_0600(tmp_path, permissive_umask):
    location = tmp_path / "runs" / "job-1"
    store = CheckpointStore.open(str(location))
    with Checkpointer(store, Checkpoint(0, b"", {}, "sync"), "async") as checkpointer:
        checkpointer.record({"loss": 1.0})
        checkpointer.save(1, b"model bytes", {"shard_0": np.arange(3.0)})

    assert _mode(tmp_path / "runs") == 0o700 and _mode(location) == 0o700  # the parent sparkdl created, too
    files = sorted(os.listdir(location))
    assert files == ["epoch-000001.json", "epoch-000001.keras", "epoch-000001.npz"]
    assert {name: _mode(location / name) for name in files} == dict.fromkeys(files, 0o600)
    latest = store.latest()
    assert (latest.epoch, latest.model_bytes, latest.history, latest.mode) == (
        1,
        b"model bytes",
        {"loss": [1.0]},
        "async",
    )
    np.testing.assert_array_equal(latest.arrays["shard_0"], np.arange(3.0))


def test_an_existing_folder_keeps_its_mode(tmp_path, permissive_umask):
    location = tmp_path / "shared"
    location.mkdir(mode=0o755)
    os.chmod(location, 0o755)
    CheckpointStore.open(str(location)).save(Checkpoint(2, b"m", {}, "sync"))
    assert _mode(location) == 0o755  # the user's own folder is theirs to set
    assert {_mode(location / name) for name in os.listdir(location)} == {0o600}
