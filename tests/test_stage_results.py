"""What the driver makes of a barrier stage's result rows when Spark ran some ranks again alone, after the others had
finished (Spark resubmits only the partitions whose output it lost; the race that leads there is
tests/test_large_results.py's): such a rank trains nothing, and the driver hands back the result of that rank's task
that met the others at the rendezvous, the attempt the others finished with; where that task uploaded none (an
upload of an earlier attempt trained something else), asking for its result raises ``ResultLost``. Real joins and
uploads over a real relay; the rows are those the tasks' Spark output would hold."""

import io
import secrets
import threading

import pyarrow as pa
import pytest

from sparkdl.launch import payloads, rendezvous, stage
from sparkdl.launch.errors import ResultLost
from sparkdl.launch.forward import TaskReporter, _Forwarder
from sparkdl.launch.relay import OutputRelay

SECRET = secrets.token_bytes(32)


def _rows(*rows):
    """The stage's result rows: (partition, attempt, size, chunk, payload) each."""
    return pa.Table.from_batches([stage._result_row(*row) for row in rows])


def _reporter(relay, rank):
    return TaskReporter(_Forwarder(relay.address, SECRET, rank, timeout=10.0, encrypt=False), rank)


def test_a_rank_run_again_alone_gets_back_what_its_task_that_met_the_others_uploaded_and_nothing_older():
    exchange, meeting = payloads.PayloadExchange(), rendezvous.Rendezvous(3)
    with OutputRelay("127.0.0.1", SECRET, 3, exchange=exchange, rendezvous=meeting, stdout=io.StringIO()) as relay:
        # an earlier attempt of the stage: ranks 1 and 2 trained and uploaded, and it failed
        for rank, task in ((1, 3), (2, 4)):
            reporter = _reporter(relay, rank)
            payloads.upload(reporter, f"rank {rank}, attempt {task}".encode(), task)
            reporter.connection.close()
        # the attempt the stage finished with: tasks 6, 7 and 8 meet; ranks 0 and 1 upload, rank 2 is lost first
        reporters = {rank: _reporter(relay, rank) for rank in range(3)}
        joins = [
            threading.Thread(target=rendezvous.join, args=(reporters[rank], rank, 6 + rank, f"r{rank} host", 10.0))
            for rank in range(3)
        ]
        for thread in joins:
            thread.start()
        for thread in joins:
            thread.join(30)
        for rank in (0, 1):
            payloads.upload(reporters[rank], f"rank {rank}, attempt {6 + rank}".encode(), 6 + rank)
        for reporter in reporters.values():
            reporter.connection.close()
        relay.wait_until_quiet(10.0)
    alone = stage._RERUN_ALONE
    results = stage._results(
        _rows((0, 6, 17, 0, None), (1, 10, alone, 0, None), (2, 11, alone, 0, None)), exchange, meeting
    )
    assert dict(results) == {0: b"rank 0, attempt 6", 1: b"rank 1, attempt 7"}
    with pytest.raises(ResultLost, match="Rank 2's result was lost: Spark ran rank 2 of the barrier stage again alone"):
        results[2]  # its task 8 uploaded nothing; task 4's upload trained another attempt
    with pytest.raises(KeyError):  # a rank that returned nothing, as from a dict
        results[3]


def test_through_spark_a_rank_run_again_alone_has_lost_its_result_with_its_executor():
    results = stage._results(_rows((0, 2, 3, 0, b"abc"), (1, 4, stage._RERUN_ALONE, 0, None)), None)
    assert dict(results) == {0: b"abc"}
    with pytest.raises(ResultLost, match="Rank 1's result was lost"):
        results[1]
