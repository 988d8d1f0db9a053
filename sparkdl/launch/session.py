"""Classic or Spark Connect: the one place that knows which kind of SparkSession sparkdl runs on.

A classic session drives a JVM in this process (``sparkContext``, broadcasts,
accumulators, the cluster's live task slots). A Spark Connect session
(``SparkSession.builder.remote("sc://...")``) talks to a server over gRPC and
has none of those. Everything sparkdl needs that differs between the two is
here: the master and the task slots, job tags, the address the driver-side
listeners (output relay, parameter server) bind and advertise, and how a value
is shipped to the tasks (a broadcast, a file Spark's file server streams, or in
the closure).

Under Connect the "driver" of sparkdl's own listeners is this Python client:
the tasks connect back to it, so its address must be one the executors reach.
``SPARKDL_DRIVER_HOST`` names it explicitly; otherwise, when the Connect server
runs on this machine, the server's ``spark.driver.host`` (an address of this
machine its executors already reach) is used, and for a server elsewhere the
address of the local interface that routes to the server's host.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import os
import re
import secrets
import socket
import threading
from typing import Any

from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

DRIVER_HOST_ENV = "SPARKDL_DRIVER_HOST"
MAX_MESSAGE_SETTING = "spark.connect.grpc.maxInboundMessageSize"
_DEFAULT_MAX_MESSAGE = 128 << 20  # Spark Connect's default for that setting and for the Python client's channel
_MESSAGE_HEADROOM = 1 << 20  # the rest of a plan: the pickled function, the DataFrame's operators

_LOCAL = re.compile(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]$")


def is_connect(spark: SparkSession) -> bool:
    """True for a Spark Connect session (it has no SparkContext, broadcasts or accumulators)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


#: Spark's own setting for encrypted RPC; when it is on, sparkdl seals its links too (sparkdl.net.secure).
ENCRYPTION_SETTING = "spark.network.crypto.enabled"


def encrypts_traffic(spark: SparkSession) -> bool:
    """Whether the session runs with Spark's RPC encryption on; a Connect server that does not say counts as off."""
    if not is_connect(spark):
        return spark.sparkContext.getConf().get(ENCRYPTION_SETTING, "false").strip().lower() == "true"
    try:
        value = spark.conf.get(ENCRYPTION_SETTING, "false")
    except Exception:  # noqa: BLE001 - a Connect server may refuse to show core settings
        return False
    return str(value).strip().lower() == "true"


#: Spark's setting for dynamic allocation, under which it refuses barrier stages (never in local mode).
DYNAMIC_ALLOCATION_SETTING = "spark.dynamicAllocation.enabled"


def dynamic_allocation(spark: SparkSession) -> bool:
    """Whether Spark allocates executors dynamically here, and so refuses barrier stages (local mode never does);
    a Connect server that does not say counts as off."""
    if is_local_mode(master(spark)):
        return False
    try:
        conf = spark.conf if is_connect(spark) else spark.sparkContext.getConf()
        value = conf.get(DYNAMIC_ALLOCATION_SETTING, "false")
    except Exception:  # noqa: BLE001 - a Connect server may refuse to show core settings
        return False
    return str(value).strip().lower() == "true"


def master(spark: SparkSession) -> str:
    """The cluster manager URL (``local[2]``, ``yarn``, ``spark://...``); "" when the server does not say."""
    if not is_connect(spark):
        return str(spark.sparkContext.master)
    return spark.conf.get("spark.master", "") or ""


def is_local_mode(master_url: str) -> bool:
    """``local[...]``: tasks are threads of one JVM (fixed slots, no GPU scheduling); not ``local-cluster``."""
    return master_url.startswith("local") and not master_url.startswith("local-cluster")


