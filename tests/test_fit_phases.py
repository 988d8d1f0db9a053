"""Where a fit's time goes (``FitResult.phases``), and the barrier stage's rendezvous through the driver's relay."""

import threading
import time

import pytest
from models import make_mlp

import sparkdl
from sparkdl.launch import rendezvous, session, stage
from sparkdl.launch.forward import TaskReporter, _Forwarder
from sparkdl.launch.phases import Phases
from sparkdl.launch.relay import OutputRelay

SECRET = b"r" * 32
SYNC_PHASES = [
    "settings",
    "slots",
    "serialize",
    "probe",
    "launch",
    "import",
    "read",
    "connect",
    "model in",
    "train",
    "model out",
    "result",
]


def test_a_task_s_phases_are_placed_on_the_driver_s_timeline_after_the_launch():
    driver = Phases()
    driver.end("checks")
    task = Phases()
    task.end("read")
    task.end("train")
    driver.watch(1, task.event())  # only rank 0 speaks for the fit
    driver.watch(0, task.event())
    driver.end("result")
    assert list(driver.seconds()) == ["checks", "launch", "read", "train", "result"]
    assert all(seconds >= 0 for seconds in driver.seconds().values())
    assert driver.seconds()["read"] == task.seconds()["read"]  # durations travel, not clock readings
    assert list(Phases().event()["phases"]) == ["task"]  # a task that names no phase is one phase


def test_a_sync_fit_says_where_its_time_went_phase_by_phase(digits_df):
    result = sparkdl.fit(digits_df, make_mlp(), num_workers=2, epochs=1, batch_size=64, seed=0, progress=False)
    assert list(result.phases) == SYNC_PHASES  # rank 0's own phases came from its task, between launch and result
    assert all(isinstance(seconds, float) and seconds >= 0 for seconds in result.phases.values())
    assert result.phases["train"] > 0


def test_a_mode_whose_tasks_name_no_phase_reports_them_as_one(digits_df):
    result = sparkdl.fit(digits_df, make_mlp(), num_workers=2, mode="async", epochs=1, batch_size=64, progress=False)
    assert list(result.phases)[-3:] == ["launch", "task", "result"]


def _join_in_thread(relay, rank: int, task: int, record: str, answers: dict) -> tuple[threading.Thread, TaskReporter]:
    reporter = TaskReporter(_Forwarder(relay.address, SECRET, rank, timeout=30.0, encrypt=False), rank)

    def join():
        try:
            answers[task] = rendezvous.join(reporter, rank, task, record, 30.0)
        except OSError as exc:  # its connection was closed under it (a killed task)
            answers[task] = exc

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread, reporter


def test_every_rank_gets_every_record_once_all_joined():
    answers: dict = {}
    with OutputRelay("127.0.0.1", SECRET, 3, rendezvous=rendezvous.Rendezvous(3)) as relay:
        joins = [_join_in_thread(relay, rank, 10 + rank, f"address-{rank} host", answers) for rank in (2, 0, 1)]
        for thread, reporter in joins:
            thread.join(30)
            reporter.connection.close()
    assert answers == {task: ["address-0 host", "address-1 host", "address-2 host"] for task in (10, 11, 12)}


def test_a_retried_stage_meets_without_the_tasks_of_the_failed_attempt():
    """Rank 0 of the first attempt joins and is killed (its connection closes) before rank 1 comes: the new
    attempt's tasks meet among themselves; a late join of a task older than its rank's newest is refused."""
    answers: dict = {}
    with OutputRelay("127.0.0.1", SECRET, 2, rendezvous=rendezvous.Rendezvous(2)) as relay:
        stale, stale_reporter = _join_in_thread(relay, 0, 5, "stale-address host", answers)
        stale_reporter.connection.close()  # Spark killed it: the relay drops its record
        stale.join(30)
        relay.wait_until_quiet(10)
        joins = [_join_in_thread(relay, rank, task, f"new-{rank} host", answers) for rank, task in ((1, 8), (0, 7))]
        for thread, reporter in joins:
            thread.join(30)
            reporter.connection.close()
        late = TaskReporter(_Forwarder(relay.address, SECRET, 0, timeout=5.0, encrypt=False), 0)
        with pytest.raises((ConnectionError, TimeoutError)):
            rendezvous.join(late, 0, 6, "late host", 5.0)  # older than rank 0's task 7: its connection is dropped
        late.connection.close()
    assert answers[7] == answers[8] == ["new-0 host", "new-1 host"]
    assert isinstance(answers[5], OSError)  # the killed task never got an answer


