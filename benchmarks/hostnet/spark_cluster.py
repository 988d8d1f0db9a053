"""A Spark standalone cluster on the emulated hosts: the master on the switch, one worker per host, the driver here.

Each worker (and so its executor JVM and the executor's Python workers, which it starts) runs in its host's
namespace, bound to the host's address (``SPARK_LOCAL_IP``, ``--host``): Spark and sparkdl see one machine per
host, and sparkdl's ranks share memory within a host and speak TCP across hosts. The master listens on the switch's
own address (a service of the network, in the switch's namespace); the driver (a SparkSession of this process)
reaches both through the root namespace's port on the bridge (``Network(root_port=True)``), on its own address, so
that faults of the hosts' links never cut the driver off from the other hosts.

Everything a cluster starts writes under one scratch folder (``tmp`` and Spark's local directories per host, the
workers' work directories, the daemons' logs), and this process's own temporary files go there too
(``tempfile.tempdir``), so :mod:`hostnet.leftovers` can tell what a fit left behind. ``close`` kills every process
in the network's namespaces (``Network.close``), the master and workers first, and removes the folder.

The session's settings are those of a small cluster that notices a lost host within ``LOST_AFTER`` seconds (Spark's
default is 120): the executors' heartbeat every 3 s, ``spark.network.timeout`` of ``LOST_AFTER``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from hostnet.network import Network
from hostnet.processes import Started, stat_fields

MASTER_PORT, MASTER_UI_PORT, WORKER_PORT, WORKER_UI_PORT = 7077, 8080, 7078, 8081  # namespaces of their own: no clash
LOST_AFTER = 30  # seconds without a heartbeat before the driver gives an executor up (spark.network.timeout)
EXECUTOR_MAIN = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
DAEMON_MODULE = "sparkdl.launch.worker_daemon"  # the executors' Python workers fork from it (TensorFlow loaded once)


class SparkCluster(Started):
    """A master on ``network``'s switch and a worker of ``cores`` cores on each of its hosts; :meth:`session` is
    the driver's SparkSession. Use it as a context manager (after the network's)."""

    def __init__(self, network: Network, *, cores: int = 2, executor_memory: str = "1g", start_timeout: float = 180):
        if network.root_address is None:
            raise ValueError("Expected a network with a root port (Network(root_port=True)). Received: none")
        self.network = network
        self.cores = cores
        self.executor_memory = executor_memory
        self.start_timeout = start_timeout
        self.scratch = tempfile.mkdtemp(prefix=f"{network.prefix}-spark-")
        self.master_url = f"spark://{network.switch_address}:{MASTER_PORT}"
        self._daemons: dict[str, subprocess.Popen] = {}  # "master", "worker 0", ... -> its process
        self._session = None
        self._previous_tempdir = tempfile.tempdir

    # -- the daemons ------------------------------------------------------------------------

    def start(self) -> None:
        tempfile.tempdir = self.folder("driver", "tmp")  # this process's temporary files, the driver's
        self._start("master", ["ip", "netns", "exec", self.network.switch], self.network.switch_address, [
            "org.apache.spark.deploy.master.Master", "--host", self.network.switch_address,
            "--port", str(MASTER_PORT), "--webui-port", str(MASTER_UI_PORT),
        ])  # fmt: skip
        self._wait(lambda state: True, "the master's web UI to answer")
        for host, address in enumerate(self.network.addresses):
            self._start(f"worker {host}", self.network.exec_in(host), address, [
                "org.apache.spark.deploy.worker.Worker", self.master_url, "--host", address,
                "--port", str(WORKER_PORT), "--webui-port", str(WORKER_UI_PORT), "--cores", str(self.cores),
                "--memory", "4g", "--work-dir", self.folder(f"worker{host}", "work"),
            ])  # fmt: skip
        hosts = len(self.network.hosts)
        self._wait(lambda state: _alive_workers(state) == hosts, f"{hosts} workers to register with the master")

    def folder(self, *parts: str) -> str:
        path = os.path.join(self.scratch, *parts)
        os.makedirs(path, exist_ok=True)
        return path

    def _start(self, name: str, prefix: list[str], address: str, arguments: list[str]) -> None:
        spark_home = _spark_home()
        where = name.replace(" ", "")
        env = {
            **os.environ,
            "SPARK_HOME": spark_home,
            "SPARK_LOCAL_IP": address,
            "SPARK_LOCAL_DIRS": self.folder(where, "local"),
            "SPARK_LOG_DIR": self.folder(where, "logs"),
            "SPARK_PID_DIR": self.folder(where),
            "TMPDIR": self.folder(where, "tmp"),
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1",
        }
        for variable in ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "SPARK_REMOTE"):  # this driver's own
            env.pop(variable, None)
        log = open(os.path.join(self.folder(where, "logs"), "daemon.log"), "w")  # noqa: SIM115 (the process holds it)
        self._daemons[name] = subprocess.Popen(
            [*prefix, os.path.join(spark_home, "bin", "spark-class"), *arguments],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()

    def master_state(self) -> dict:
        """The master's view of the cluster (its web UI's JSON: workers, applications)."""
        url = f"http://{self.network.switch_address}:{MASTER_UI_PORT}/json/"
        with urllib.request.urlopen(url, timeout=5) as answer:
            return json.load(answer)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            for name, daemon in self._daemons.items():
                if daemon.poll() is not None:
                    raise RuntimeError(
                        f"the Spark {name} exited ({daemon.returncode}) while waiting for {what}: {self._log_tail(name)}"
                    )
            with contextlib.suppress(OSError, ValueError):
                if ready(self.master_state()):
                    return
            time.sleep(0.5)
        raise TimeoutError(f"waited {self.start_timeout} s for {what}; master: {self._log_tail('master')}")

    def _log_tail(self, name: str) -> str:
        path = os.path.join(self.scratch, name.replace(" ", ""), "logs", "daemon.log")
        with contextlib.suppress(OSError), open(path) as log:
            return log.read()[-2000:]
        return ""

    # -- the driver -------------------------------------------------------------------------

    def session(self, app_name: str = "sparkdl-hosts", **settings: str):
        """This process's SparkSession on the cluster (made once), with an executor on every host registered."""
        if self._session is not None:
            return self._session
        from pyspark.sql import SparkSession

        address = self.network.root_address
        builder = (
            SparkSession.builder.master(self.master_url)
            .appName(app_name)
            .config("spark.driver.host", address)
            .config("spark.driver.bindAddress", address)
            .config("spark.executor.cores", str(self.cores))
            .config("spark.cores.max", str(self.cores * len(self.network.hosts)))
            .config("spark.executor.memory", self.executor_memory)
            .config("spark.executor.extraJavaOptions", "-XX:TieredStopAtLevel=1")
            .config("spark.pyspark.python", sys.executable)
            .config("spark.python.daemon.module", DAEMON_MODULE)
            .config("spark.executor.heartbeatInterval", "3s")
            .config("spark.network.timeout", f"{LOST_AFTER}s")
            .config("spark.network.timeoutInterval", "5s")
            .config("spark.sql.shuffle.partitions", str(self.cores * len(self.network.hosts)))
            .config("spark.ui.enabled", "false")
        )
        for key, value in settings.items():
            builder = builder.config(key, value)
        os.environ["SPARK_LOCAL_IP"] = address  # the driver JVM's own sockets, as the settings say
        os.environ["PYSPARK_PYTHON"] = sys.executable  # what the executors start (PySpark's pythonExec reads it)
        self._session = builder.getOrCreate()
        self._session.sparkContext.setLogLevel("ERROR")
        self.wait_for_executors(len(self.network.hosts))
        return self._session

    def executor_hosts(self) -> list[str]:
        """The address of every live executor the driver knows (the driver's own entry left out)."""
        infos = self._session.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
        return sorted(str(info.host()) for info in infos if str(info.host()) != self.network.root_address)

    def wait_for_executors(self, count: int, timeout: float | None = None) -> None:
        """Until the driver has ``count`` executors with all their slots (one per host: ``count`` hosts)."""
        deadline = time.monotonic() + (self.start_timeout if timeout is None else timeout)
        sc = self._session.sparkContext._jsc.sc()
        profile = sc.resourceProfileManager().defaultResourceProfile()
        while int(sc.maxNumConcurrentTasks(profile)) < count * self.cores:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the driver has executors on {self.executor_hosts()}, not {count} hosts'")
            time.sleep(0.5)

    # -- the processes of a host ------------------------------------------------------------

    def host_processes(self, host: int) -> dict[int, str]:
        """Process id -> command line of every process in host ``host``'s namespace."""
        found = {}
        for pid in self.network.processes(host):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                found[pid] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        return found

    def executor_pid(self, host: int) -> int | None:
        """The executor JVM of host ``host``, if one runs."""
        return next((pid for pid, line in self.host_processes(host).items() if EXECUTOR_MAIN in line), None)

    def python_workers(self, host: int, window: float = 0.3) -> list[int]:
        """The Python workers of host ``host``'s executor (forked from its daemon), busiest first: by the CPU time each
        used in the last ``window`` seconds (a worker that ran an earlier task waits idle for the next one)."""
        daemons = {pid for pid, line in self.host_processes(host).items() if DAEMON_MODULE in line}
        workers = [pid for pid in daemons if _parent(pid) in daemons]
        before = {pid: _cpu_ticks(pid) for pid in workers}
        time.sleep(window)
        return sorted(workers, key=lambda pid: _cpu_ticks(pid) - before[pid], reverse=True)

    # -- the end ----------------------------------------------------------------------------

    def close(self) -> None:
        if self._session is not None:
            with contextlib.suppress(Exception):
                self._session.stop()
            self._session = None
        for daemon in self._daemons.values():
            with contextlib.suppress(ProcessLookupError):
                daemon.send_signal(signal.SIGKILL)
            daemon.wait()
        self._daemons.clear()
        tempfile.tempdir = self._previous_tempdir
        shutil.rmtree(self.scratch, ignore_errors=True)


def _spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def _alive_workers(state: dict) -> int:
    return sum(1 for worker in state.get("workers", []) if worker.get("state") == "ALIVE")


def _parent(pid: int) -> int:
    fields = stat_fields(pid)
    return int(fields[1]) if fields else 0


def _cpu_ticks(pid: int) -> int:
    fields = stat_fields(pid)
    return int(fields[11]) + int(fields[12]) if fields else 0
