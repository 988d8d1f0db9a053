"""Assertions about which Spark jobs a block of test code started, in any thread."""

import contextlib
import uuid

_JOB_GROUP_PROPERTIES = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")


@contextlib.contextmanager
def no_spark_job(spark):
    """Asserts that the block started no Spark job at all, in this thread or another (fit checks in the background).

    Spark numbers jobs one after the other: a one-task marker job before and after the block
    brackets the ids of every job started in between, whatever its thread, group or tags.
    """
    before = newest_job_id(spark)
    yield
    started = newest_job_id(spark) - before - 1
    assert started == 0, f"{started} Spark job(s) ran in the block"


def newest_job_id(spark) -> int:
    """Runs a one-task marker job and returns its id, which is the newest (ids only grow)."""
    sc = spark.sparkContext
    group = f"sparkdl-test-marker-{uuid.uuid4()}"
    sc.setJobGroup(group, "marker: counts the jobs a test started")
    try:
        sc.parallelize([0], 1).count()
        (job,) = sc.statusTracker().getJobIdsForGroup(group)
    finally:
        for key in _JOB_GROUP_PROPERTIES:  # unset, not "": later jobs belong to no group again
            sc.setLocalProperty(key, None)
    return job
