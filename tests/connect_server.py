"""A real Spark Connect server for the tests that need one: started with spark-submit, as a deployment starts it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_SECONDS = 240  # a cold JVM on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def event_log_conf(directory: Path) -> tuple[str, ...]:
    """Spark settings that write an application's event log into ``directory`` (made here) as one plain JSON file."""
    directory.mkdir()
    return (
        "spark.eventLog.enabled=true",
        f"spark.eventLog.dir={directory.as_uri()}",
        "spark.eventLog.rolling.enabled=false",
        "spark.eventLog.compress=false",
    )


def read_event_log(directory: Path) -> list[dict]:
    """The events of the one application that logged into ``directory`` (flushed at each job's end)."""
    (path,) = directory.iterdir()
    return [json.loads(line) for line in path.read_text().splitlines()]


@contextlib.contextmanager
def spark_connect_server(directory: Path, *, conf: tuple[str, ...] = ()) -> Iterator[dict]:
    """A server on ``local[2]`` (its own JVM and Python workers: this interpreter), on loopback.

    Yields ``{"url", "pid", "log"}``; its output goes to ``directory / "server.log"``. Waits (at most
    ``START_SECONDS``) until it accepts connections, failing with the log's tail if it exits or
    does not; stops its whole process group afterwards.
    """
    port = free_port()
    log = directory / "server.log"
    spark_submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    settings = [
        f"spark.connect.grpc.binding.port={port}",
        "spark.connect.grpc.binding.address=127.0.0.1",
        "spark.driver.host=127.0.0.1",
        "spark.ui.enabled=false",
        *conf,
    ]
    command = [
        spark_submit,
        "--class",
        "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--master",
        "local[2]",
        *(item for setting in settings for item in ("--conf", setting)),
        "spark-internal",
    ]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    with open(log, "w") as output:
        server = subprocess.Popen(
            command, cwd=directory, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if server.poll() is not None:
                pytest.fail(f"The Spark Connect server exited with {server.returncode}:\n{log_tail(log)}")
            with socket.socket() as probe:
                probe.settimeout(1.0)
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                pytest.fail(
                    f"The Spark Connect server did not accept connections on port {port} within "
                    f"{START_SECONDS} s:\n{log_tail(log)}"
                )
            time.sleep(0.5)
        yield {"url": f"sc://127.0.0.1:{port}", "pid": server.pid, "log": str(log)}
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(timeout=60)