def task_slots(spark: SparkSession) -> int | None:
    """How many tasks the cluster can run at once right now, or None when that cannot be known.

    Classic: Spark's own count of the live executors' slots. Connect (no JVM in this
    process): derived from the server's settings: ``local[N]``, ``local[*]`` (when the
    server runs on this machine), ``local-cluster[n,c,m]``, or ``spark.executor.instances``
    x ``spark.executor.cores`` / ``spark.task.cpus`` when both are set.
    """
    if not is_connect(spark):
        sc = spark.sparkContext._jsc.sc()
        profile = sc.resourceProfileManager().defaultResourceProfile()
        return int(sc.maxNumConcurrentTasks(profile))
    task_cpus = int(spark.conf.get("spark.task.cpus", "1") or 1)
    url = master(spark)
    if local := _LOCAL.match(url):
        if local.group(1) is None:
            return 1
        if local.group(1) != "*":
            return int(local.group(1))
        return (os.cpu_count() or 1) if server_is_on_this_machine(spark) else None
    if cluster := _LOCAL_CLUSTER.match(url):
        return int(cluster.group(1)) * (int(cluster.group(2)) // task_cpus)
    instances, cores = spark.conf.get("spark.executor.instances", None), spark.conf.get("spark.executor.cores", None)
    if instances and cores:
        return int(instances) * (int(cores) // task_cpus)
    return None


def executor_hosts(spark: SparkSession) -> collections.Counter[str] | None:
    """How many executors each host runs now (the driver's own entry included), or None where Spark does not say
    (Spark Connect: no JVM in this process)."""
    if is_connect(spark):
        return None
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    return collections.Counter(str(info.host()) for info in infos)


def server_host(spark: SparkSession) -> str:
    """The Connect server's host name, as this client reaches it."""
    return spark.client.host.strip("[]")


def server_is_on_this_machine(spark: SparkSession) -> bool:
    try:
        address = str(socket.getaddrinfo(server_host(spark), None)[0][4][0])
    except OSError:
        return False
    if ipaddress.ip_address(address).is_loopback:
        return True
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
        probe.bind((address, 0))  # only an address of this machine can be bound
        return True
    return False


def driver_host(spark: SparkSession) -> str:
    """The address sparkdl's driver-side listeners bind and tell the tasks (module docstring)."""
    if not is_connect(spark):
        host = spark.sparkContext.getConf().get("spark.driver.host")
        if host is None:  # Spark sets it when the SparkContext starts
            raise RuntimeError("The SparkContext has no spark.driver.host: is the session stopped?")
        return host
    if explicit := os.environ.get(DRIVER_HOST_ENV):
        return explicit
    if server_is_on_this_machine(spark):
        return spark.conf.get("spark.driver.host", None) or "127.0.0.1"
    family, _, _, _, server = socket.getaddrinfo(server_host(spark), 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet is sent: connect only picks a route
        probe.connect(server)
        address = probe.getsockname()[0]
    logger.info(
        "sparkdl: Spark Connect: the tasks will connect back to this client at %s (the interface that "
        "routes to the server); set %s if the executors reach it under another address",
        address,
        DRIVER_HOST_ENV,
    )
    return address


def driver_heap(spark: SparkSession) -> int | None:
    """The driver JVM's heap in bytes; None under Connect (the server's JVM, which this client cannot ask)."""
    if is_connect(spark):
        return None
    jvm = spark.sparkContext._jvm
    assert jvm is not None, "a classic session has a JVM gateway"
    return int(jvm.java.lang.Runtime.getRuntime().maxMemory())


class JobTag:
    """A tag on the Spark jobs this thread starts while ``with tag:`` runs; ``cancel()`` stops them from any thread.

    Tags live in per-thread state (classic: the thread's local properties in the JVM; Connect: the
    client's thread-locals), but threads started through PySpark's ``inheritable_thread_target``, as
    CrossValidator's and TrainValidationSplit's ``parallelism`` threads are, share one copy of that state:
    a tag added in one would mark the jobs of all. So ``with tag:`` gives this thread its own copy for the
    block, with the tags it had plus this one, and puts the thread's former state back when it ends.
    """

    def __init__(self, spark: SparkSession, prefix: str = "sparkdl"):
        self._spark = spark
        self.name = f"{prefix}-{secrets.token_hex(8)}"
        self._outer: Any = None  # the thread's state before the block

    def cancel(self) -> None:
        if is_connect(self._spark):
            self._spark.interruptTag(self.name)
        else:
            self._spark.sparkContext.cancelJobsWithTag(self.name)

    def __enter__(self) -> JobTag:
        if is_connect(self._spark):
            self._outer = set(self._spark.getTags())
            self._spark.clearTags()  # a new set for this thread, not the one it may share
            for name in (*self._outer, self.name):
                self._spark.addTag(name)
        else:
            jvm_context = self._spark.sparkContext._jsc.sc()
            self._outer = jvm_context.getLocalProperties()
            jvm_context.setLocalProperties(self._outer.clone())
            self._spark.sparkContext.addJobTag(self.name)
        return self

    def __exit__(self, *exc_info) -> None:
        if is_connect(self._spark):
            self._spark.clearTags()
            for name in self._outer:
                self._spark.addTag(name)
        else:
            self._spark.sparkContext._jsc.sc().setLocalProperties(self._outer)


class InClosure:
    """A value that travels inside the task closure; reads like a Broadcast (``value``, ``destroy``)."""

    def __init__(self, value: Any):
        self.value = value

    def unpersist(self, blocking: bool = False) -> None:
        """Nothing to release: the value goes with each job's plan."""

    def destroy(self) -> None:
        """Nothing to release: the value goes with each job's plan."""


def ship(spark: SparkSession, value: Any, *, size: int = 0, what: str = "the value"):
    """Makes ``value`` available to the tasks as ``.value``: a broadcast (classic), or in the closure (Connect).

    Under Connect the closure travels in the job's plan through one gRPC message:
    ``size`` (the value's bytes) is checked against the limit first, and a value too
    large fails here, on the driver, naming the setting to raise.
    """
    if not is_connect(spark):
        return spark.sparkContext.broadcast(value)
    check_message_size(spark, size, what)
    return InClosure(value)


def check_message_size(spark: SparkSession, size: int, what: str) -> None:
    """Under Connect: fails when ``size`` bytes cannot go to the server in one plan (gRPC message limit)."""
    server_limit = int(spark.conf.get(MAX_MESSAGE_SETTING, None) or _DEFAULT_MAX_MESSAGE)
    options = dict(getattr(getattr(spark.client, "_builder", None), "_channel_options", None) or ())
    client_limit = int(options.get("grpc.max_send_message_length", _DEFAULT_MAX_MESSAGE))
    limit = min(server_limit, client_limit)
    if size + _MESSAGE_HEADROOM > limit:
        raise ValueError(
            f"Spark Connect sends {what} to the server inside the job's plan, one gRPC message of at most {limit} "
            f"bytes; it is {size} bytes. Raise the server's {MAX_MESSAGE_SETTING} (now {server_limit}) and the "
            f"client channel's grpc.max_send_message_length (now {client_limit}) above {size + _MESSAGE_HEADROOM}, "
            "or use a classic SparkSession (which does not send it inside the plan)."
        )


class SparkFile:
    """Bytes the driver added with ``SparkContext.addFile``; reads like a Broadcast (``value``) inside a task."""

    def __init__(self, name: str):
        self.name = name

    @property
    def value(self) -> bytes:
        """Inside a task: the bytes, read from this executor's copy of the file."""
        from pyspark import SparkFiles

        with open(SparkFiles.get(self.name), "rb") as f:
            return f.read()


_ADDING_FILES = threading.Lock()  # one writer of a file and one addFile per name, among the driver's threads


def ship_file(spark: SparkSession, data: bytes, digest: str, *, suffix: str, what: str) -> SparkFile | InClosure:
    """``data`` for every task of this session: a ``SparkFile`` (classic), or ``InClosure`` under Connect.

    Classic: the bytes are written once to a file named by ``digest`` (their SHA-256) in the session's
    scratch directory (under ``spark.local.dir``) and added with ``SparkContext.addFile``. Each executor
    fetches it once, from the driver's file server, which streams it from disk: no JVM heap holds it
    (a broadcast would serialize all of it in the driver's heap). The file stays for the session's life
    (Spark cannot forget an added file), so a lazy DataFrame can be evaluated at any later time; on
    the driver's disk it takes twice its size (this file and Spark's copy), once on each executor.
    Under Connect the bytes go in the closure, checked against the message limit (``ship``).
    """
    if is_connect(spark):
        return ship(spark, data, size=len(data), what=what)
    context = spark.sparkContext
    name = f"sparkdl-{digest}{suffix}"
    with _ADDING_FILES:
        if not any(added.rsplit("/", 1)[-1] == name for added in context.listFiles):
            path = os.path.join(context._temp_dir, name)  # PySpark's own scratch directory, as its broadcasts use
            with open(path, "wb") as f:
                f.write(data)
            context.addFile(path)
    return SparkFile(name)
