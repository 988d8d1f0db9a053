"""Run by tests/test_gpu.py in its own process: sparkdl.run on a local-cluster with Spark's GPU scheduling.

    python tests/gpu_job.py DISCOVERY_SCRIPT

The standalone worker takes its GPUs from DISCOVERY_SCRIPT (a fake one in the
test) and hands each executor its share; the scheduler then gives each task
one GPU address. Prints one JSON line: for every rank, the addresses Spark
assigned it and the CUDA_VISIBLE_DEVICES its function saw.
"""

import json
import sys


def report():
    """Inside each barrier task: this rank's Spark GPU addresses and CUDA_VISIBLE_DEVICES, gathered by rank."""
    import os

    import numpy as np
    from pyspark import TaskContext

    from sparkdl import collective

    def encode(text, width=16):  # fixed-length int codes: allgather needs equal shapes on every rank
        codes = [ord(c) for c in text][:width]
        return np.array(codes + [0] * (width - len(codes)), dtype=np.int32)

    addresses = ",".join(TaskContext.get().resources()["gpu"].addresses)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    gathered = collective.allgather(np.stack([encode(addresses), encode(visible)]))
    decode = lambda row: "".join(chr(c) for c in row if c)  # noqa: E731
    return [
        {"rank": r, "spark_gpus": decode(g[0]), "cuda_visible_devices": decode(g[1])} for r, g in enumerate(gathered)
    ]


def main(argv):
    from pyspark.sql import SparkSession

    import sparkdl

    script = argv[0]
    spark = (
        SparkSession.builder.master("local-cluster[1,2,1024]")  # one worker, one executor with 2 cores
        .appName("sparkdl-gpu-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # Standalone: the worker discovers the machine's GPUs and hands the executor its addresses
        # (a resources file), so the executor's own discovery script is not run; YARN and
        # Kubernetes executors need it.
        .config("spark.worker.resource.gpu.amount", "2")
        .config("spark.worker.resource.gpu.discoveryScript", script)
        .config("spark.executor.resource.gpu.amount", "2")
        .config("spark.executor.resource.gpu.discoveryScript", script)
        .config("spark.task.resource.gpu.amount", "1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        ranks = sparkdl.run(report, num_workers=2, timeout=60)
    finally:
        spark.stop()
    print("GPU-REPORT " + json.dumps(ranks), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
