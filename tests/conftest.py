"""One SparkSession per test process: local[2,2] (two task slots, a failed task retried once), loopback only.

The suite runs in two test processes (pyproject.toml's addopts: pytest-xdist's ``-n 2 --dist loadfile``), so
that one process's tests use the cores while the other's wait on Spark's scheduling or a child process. A test
file runs whole in one process, so a module fixture is built once per run: a Spark of their own that several
tests share (a Spark Connect server, a benchmark's run) is a module fixture of their one file, not a session
fixture here, which each process would build again.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers must see this virtualenv
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # keep every socket on loopback
# Tests that run a pipeline's stages as threads of this process (tests/collective_ranks.py): each stage's compiled
# step holds one of TensorFlow's inter-op threads while it waits on a neighbour, so three stages on this machine's
# two would wait on each other for ever. A Spark task's stage is a process of its own.
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "8")
# Every Spark JVM the tests start (this session's, spark-submit's, the Connect server's, a child script's) compiles
# with the JIT's first tier only, as jobs/_jvm.py's do: the suite's many small queries each generate classes that C2
# would compile again and again (over 20 s of small fits, 5.7 of the JVM's 9.3 CPU seconds), for code run briefly.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1")
# Workers import test-only Keras layers (tests/models.py) when they load a model.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))

import numpy as np
import pytest
from frames import digits_frame

#: The only skips CI (``SPARKDL_CI``, set by .ci/run) accepts; anywhere else a skip fails the test, so a broken
#: dependency (the Connect client, a memory cgroup, ...) cannot hide a test. Each entry: a node id prefix, and why.
ALLOWED_SKIPS = {
    "tests/test_horovod.py": "the default stack has no Horovod; CI's Horovod pass runs it with SPARKDL_EXPECT_HOROVOD=1",
    "tests/test_horovod_collectives.py": "as tests/test_horovod.py: the Horovod pass runs it, where it cannot skip",
    "tests/test_launcher.py::test_horovod_backend_without_horovod_says_how_to_get_it": (
        "expects no Horovod: it runs in the default pass and skips in the Horovod stack's"
    ),
}


def _allowed_to_skip(nodeid: str) -> bool:
    return any(nodeid == prefix or nodeid.startswith(prefix + "::") for prefix in ALLOWED_SKIPS)


def _fail_a_skip_under_ci(report) -> None:
    """Turns a skip outside ALLOWED_SKIPS into a failure when SPARKDL_CI is set (an expected failure stays one)."""
    if not (report.skipped and os.environ.get("SPARKDL_CI")) or hasattr(report, "wasxfail"):
        return
    if _allowed_to_skip(report.nodeid):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under SPARKDL_CI, which runs every test ({reason}); see ALLOWED_SKIPS in conftest.py"


#: pytest-timeout's limit for tests marked slow (each starts a Spark, kernel or Connect server of its own) that set
#: none of their own; every other test has pyproject.toml's.
SLOW_TIMEOUT = 600


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_a_skip_under_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_a_skip_under_ci(outcome.get_result())


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("sparkdl-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's handwritten digits (shipped with the package), scaled to [0, 1], 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int64), test_size=0.2, random_state=0, stratify=y)


@pytest.fixture(scope="session")
def digits_df(spark, digits):
    x_train, _, y_train, _ = digits
    return digits_frame(spark, x_train, y_train).cache()
