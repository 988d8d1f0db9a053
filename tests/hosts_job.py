"""tests/test_hosts.py's child: a Spark cluster of three emulated hosts (``benchmarks/hostnet``), fits on it and faults
struck into them, everything it saw written as JSON to ``argv[1]``.

It runs as a process of its own because it needs a SparkSession of its own (on the cluster's master), and as root
(network namespaces). The fits: sync on six workers (two per host), the reference; async with three server shards
on the executors; then the sync fit again, once per fault, with the fault struck at host 1 in the middle of its
training, saving a step checkpoint every 10 steps: its link down for 5 s, its executor JVM killed, the host cut off
for good; then, with the host back, cut off again under a fit that may go on with the four workers left
(``min_workers=4``; last: the cluster is one host short after it).
"""

import json
import os
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(HERE), "benchmarks"), HERE]

from frames import digits_frame
from hostnet import faults
from hostnet.network import Network
from hostnet.spark_cluster import LOST_AFTER, SparkCluster
from hostnet.trials import run_trial
from workloads import WORKLOADS

import sparkdl

HOSTS, CORES = 3, 2
WORKERS = HOSTS * CORES  # every slot: two ranks on each host
FAULTED_HOST = 1
#: The sync fit every fault strikes half a second after its first epoch line: about 2 s of training on this machine
#: (8 epochs of 30 steps), so that the fault strikes in the middle of a step, not once training is over.
FIT = dict(mode="sync", num_workers=WORKERS, epochs=8, batch_size=8, seed=0, progress=False, timeout=20)
CHECKPOINT_EVERY = 10  # steps: a third of an epoch, so that a retried stage resumes mid-epoch
#: Each fault with the fit's timeout under it and the fit's other settings: above the link's 5 s down; the same for
#: a killed executor, whose replacement (a JVM, a Python daemon importing TensorFlow) takes longer than that to join
#: the retried stage on a busy machine, but the ranks there wait from its start (``launch.rendezvous``); short for the
#: host lost for good, whose fit should fail soon after it, or go on with the four workers of the two hosts left.
FAULTS = (
    (faults.link_down(5), 20, {}),
    (faults.kill_executor(), 20, {}),
    (faults.partition(), 10, {}),
    (faults.partition(), 10, {"min_workers": WORKERS - CORES}),
)


def hang_after(timeout: float, clean_seconds: float, goes_on: bool) -> float:
    """Seconds after which a fit of ``timeout`` counts as hung: its timeout twice (the attempt that meets the fault,
    a retried one), Spark's detection of a lost executor, a margin for the fit's start and training before the fault
    (tests/test_hosts.py asks a failing fit to end within the first three after the fault); for a fit that may go
    on with fewer workers, twice the clean fit's ``clean_seconds`` more: its stage started again and the epochs left
    trained on fewer workers (CI's machine took more than 47 s for those after the fault)."""
    return 2 * timeout + LOST_AFTER + 20 + (2 * clean_seconds if goes_on else 0)


def task_addresses(spark, driver: str) -> list[list]:
    """[SPARK_LOCAL_IP, the address its packets to the driver leave from] of each of WORKERS tasks at once."""

    def where(_):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((driver, 9))  # no packet sent: only the route is chosen
            yield [os.environ.get("SPARK_LOCAL_IP"), probe.getsockname()[0]]

    return spark.sparkContext.parallelize(range(WORKERS), WORKERS).barrier().mapPartitions(where).collect()


def main(out_path: str) -> None:
    report: dict = {}
    started = time.monotonic()
    workload = WORKLOADS["digits"]
    with Network(HOSTS, root_port=True) as network, SparkCluster(network, cores=CORES) as cluster:
        spark = cluster.session(**{"spark.ui.showConsoleProgress": "false"})
        report.update(
            hosts=network.addresses,
            driver=network.root_address,
            faulted=network.addresses[FAULTED_HOST],
            executors=cluster.executor_hosts(),
            tasks=task_addresses(spark, network.root_address),
            started_in=time.monotonic() - started,
            epochs=FIT["epochs"],
        )
        x, y = workload.arrays()
        frame = digits_frame(spark, x, y).cache()
        frame.count()

        clock = time.monotonic()
        clean = sparkdl.fit(frame, workload.model(), **dict(FIT, timeout=600))  # the first: Python workers start
        weights = clean.model.get_weights()
        report["sync"] = dict(
            seconds=time.monotonic() - clock,
            steps=clean.steps_per_epoch * FIT["epochs"],
            gradient_bytes=sum(w.numpy().nbytes for w in clean.model.trainable_weights),
            wire_bytes=clean.stats["wire_bytes"],
        )
        clock = time.monotonic()
        spread = sparkdl.fit(
            frame,
            workload.model(),
            mode="async",
            num_workers=HOSTS,
            num_servers=HOSTS,
            server_placement="executors",
            epochs=1,
            batch_size=16,
            seed=0,
            progress=False,
            timeout=60,
        )
        report["async"] = dict(seconds=time.monotonic() - clock, servers=spread.stats["servers"])
        print(f"hosts_job: cluster, sync and async fits in {time.monotonic() - started:.0f} s", flush=True)

        report["faults"] = []
        for number, (fault, timeout, extra) in enumerate(FAULTS):
            checkpoints = tempfile.mkdtemp(prefix="checkpoints-", dir=cluster.scratch)
            settings = dict(
                FIT, timeout=timeout, checkpoint_dir=checkpoints, checkpoint_every=CHECKPOINT_EVERY, **extra
            )
            outcome = run_trial(
                cluster,
                fault,
                lambda settings=settings: sparkdl.fit(frame, workload.model(), **settings),
                host=FAULTED_HOST,
                reference=None if "min_workers" in extra else weights,  # fewer workers train other batches
                checkpoint_dirs=[checkpoints],
                hang_after=hang_after(timeout, report["sync"]["seconds"], goes_on="min_workers" in extra),
            )
            went_on = None if outcome.result is None else _went_on(outcome.result)
            seen = dict(outcome.to_json(), timeout=timeout, settings=extra, went_on=went_on)
            report["faults"].append(seen)
            print(f"hosts_job: {fault.name} {extra}: {outcome.summary} in {outcome.seconds:.0f} s", flush=True)
            with open(out_path, "w") as out:  # what was seen so far, should a later fault hang the job
                json.dump(report, out)
            if number == len(FAULTS) - 1:
                break
            if fault.for_good:
                cluster.network.link(FAULTED_HOST, up=True)  # the host comes back, for the next fault
            clock = time.monotonic()
            cluster.wait_for_executors(HOSTS, timeout=240)  # a killed executor's replacement, a host's return
            seen["executors_back_after"] = time.monotonic() - clock
        report["total_seconds"] = time.monotonic() - started
    with open(out_path, "w") as out:
        json.dump(report, out)


def _went_on(result) -> dict:
    """What a completed fit's result says of the workers it ended with."""
    return {"num_workers": result.num_workers, "workers_lost": result.stats.get("workers_lost")}


if __name__ == "__main__":
    main(sys.argv[1])
