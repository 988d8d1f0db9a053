"""Importing sparkdl first keeps TensorFlow's start-up lines off the console, and nothing else that the import writes.

TensorFlow 2.21 writes absl's preamble and its oneDNN notice (twice each) at import whatever ``TF_CPP_MIN_LOG_LEVEL``
says; a bare ``import keras`` on this machine shows them, ``import sparkdl, keras`` must not.
"""

import json
import os
import subprocess
import sys

import pytest

from sparkdl._tf_log import START_UP_LINES


def _stderrs(codes: list[str], cwd, **env) -> list[bytes]:
    """What each of ``codes`` writes to stderr, each run at the same time in an interpreter of its own."""
    environment = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONPATH")}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=cwd,
            env={**environment, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for code in codes
    ]
    try:
        stderrs = [process.communicate(timeout=300)[1] for process in processes]
    finally:
        for process in processes:
            process.kill()  # nothing to those that have exited; ends the others if one timed out
            process.wait()
    for process, stderr in zip(processes, stderrs):
        if process.returncode:
            raise subprocess.CalledProcessError(process.returncode, process.args, stderr=stderr)
    return stderrs


def _stderr(code: str, cwd, **env) -> bytes:
    return _stderrs([code], cwd, **env)[0]


def _start_up_lines(stderr: bytes) -> list[bytes]:
    return [line for line in stderr.splitlines() if any(notice in line for notice in START_UP_LINES)]


def test_import_sparkdl_then_keras_prints_none_of_what_a_bare_import_prints(tmp_path):
    bare, sparkdl_first = map(_start_up_lines, _stderrs(["import keras", "import sparkdl, keras"], tmp_path))
    assert bare, "a bare `import keras` printed no start-up lines here: this check would prove nothing"
    assert sparkdl_first == [], bare


FAKE_TENSORFLOW = b"""
import os
import warnings

os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
os.write(2, b"E0000 something TensorFlow really wants you to see\\n")
os.write(2, b"I0000 port.cc:153] oneDNN custom operations are on. You may see slightly different results\\n")
warnings.warn("a Python warning raised while importing")
"""


@pytest.fixture
def fake_tensorflow(tmp_path):
    """A ``tensorflow`` package that writes start-up lines and other lines to file descriptor 2 when imported."""
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_bytes(FAKE_TENSORFLOW)
    return tmp_path


def test_everything_else_written_during_the_import_still_shows_in_order(fake_tensorflow):
    stderr = _stderr("import sparkdl, tensorflow", fake_tensorflow, PYTHONPATH=str(fake_tensorflow))
    assert _start_up_lines(stderr) == []
    kept = [line for line in stderr.splitlines() if line.strip()]
    assert kept[0] == b"E0000 something TensorFlow really wants you to see", stderr
    assert b"UserWarning: a Python warning raised while importing" in stderr.split(kept[0], 1)[1], stderr


def test_tensorflows_own_verbose_level_shows_them(fake_tensorflow):
    stderr = _stderr(
        "import sparkdl, tensorflow", fake_tensorflow, PYTHONPATH=str(fake_tensorflow), TF_CPP_MIN_LOG_LEVEL="0"
    )
    assert len(_start_up_lines(stderr)) == 2, stderr


def test_import_sparkdl_loads_neither_tensorflow_nor_spark_ml(tmp_path):
    """What the import spares: the driver's ``import sparkdl`` and every worker daemon's start, before the model."""
    code = "import json, sys, sparkdl; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert "pyspark.sql" in loaded, "sparkdl stopped importing PySpark: this check would prove nothing"
    assert not loaded & {"tensorflow", "keras", "pyspark.ml", "pandas", "scipy"}, sorted(loaded)
