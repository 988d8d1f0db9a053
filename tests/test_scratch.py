"""A worker killed with SIGKILL while its partition arrives leaves its spill directory behind; the next spill in the
same folder removes it, and nothing of a process still alive, of another pid namespace or of another kind."""

import os
import signal
import subprocess
import sys

from sparkdl import scratch
from sparkdl.data.fields import INPUT, Field
from sparkdl.data.spill import SpilledRows

FIELDS = (Field(INPUT, "x", "x", ("x",), (4,), "float32"),)

# A worker spilling rows: it writes one batch, says where, and waits to be killed (or told to go on).
_SPILLING = """
import sys
import numpy as np
from sparkdl.data.fields import INPUT, Field
from sparkdl.data.spill import SpilledRows

rows = SpilledRows((Field(INPUT, "x", "x", ("x",), (4,), "float32"),), sys.argv[1])
rows.append({"x": np.ones((100, 4), np.float32)})
print(rows._directory, flush=True)
sys.stdin.readline()
"""


def _spilling(parent):
    child = subprocess.Popen(
        [sys.executable, "-c", _SPILLING, str(parent)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return child, child.stdout.readline().strip()


def test_a_killed_workers_spill_directory_goes_with_the_next_spill_and_a_live_ones_stays(tmp_path):
    killed, killed_directory = _spilling(tmp_path)
    alive, alive_directory = _spilling(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert os.path.exists(os.path.join(killed_directory, "rows"))  # left by the SIGKILL
        elsewhere = tmp_path / "sparkdl-1-999999-00000000"  # another pid namespace's, its pid meaningless here
        elsewhere.mkdir()
        unrelated = tmp_path / "sparkdl-notes"
        unrelated.mkdir()

        rows = SpilledRows(FIELDS, str(tmp_path))
        assert not os.path.exists(killed_directory)
        assert os.path.isdir(alive_directory) and elsewhere.is_dir() and unrelated.is_dir()
        rows.discard()
    finally:
        alive.communicate("go on\n", timeout=30)
    assert scratch.remove_abandoned(str(tmp_path)) == [alive_directory]  # its process ended without discarding
    assert sorted(os.listdir(tmp_path)) == ["sparkdl-1-999999-00000000", "sparkdl-notes"]


def test_a_scratch_directory_is_private_and_removed_after_its_block(tmp_path):
    with scratch.directory(str(tmp_path)) as path:
        assert os.stat(path).st_mode & 0o777 == 0o700
        assert os.path.basename(path).startswith(f"sparkdl-{os.stat('/proc/self/ns/pid').st_ino}-{os.getpid()}-")
        with open(os.path.join(path, "model.keras"), "wb") as f:
            f.write(b"x")
    assert os.listdir(tmp_path) == []
