"""The README's first Python snippet, run as a user runs it: a file of their own, ``python`` from the activated
virtualenv, and nothing else set.

tests/test_docs.py runs every snippet with ``PYSPARK_PYTHON``, ``SPARK_LOCAL_IP`` and ``PYTHONPATH`` preset (the
workers' Python, loopback, the tests' modules); a user who follows the README has none of them. Here the snippet
runs in a fresh interpreter, in a directory outside the checkout (sparkdl comes from the installed package), with
the virtualenv's ``bin`` first on ``PATH`` as ``source .venv/bin/activate`` leaves it, and without those three
variables or any other the test suite sets: Spark then starts its Python workers with the ``python3`` it finds on
``PATH``, and picks its own addresses.
"""

import ast
import os
import re
import sys
from pathlib import Path

import pytest
from process_groups import run_in_own_group
from test_docs import REPO, python_blocks

pytestmark = pytest.mark.slow  # its own Python process and Spark

TIMEOUT = 600  # seconds: Spark and TensorFlow start-up, and three epochs, on a busy 2-core machine
VIRTUALENV = Path(sys.prefix)
# What the test suite (conftest.py), test_docs or a job's launcher may have set, and a user's shell does not.
NOT_A_USERS = (
    "PYSPARK_PYTHON",
    "PYSPARK_DRIVER_PYTHON",
    "SPARK_LOCAL_IP",
    "PYTHONPATH",
    "SPARK_REMOTE",
    "PYSPARK_GATEWAY_PORT",
    "KERAS_BACKEND",
    "TF_CPP_MIN_LOG_LEVEL",
)


def users_environment() -> dict[str, str]:
    """This environment as after ``source .venv/bin/activate``, without what the test suite set."""
    env = {name: value for name, value in os.environ.items() if name not in NOT_A_USERS}
    env["PATH"] = os.pathsep.join([str(VIRTUALENV / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(VIRTUALENV)
    return env


def test_the_readmes_first_snippet_runs_as_a_user_pastes_it(tmp_path):
    (line, code), *_ = python_blocks((REPO / "README.md").read_text())
    assert "sparkdl.fit(" in code, f"README.md:{line}: the first Python snippet no longer calls sparkdl.fit"
    (tmp_path / "train.py").write_text(code)
    env = users_environment()
    log = tmp_path / "output.txt"
    returncode = run_in_own_group(["python", "train.py"], cwd=tmp_path, env=env, log=log, timeout=TIMEOUT)
    output = log.read_text()
    assert returncode == 0, f"README.md:{line}'s snippet failed or ran past {TIMEOUT}s:\n{output[-4000:]}"
    # print(result.history): three epochs of each metric, averaged over the workers; the model trained.
    (history,) = [ast.literal_eval(text) for text in re.findall(r"\{'accuracy': \[.*\]\}", output)]
    assert sorted(history) == ["accuracy", "loss"] and all(len(values) == 3 for values in history.values()), history
    assert history["loss"][-1] < history["loss"][0], history
    assert "Total params" in output, output[-4000:]  # result.model.summary()
