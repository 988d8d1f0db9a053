"""The Spark session a job runs in: the one spark-submit set up, a Spark Connect one, or a local one.

Under spark-submit, Spark's settings (master, deploy mode, ``--conf``, ``--properties-file``) are
spark-submit's; the job only fills in what was left unset: Spark's logs at WARN (``spark.log.level``)
and no console progress bar. With plain python, the job's ``--master`` picks the master (default
``local[*]``) and conf/log4j2.properties keeps Spark's start-up at WARN too. ``--remote URL``,
``SPARK_REMOTE`` or ``spark-submit --remote`` make it a Spark Connect session, whose driver is the
Connect server's: the job then never touches a SparkContext.

Importing this module sets the environment, so the jobs import it before pyspark or keras:
TensorFlow as Keras's backend, TensorFlow's start-up lines off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import _jvm

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

QUIET_LOG4J = Path(__file__).resolve().parent.parent / "conf" / "log4j2.properties"
_startup: _jvm.StartupOptions | None = None  # the driver JVM's start-up options, when this job starts the JVM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every job takes to choose its Spark session and how much it prints."""
    spark = parser.add_argument_group("Spark")
    spark.add_argument(
        "--master",
        help="Spark master with plain python (default: local[*]). Under spark-submit, "
        "give spark-submit's own --master instead: the job refuses this flag there",
    )
    spark.add_argument(
        "--remote",
        metavar="URL",
        help="run over Spark Connect (sc://host:port); SPARK_REMOTE or spark-submit --remote do too",
    )
    spark.add_argument(
        "--verbose",
        action="store_true",
        help="Spark's and sparkdl's INFO logs, and the seconds each phase of the job takes",
    )


def under_spark_submit() -> bool:
    """spark-submit started a JVM, then this Python, telling it where that JVM's gateway listens."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def remote_url(args: argparse.Namespace) -> str | None:
    """The Spark Connect server to use: ``--remote``, else ``SPARK_REMOTE``, else spark-submit's ``--remote``."""
    if args.remote:
        return args.remote
    if os.environ.get("SPARK_REMOTE"):
        return os.environ["SPARK_REMOTE"]
    for i in range(int(os.environ.get("PYSPARK_REMOTE_INIT_CONF_LEN", "0"))):  # how spark-submit passes --remote
        url = json.loads(os.environ[f"PYSPARK_REMOTE_INIT_CONF_{i}"]).get("spark.remote")
        if url:
            return url
    return None


def check_arguments(args: argparse.Namespace) -> None:
    """Refuses Spark options that contradict how the job was started, before anything starts."""
    if args.master and under_spark_submit():
        raise ValueError(
            f"--master is for plain python; under spark-submit, spark-submit's own --master (before the "
            f"job's path) sets the master: spark-submit --master '{args.master}' jobs/... "
            f"Received: --master {args.master}"
        )
    if args.master and remote_url(args):
        raise ValueError(
            f"--master cannot be used over Spark Connect ({remote_url(args)}): the Connect server's "
            f"master is chosen where the server starts. Received: --master {args.master}"
        )


def classic_conf(args: argparse.Namespace):
    """The settings the session will start with: spark-submit's, or plain python's local defaults.

    Under spark-submit this reads them from the JVM spark-submit already started (no session starts).
    With plain python the job starts the JVM: quickly (``_jvm``), and at WARN from its first line.
    """
    global _startup
    from pyspark import SparkConf, SparkContext

    if under_spark_submit():
        SparkContext._ensure_initialized()  # connects to spark-submit's JVM, whose properties SparkConf() reads
        return SparkConf()
    conf = SparkConf().setMaster(args.master or "local[*]")
    _startup = _jvm.StartupOptions()
    options = [_startup.options]
    if not args.verbose and QUIET_LOG4J.exists():
        options.append(f"-Dlog4j2.configurationFile={QUIET_LOG4J}")
    conf.set("spark.driver.extraJavaOptions", " ".join(options))
    return conf


def is_local(master: str) -> bool:
    """``local[...]`` and ``local-cluster[...]``: every executor runs on this machine."""
    return master.startswith("local")


def spark_session(app_name: str, args: argparse.Namespace, conf=None):
    """The job's session: over Spark Connect when a server is given, else from ``conf`` (``classic_conf``)."""
    from pyspark.sql import SparkSession

    import sparkdl

    url = remote_url(args)
    if url:
        return SparkSession.builder.remote(url).getOrCreate()
    conf = conf if conf is not None else classic_conf(args)
    conf.setIfMissing("spark.app.name", app_name)
    conf.setIfMissing("spark.ui.showConsoleProgress", "false")  # the bar would interleave with the job's lines
    if args.verbose:
        conf.set("spark.log.level", "INFO")
    else:
        conf.setIfMissing("spark.log.level", "WARN")
    if is_local(conf.get("spark.master")):
        # Executors on this machine: this Python (which has sparkdl) serves them, and everything stays on loopback.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        conf.setIfMissing("spark.driver.host", "127.0.0.1")
        # Python workers forked with TensorFlow loaded (it is this Python's, which has sparkdl): one import, not one each.
        conf.setIfMissing("spark.python.daemon.module", sparkdl.WORKER_DAEMON)
    spark = SparkSession.builder.config(conf=conf).getOrCreate()
    if args.verbose:
        # spark.log.level=INFO is skipped where log4j's root level is INFO already, yet plain python's (PySpark's
        # shell's) filter still holds lines below WARN back; setting the level lifts it.
        spark.sparkContext.setLogLevel("INFO")
    return spark


def stop(spark) -> None:
    """Stops the session; a JVM this job started then exits (writing its class archive the first time)."""
    from pyspark import SparkContext

    spark.stop()
    if _startup is not None:
        _startup.finish(SparkContext)