def test_a_rank_that_starts_late_renews_the_wait_of_the_ranks_at_the_rendezvous():
    """A retried stage's rank on a replacement executor starts after the others wait (its Python worker and
    TensorFlow to start): rank 0 waits 4 s at most, rank 1's task connects 1.5 s in and joins 3 s after that, when
    4 s from rank 0's arrival have passed: its start renewed rank 0's wait, and both meet."""
    answers: dict = {}
    with OutputRelay("127.0.0.1", SECRET, 2, rendezvous=rendezvous.Rendezvous(2)) as relay:
        first = TaskReporter(_Forwarder(relay.address, SECRET, 0, timeout=4.0, encrypt=False), 0)
        waiting = threading.Thread(target=lambda: answers.update({0: _joined_or_error(first, 0, 4.0)}), daemon=True)
        clock = time.monotonic()
        waiting.start()
        time.sleep(1.5)
        late = TaskReporter(_Forwarder(relay.address, SECRET, 1, timeout=4.0, encrypt=False), 1)
        time.sleep(max(0.0, 4.5 - (time.monotonic() - clock)))
        answers[1] = _joined_or_error(late, 1, 4.0)
        waiting.join(30)
        for reporter in (first, late):
            reporter.connection.close()
    assert answers == {0: ["r0 host", "r1 host"], 1: ["r0 host", "r1 host"]}


@pytest.mark.parametrize("started", [False, True])
def test_a_rank_waiting_in_vain_names_the_ranks_that_never_started_or_never_joined(started):
    with OutputRelay("127.0.0.1", SECRET, 3, rendezvous=rendezvous.Rendezvous(3)) as relay:
        reporters = [TaskReporter(_Forwarder(relay.address, SECRET, 0, timeout=1.0, encrypt=False), 0)]
        if started:
            reporters.append(TaskReporter(_Forwarder(relay.address, SECRET, 2, timeout=1.0, encrypt=False), 2))
        error = _joined_or_error(reporters[0], 0, 1.0)
        for reporter in reporters:
            reporter.connection.close()
    assert isinstance(error, TimeoutError), error
    message = str(error)
    assert message.startswith("rank 0: not every rank of the stage reached the rendezvous within timeout=1.0 seconds")
    if started:
        assert "rank(s) 1 never started" in message and "rank(s) 2 started but had not joined" in message
    else:
        assert "rank(s) 1, 2 never started" in message and "had not joined" not in message


def test_the_ranks_at_the_rendezvous_wait_for_a_rank_whose_python_starts():
    """Rank 0 waits 1 s at most; rank 1's task connects 3 s in. The driver's stage watch tells rank 0 every 0.3 s
    that rank 1 is starting (a barrier stage's tasks are launched together), which renews its wait: both meet.
    Nothing is told while no rank waits, nor once rank 1 has connected."""
    answers: dict = {}
    meeting = rendezvous.Rendezvous(2)
    with OutputRelay("127.0.0.1", SECRET, 2, rendezvous=meeting) as relay:
        assert not meeting.tell_starting()  # nobody waits
        first = TaskReporter(_Forwarder(relay.address, SECRET, 0, timeout=1.0, encrypt=False), 0)
        waiting = threading.Thread(target=lambda: answers.update({0: _joined_or_error(first, 0, 1.0)}), daemon=True)
        waiting.start()
        told = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            told.append(meeting.tell_starting())
            time.sleep(0.3)
        late = TaskReporter(_Forwarder(relay.address, SECRET, 1, timeout=1.0, encrypt=False), 1)
        time.sleep(0.2)  # its connection reaches the relay
        connected_told = meeting.tell_starting()
        answers[1] = _joined_or_error(late, 1, 1.0)
        waiting.join(30)
        for reporter in (first, late):
            reporter.connection.close()
    assert answers == {0: ["r0 host", "r1 host"], 1: ["r0 host", "r1 host"]}
    assert told[-1] and not connected_told


