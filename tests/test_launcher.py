"""sparkdl.run: any function on N barrier tasks, its output live on the driver, its errors re-raised there."""

import io
import os
import socket
import sys
import threading
import time

import numpy as np
import pytest
from spark_jobs import no_spark_job

import sparkdl
from sparkdl import collective
from sparkdl.collective.horovod import Slot, slot_plan
from sparkdl.launch.errors import SlotsLost
from sparkdl.launch.relay import OutputRelay
from sparkdl.launch.relay_frames import HEADER, RELAY_ID, ErrorReport
from sparkdl.net.auth import ConnectGaveUp, connect_authenticated

pytestmark = pytest.mark.horovod  # the launcher runs on both stacks


def allreduce_scaled(scale, *, offset=0.0):
    from sparkdl import collective

    total = collective.allreduce(np.full(3, scale * (collective.rank() + 1) + offset))
    return {
        "rank": collective.rank(),
        "size": collective.size(),
        "total": total.tolist(),
        "gathered": collective.allgather(np.array([collective.rank()])).ravel().tolist(),
        "broadcast": collective.broadcast(np.array([collective.rank() + 7.0]), root=collective.size() - 1).tolist(),
    }


def test_run_returns_rank0_result_of_a_ring_collective(spark):
    result = sparkdl.run(allreduce_scaled, num_workers=2, args=(10.0,), kwargs={"offset": 0.5})
    assert result == {"rank": 0, "size": 2, "total": [31.0, 31.0, 31.0], "gathered": [0, 1], "broadcast": [8.0]}


def test_run_on_one_worker(spark):
    assert sparkdl.run(allreduce_scaled, num_workers=1, args=(2.0,))["total"] == [2.0, 2.0, 2.0]


class _WatchedStream(io.StringIO):
    """A driver-side stdout that signals when a given line arrives."""

    def __init__(self, wanted: str):
        super().__init__()
        self.wanted = wanted
        self.seen = threading.Event()

    def write(self, text):
        if self.wanted in text:
            self.seen.set()
        return super().write(text)


def print_then_wait_for_driver(flag_path):
    """Rank 0 prints, then waits for the driver to acknowledge having seen that line while the task still runs."""
    import subprocess

    from sparkdl import collective

    print(f"python print from rank {collective.rank()}")
    os.write(2, f"raw fd 2 from rank {collective.rank()}\n".encode())
    subprocess.run(["echo", f"subprocess of rank {collective.rank()}"], check=True)
    if collective.rank() == 0:
        print("waiting for the driver")
        deadline = time.monotonic() + 120
        while not os.path.exists(flag_path):
            if time.monotonic() > deadline:
                raise TimeoutError("the driver never saw rank 0's output while rank 0 was running")
            time.sleep(0.05)
    collective.barrier()
    print("no newline at the end", end="")
    return "done"


def test_worker_output_reaches_the_driver_live_with_rank_prefixes(spark, tmp_path, monkeypatch):
    flag = tmp_path / "driver-saw-it"
    stdout, stderr = _WatchedStream("[rank 0] waiting for the driver"), io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    watcher = threading.Thread(target=lambda: stdout.seen.wait(180) and flag.touch(), daemon=True)
    watcher.start()

    assert sparkdl.run(print_then_wait_for_driver, num_workers=2, args=(str(flag),)) == "done"

    out, err = stdout.getvalue().splitlines(), stderr.getvalue().splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] python print from rank {rank}" in out
        assert f"[rank {rank}] subprocess of rank {rank}" in out
        assert f"[rank {rank}] raw fd 2 from rank {rank}" in err
        assert f"[rank {rank}] no newline at the end" in out
    assert stdout.seen.is_set()


class CustomFailure(Exception):
    pass


def fail_on_rank_1(kind):
    from sparkdl import collective

    if collective.rank() == 1:

        def inner():
            raise (ValueError if kind == "value" else CustomFailure)(f"bad thing on rank {collective.rank()}")

        inner()
    collective.barrier()  # rank 0 waits here for a rank that never comes: the job must not wait with it
    return "unreachable"


