""".ci/run fails when any of its steps fails, and runs nothing after it.

The script runs unchanged in a scratch repository: its ``python3.11 -m venv`` makes virtualenvs whose ``python`` is
this machine's real Python (so a real failing test or job fails it), and whose ``pip``, ``ruff`` and ``mypy`` record
their arguments and fail when asked to (a failed install or lint, without touching the network or needing the lint
tools in the README's virtualenv). ``conf/horovod/install.sh`` and ``apt-get`` are stand-ins that fail when asked
to (nothing is installed on this machine). Every step writes a line to a log, so a test sees which steps ran.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A virtualenv's tools as `python3.11 -m venv DIR` makes them here: each logs its arguments, then runs the real Python
# or, for pip, ruff, mypy and the Horovod installer, succeeds unless its command line holds $FAIL_WHEN.
_LOGGED = """#!/bin/sh
echo "{name} $*" >> "$STEPS_LOG"
case "{name} $*" in *"$FAIL_WHEN"*) [ -n "$FAIL_WHEN" ] && exit 1;; esac
{run}
"""
_VENV = """#!/bin/sh
# python3.11: `-m venv DIR` makes DIR/bin with logged tools; anything else is an error here
echo "python3.11 $*" >> "$STEPS_LOG"
[ "$1 $2" = "-m venv" ] || exit 97
mkdir -p "$3/bin"
for tool in pip ruff mypy; do
  printf '%s' "$PIP" | sed "s/{name}/$tool/g" > "$3/bin/$tool"