def test_a_retried_stage_s_late_rank_is_waited_for_again(spark, monkeypatch):
    """The driver's stage watch waits for ranks starting late once an attempt (STARTUP_SECONDS, here 3 s): the first
    attempt's rank 1 never starts, and its rank 0 gives up naming it. Spark's next attempt starts its own Python, so
    its rank 1, connecting 2 s after rank 0 waits (1 s at most), is waited for again: they meet."""
    monkeypatch.setattr(rendezvous, "STARTUP_SECONDS", 3.0)
    meeting = rendezvous.Rendezvous(2)
    with (
        OutputRelay("127.0.0.1", SECRET, 2, rendezvous=meeting) as relay,
        stage.StageWatch(spark, 1, 1.0, session.JobTag(spark), meeting),
    ):
        first = TaskReporter(_Forwarder(relay.address, SECRET, 0, timeout=1.0, encrypt=False), 0)
        error = _joined_or_error(first, 0, 1.0)
        first.connection.close()  # the attempt failed: Spark kills its tasks
        assert isinstance(error, TimeoutError), error
        assert "rank(s) 1 were launched by Spark, but their Python had not started within 3.0 s" in str(error)
        answers: dict = {}
        again = TaskReporter(_Forwarder(relay.address, SECRET, 0, timeout=1.0, encrypt=False), 0)
        waiting = threading.Thread(target=lambda: answers.update({0: _joined_or_error(again, 0, 1.0, 20)}))
        waiting.start()
        time.sleep(2.0)
        late = TaskReporter(_Forwarder(relay.address, SECRET, 1, timeout=1.0, encrypt=False), 1)
        answers[1] = _joined_or_error(late, 1, 1.0, 21)
        waiting.join(30)
        for reporter in (again, late):
            reporter.connection.close()
    assert answers == {0: ["r0 host", "r1 host"], 1: ["r0 host", "r1 host"]}


class _LateOnRank1:
    """Unpickled with a task's function: in partition 1's task it takes ``seconds`` first, as a new executor's Python
    worker does while it starts and imports TensorFlow, before the task can connect to the driver."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __setstate__(self, state):
        self.__dict__.update(state)
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None and context.partitionId() == 1:
            time.sleep(self.seconds)


def _met(late: _LateOnRank1) -> str:
    return f"met after rank 1's {late.seconds} s start"


def test_a_rank_whose_python_starts_after_the_timeout_meets_the_others(spark):
    """A barrier stage's rank 1 starts 6 s late, its job's network waits take 2 s: Spark launched its task with
    theirs, so the others wait for it (they gave up after 2 s, "rank(s) 1 never started", as fits did on a new
    executor)."""
    assert sparkdl.run(_met, args=(_LateOnRank1(6.0),), num_workers=2, spark=spark, timeout=2) == (
        "met after rank 1's 6.0 s start"
    )


def test_a_rank_whose_python_never_starts_is_waited_for_a_bounded_time_and_named(spark, monkeypatch):
    """The same late rank with the longest start waited for cut from 300 s to 1 s (on the driver): the others give
    up after that and their timeout, naming rank 1 as launched by Spark with its Python not started."""
    monkeypatch.setattr(rendezvous, "STARTUP_SECONDS", 1.0)
    started = time.monotonic()
    with pytest.raises(sparkdl.WorkerError) as failed:
        sparkdl.run(_met, args=(_LateOnRank1(15.0),), num_workers=2, spark=spark, timeout=2)
    message = str(failed.value)
    assert "rank 0: not every rank of the stage reached the rendezvous within timeout=2 seconds" in message, message
    assert "rank(s) 1 were launched by Spark, but their Python had not started within 1.0 s" in message, message
    assert time.monotonic() - started < 15.0  # before rank 1 started at all


def _joined_or_error(reporter: TaskReporter, rank: int, timeout: float, task: int | None = None):
    try:
        return rendezvous.join(reporter, rank, 10 + rank if task is None else task, f"r{rank} host", timeout)
    except (OSError, TimeoutError) as exc:
        return exc