def test_a_raising_rank_is_reraised_on_the_driver_with_its_traceback(spark):
    """(That the job is cancelled at once, not left to retries and timeouts, is counted in test_sync_failures.py.)"""
    with pytest.raises(ValueError) as caught:
        sparkdl.run(fail_on_rank_1, num_workers=2, args=("value",), timeout=300)
    error = caught.value
    assert isinstance(error, sparkdl.WorkerError)
    assert error.rank == 1 and error.type_name == "ValueError"
    assert str(error).startswith("rank 1 raised ValueError: bad thing on rank 1")
    assert "in inner" in error.remote_traceback and "in fail_on_rank_1" in error.remote_traceback
    assert "Remote traceback (rank 1)" in str(error)


def test_a_non_builtin_exception_becomes_a_worker_error_naming_its_type(spark):
    with pytest.raises(sparkdl.WorkerError, match=r"rank 1 raised test_launcher.CustomFailure: bad thing") as caught:
        sparkdl.run(fail_on_rank_1, num_workers=2, args=("custom",), timeout=300)
    assert not isinstance(caught.value, ValueError)


def test_the_next_run_after_a_failure_works(spark):
    with pytest.raises(sparkdl.WorkerError, match=r"^rank 1 raised ValueError: bad thing on rank 1"):
        sparkdl.run(fail_on_rank_1, num_workers=2, args=("value",), timeout=300)
    assert sparkdl.run(allreduce_scaled, num_workers=2, args=(1.0,))["total"] == [3.0, 3.0, 3.0]


def test_collective_functions_outside_a_run_say_where_they_work():
    with pytest.raises(RuntimeError, match=r"inside a function run by sparkdl.run"):
        collective.rank()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"train_fn": 3}, r"Expected `train_fn` to be a function. Received: int"),
        ({"num_workers": 0}, r"Expected `num_workers` to be a positive integer. Received: num_workers=0"),
        ({"num_workers": 3}, r"num_workers=3, but the cluster runs 2 tasks at once"),
        ({"backend": "mpi"}, r"Expected `backend` to be one of \['sparkdl', 'horovod'\]. Received: backend='mpi'"),
        ({"backend": "ring"}, r"Expected backend='sparkdl' for sparkdl's communicator, whose ring is one of"),
        ({"timeout": -1}, r"Expected `timeout` to be a positive number of seconds"),
        ({"args": "abc"}, r"Expected `args` to be a tuple"),
    ],
)
def test_bad_settings_fail_on_the_driver_before_any_job(spark, kwargs, message):
    settings = {"train_fn": allreduce_scaled, "num_workers": 2, "args": (1.0,), **kwargs}
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        sparkdl.run(settings.pop("train_fn"), **settings)


@pytest.mark.skipif(
    sys.modules.get("horovod") is not None or __import__("importlib").util.find_spec("horovod"),
    reason="Horovod is installed here",
)
def test_horovod_backend_without_horovod_says_how_to_get_it(spark, digits_df):
    from models import make_mlp

    with no_spark_job(spark), pytest.raises(ValueError, match=r"needs Horovod.*conf/horovod/install.sh"):
        sparkdl.run(allreduce_scaled, num_workers=2, args=(1.0,), backend="horovod")
    with no_spark_job(spark), pytest.raises(ValueError, match=r"needs Horovod"):
        sparkdl.fit(digits_df, make_mlp(), backend="horovod")


def test_backend_is_a_sync_mode_setting(spark, digits_df):
    from models import make_mlp

    with no_spark_job(spark), pytest.raises(ValueError, match=r"`backend` applies to mode='sync' only"):
        sparkdl.fit(digits_df, make_mlp(), mode="async", backend="horovod")


# The relay on its own, with real sockets: what a stranger or a broken client gets.


def _relay(secret=b"s" * 32):
    out, err = io.StringIO(), io.StringIO()
    return OutputRelay("127.0.0.1", secret, num_workers=2, stdout=out, stderr=err), out, err


