"""Assertions about which Spark jobs a block of test code started."""

import contextlib
import uuid


@contextlib.contextmanager
def no_spark_job(spark):
    """Asserts that the block started no Spark job at all."""
    group = f"sparkdl-test-{uuid.uuid4()}"
    spark.sparkContext.setJobGroup(group, "bad input")
    try:
        yield
    finally:
        jobs = spark.sparkContext.statusTracker().getJobIdsForGroup(group)
        spark.sparkContext.setJobGroup("", "")
        assert not jobs, f"a Spark job ran before the error: {jobs}"