done
printf '%s' "$PYTHON" > "$3/bin/python"
chmod +x "$3"/bin/*
"""

_JOB = "raise SystemExit({exit_code})\n"
_SLOW_TEST = "import pytest\n\n\n@pytest.mark.slow\ndef test_slow():\n    assert {outcome}\n"


def _tool(name: str, run: str) -> str:
    return _LOGGED.format(name=name, run=run)


@pytest.fixture
def scratch(tmp_path):
    """A repository holding .ci/run as it is, a clean Python file and a passing test, and the fake tools."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy2(REPO / ".ci" / "run", repo / ".ci" / "run")
    (repo / "conf" / "horovod").mkdir(parents=True)
    installer = repo / "conf" / "horovod" / "install.sh"
    installer.write_text(_tool("install.sh", 'mkdir -p "$1/bin" && cp "$(dirname "$0")/python" "$1/bin/python"'))
    installer.chmod(0o755)
    (repo / "conf" / "horovod" / "python").write_text(_tool("horovod-python", "exit 0"))
    (repo / "conf" / "horovod" / "python").chmod(0o755)
    (repo / "pyproject.toml").write_text(
        "[tool.ruff]\nline-length = 120\n[tool.pytest.ini_options]\naddopts = \"-p no:cacheprovider -m 'not slow'\"\n"
        'markers = ["slow: the slow command"]\n'
    )
    (repo / "jobs").mkdir()
    (repo / "jobs" / "train.py").write_text(_JOB.format(exit_code=0))
    (repo / "tests").mkdir()
    (repo / "tests" / "test_ok.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    (repo / "tests" / "test_slow.py").write_text(_SLOW_TEST.format(outcome="True"))
    path = tmp_path / "path"
    path.mkdir()
    (path / "python3.11").write_text(_VENV)
    (path / "python3.11").chmod(0o755)
    (path / "apt-get").write_text(_tool("apt-get", "exit 0"))
    (path / "apt-get").chmod(0o755)
    env = {
        "PATH": f"{path}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(tmp_path),
        "STEPS_LOG": str(tmp_path / "steps.log"),
        "FAIL_WHEN": "",
        "PIP": _tool("{name}", "exit 0"),
        # the scratch tests must not pick up this suite's conftest or a PYTHONPATH of ours
        "PYTHON": _tool("python", f'cd "{repo}" && exec "{sys.executable}" "$@"'),
    }
    return repo, env


def _run(repo: Path, env: dict) -> tuple[int, list[str]]:
    done = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=300)
    log = Path(env["STEPS_LOG"])
    return done.returncode, log.read_text().splitlines() if log.exists() else []


def test_every_step_runs_in_order_when_all_pass(scratch):
    repo, env = scratch
    code, steps = _run(repo, env)
    assert code == 0, steps
    assert [step.split()[0] for step in steps] == [
        "python3.11",
        "pip",
        "ruff",
        "ruff",
        "mypy",
        "python3.11",
        "pip",
        "python",
        "python3.11",
        "pip",
        "python",
        "apt-get",
        "apt-get",
        "python",
        "install.sh",
        "horovod-python",
    ], steps


@pytest.mark.parametrize(
    "break_it, failing_step",
    [
        ("lint", "ruff check"),
        ("format", "ruff format --check"),
        ("install", "pip install -q -e"),  # the lint tools' install fails
        ("type check", "mypy"),
        ("job install", "pip install -e .[cpu,examples]"),  # the README's first command
        ("job", "python jobs/train.py"),  # the main job fails, for real
        ("default install", "pip install -e .[cpu,test,tracking]"),  # the suite must not be skipped
        ("test", "python -m pytest -q tests"),  # a real failing test, run by the real pytest
        ("apt-get", "apt-get install -y -q iptables"),  # what the slow tests need, before them
        ("slow test", "python -m pytest -q -m slow tests"),
        ("horovod install", "install.sh"),
    ],
)
def test_a_failing_step_fails_the_script_and_nothing_after_it_runs(scratch, break_it, failing_step):
    repo, env = scratch
    if break_it == "job":
        (repo / "jobs" / "train.py").write_text(_JOB.format(exit_code=1))
    elif break_it == "test":
        (repo / "tests" / "test_ok.py").write_text("def test_ok():\n    assert 1 + 1 == 3\n")
    elif break_it == "slow test":
        (repo / "tests" / "test_slow.py").write_text(_SLOW_TEST.format(outcome="False"))
    else:
        env["FAIL_WHEN"] = failing_step
    code, steps = _run(repo, env)
    assert code != 0, f"{break_it}: .ci/run exited 0 although {failing_step!r} failed; steps: {steps}"
    assert steps and failing_step in steps[-1], f"{break_it}: steps ran after the failing one: {steps}"


_SKIPS = """import pytest


def test_skipped_by_a_call():
    pytest.skip("a dependency is missing")


@pytest.mark.skipif(True, reason="a condition holds")
def test_skipped_by_a_mark():
    pass


@pytest.mark.xfail(reason="known")
def test_expected_to_fail():
    assert False


def test_passes():
    pass
"""


@pytest.mark.parametrize("ci", [False, True])
def test_a_skip_fails_the_suite_under_ci_and_an_expected_failure_does_not(tmp_path, ci):
    """tests/conftest.py's rule: with SPARKDL_CI set (.ci/run), a skip outside its allow-list is a failure."""
    (tmp_path / "test_skips.py").write_text(_SKIPS)
    env = {key: value for key, value in os.environ.items() if key != "SPARKDL_CI"}
    env["PYTHONPATH"] = str(REPO / "tests")
    if ci:
        env["SPARKDL_CI"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "conftest", "-p", "no:cacheprovider", "test_skips.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = done.stdout.strip().splitlines()[-1]
    if ci:
        assert done.returncode == 1 and "1 failed, 1 passed, 1 xfailed, 1 error" in summary, done.stdout
        assert done.stdout.count("skipped under SPARKDL_CI") >= 2, done.stdout
    else:
        assert done.returncode == 0 and "1 passed, 2 skipped, 1 xfailed" in summary, done.stdout


def test_the_allowed_skips_name_tests_that_exist():
    from conftest import ALLOWED_SKIPS

    for nodeid in ALLOWED_SKIPS:
        path, _, name = nodeid.partition("::")
        assert (REPO / path).is_file(), nodeid
        assert not name or f"def {name}(" in (REPO / path).read_text(), nodeid