def test_relay_prints_lines_from_an_authenticated_rank():
    relay, out, _ = _relay()
    with relay:
        sock = connect_authenticated(relay.address, 1, RELAY_ID, b"s" * 32, timeout=10)
        for chunk in (b"hel", b"lo\nwor", b"ld\n", b"tail"):
            sock.sendall(HEADER.pack(1, len(chunk)) + chunk)
        sock.close()
        relay.wait_until_quiet(10)
    assert out.getvalue() == "[rank 1] hello\n[rank 1] world\n[rank 1] tail\n"


def test_relay_refuses_a_wrong_secret_and_a_malformed_frame():
    relay, out, _ = _relay()
    with relay:
        with pytest.raises(ConnectGaveUp, match="authentication|handshake|closed|reset"):
            connect_authenticated(relay.address, 0, RELAY_ID, b"x" * 32, timeout=2)
        sock = connect_authenticated(relay.address, 0, RELAY_ID, b"s" * 32, timeout=10)
        sock.sendall(HEADER.pack(9, 2**31) + b"junk")  # unknown kind, absurd length: dropped, nothing allocated
        sock.settimeout(10)
        try:
            assert sock.recv(1) == b""  # the relay closed the connection...
        except ConnectionResetError:
            pass  # ...with our unread junk still in its buffer
        sock.close()
        host, port = relay.address.rsplit(":", 1)
        garbage = socket.create_connection((host, int(port)))
        garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" * 10)
        garbage.close()
        relay.wait_until_quiet(40)
        assert relay.first_error() is None
    assert out.getvalue() == ""


def test_a_lost_slot_error_names_the_host_its_ranks_and_what_the_ranks_waited_for():
    """SlotsLost quotes each rank's error in a line: the sparkdl error TensorFlow wrapped in its own, once each."""
    wrapped = ErrorReport(
        0,
        "tensorflow.python.framework.errors_impl.UnknownError",
        "Graph execution error:\n\nDetected at node sparkdl_push\nCollectiveTimeout: worker 0: shard 0 waited for "
        "worker(s) [2]\n\t [[{{node sparkdl_push}}]]",
        "",
    )
    plain = ErrorReport(1, "sparkdl.net.errors.CollectiveTimeout", "rank 1: allreduce timed out\nmore", "")
    lost = SlotsLost(3, 2, 30.4, ["10.0.0.7"], [2]).seen_by([wrapped, plain, wrapped])
    message = str(lost)
    assert "since an executor was lost on 10.0.0.7 (rank 2 ran there), for 30s (timeout)" in message
    assert message.endswith(
        "Meanwhile, on the ranks:\n  rank 0: CollectiveTimeout: worker 0: shard 0 waited for worker(s) [2]\n"
        "  rank 1: CollectiveTimeout: rank 1: allreduce timed out"
    ), message
    assert (lost.hosts, lost.ranks, lost.available) == (["10.0.0.7"], [2], 2)


# Horovod's view of the ranks (pure logic; the Horovod tests run it for real).


def test_slot_plan_for_ranks_spread_over_hosts_in_partition_order():
    plan = slot_plan(["a", "b", "a", "c", "b", "a"])
    assert [(s.rank, s.hostname, s.local_rank, s.local_size) for s in plan] == [
        (0, "a", 0, 3),
        (1, "b", 0, 2),
        (2, "a", 1, 3),
        (3, "c", 0, 1),
        (4, "b", 1, 2),
        (5, "a", 2, 3),
    ]
    # cross rank: the host's index among the hosts that have a rank at this local rank
    assert [(s.cross_rank, s.cross_size) for s in plan] == [(0, 3), (1, 3), (0, 2), (2, 3), (1, 2), (0, 1)]
    assert all(s.size == 6 for s in plan)


def test_slot_plan_on_one_host_and_its_environment():
    assert slot_plan(["127.0.0.1"] * 2)[1] == Slot("127.0.0.1", 1, 1, 0, 2, 2, 1)
    assert slot_plan(["h"])[0].environment() == {
        "HOROVOD_HOSTNAME": "h",
        "HOROVOD_RANK": "0",
        "HOROVOD_SIZE": "1",
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
    }
