"""The Spark session a job runs in, and the environment its workers need.

Importing this module sets that environment, so the jobs import it before pyspark or keras:
TensorFlow as Keras's backend, and this Python (with sparkdl installed) for the Python workers
unless ``PYSPARK_PYTHON`` says otherwise.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def spark_session(app_name: str, master: str | None):
    """The session spark-submit configured, or a local one; local runs stay on loopback."""
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    master = master or SparkConf().get("spark.master", "local[*]")
    # No console progress bar: it would overwrite the lines the jobs print.
    builder = (SparkSession.builder.appName(app_name).master(master)
               .config("spark.ui.showConsoleProgress", "false"))
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.host", "127.0.0.1")
    return builder.getOrCreate()
