"""sparkdl's communicator when ranks fail: a rank that dies or calls another operation fails every other rank fast
(ABORT frames), naming the operation and the rank where it started; silent and closed peers; separate processes.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from collective_ranks import run_ranks

from sparkdl.collective import CollectiveError, CollectiveTimeout, Listener, SparkdlCommunicator
from sparkdl.collective.api import OP_CODES
from sparkdl.net.frames import Header, Kind, dtype_code

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mismatched_dtypes_are_out_of_step_naming_both():
    def body(comm):
        x = np.zeros(10, dtype=np.float32 if comm.rank == 0 else np.float64)
        with pytest.raises(CollectiveError) as info:
            comm.allreduce(x, algorithm="ring")
        return str(info.value)

    messages = run_ranks(2, body, timeout=5.0)
    assert any("out of step" in m and "float32" in m and "float64" in m for m in messages), messages


#: A communicator timeout no test outlives: a wait that ends was ended by the failure it detected, not by the clock.
FOREVER = 3600.0


@pytest.mark.parametrize("other", ["broadcast", "allgather", "allreduce of another size"])
def test_a_rank_calling_another_operation_fails_every_rank_fast(other):
    """Rank 3 of 4 calls another collective over the same (ring) links: every rank, its ring neighbours and rank 1
    alike, fails without waiting for its timeout (an hour), its message naming the allreduce and rank 3, where it
    started.

    (An operation whose frames would travel links the others never open, such as a tree barrier facing a ring
    allreduce, ends in the timeout instead: no frame ever meets the wrong receiver.)"""

    def body(comm):
        with pytest.raises(CollectiveError) as info:
            if comm.rank == 3 and other == "broadcast":
                comm.broadcast(np.zeros(1000), algorithm="ring")
            elif comm.rank == 3 and other == "allgather":
                comm.allgather(np.zeros(1000), algorithm="ring")
            else:
                comm.allreduce(np.zeros(1000 if comm.rank < 3 else 1001), algorithm="ring")
        return info.value

    errors = run_ranks(4, body, timeout=FOREVER)
    # Some rank found the mismatch; the others may instead see their link to it closed (a send that broke first).
    assert any("out of step" in str(error) for error in errors), errors
    for rank, error in enumerate(errors):
        message = str(error)
        assert not isinstance(error, CollectiveTimeout) and "timed out" not in message, (rank, message)
        assert message.startswith(f"rank {rank}:"), message
        assert "allreduce" in message and "rank 3" in message, (rank, message)


WORKER = r"""
import json, os, signal, sys, threading, time
import numpy as np
from sparkdl.collective import Listener, SparkdlCommunicator
listener = Listener("127.0.0.1")
print(listener.address, flush=True)
job = json.loads(sys.stdin.readline())
rank, size = job["rank"], len(job["addresses"])
comm = SparkdlCommunicator.connect(
    rank, job["addresses"], listener, bytes.fromhex(job["secret"]), timeout=job["timeout"], shared_memory=False
)
if job["mode"] != "run":
    from sparkdl.collective.transport import transfer
    inside, recv = threading.Event(), transfer.Transfer.recv

    def stuck_recv(self, peer, out):  # the first segment arrives; then this rank stays inside the allreduce
        recv(self, peer, out)
        inside.set()
        time.sleep(60)

    transfer.Transfer.recv = stuck_recv
    threading.Thread(target=comm.allreduce, args=(np.ones(1_000_000, np.float32),), kwargs={"algorithm": "ring"}, daemon=True).start()
    inside.wait(30)
    print("in allreduce", flush=True)
    time.sleep(0.3)
    if job["mode"] == "exit":
        os._exit(1)
    time.sleep(60)  # until the test kills this process
x = np.arange(50_000, dtype=np.float64) * (rank + 1)
np.save(job["out"], np.stack([comm.allreduce(x), comm.allgather(x)[size - 1], comm.broadcast(x, root=1)]))
comm.barrier()
comm.close()
"""


def start_workers(ranks):
    """One subprocess per rank; (processes, their listener addresses), by rank."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {
        rank: subprocess.Popen(
            [sys.executable, "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO_ROOT,
        )
        for rank in ranks
    }
    return procs, {rank: proc.stdout.readline().strip() for rank, proc in procs.items()}


def send_job(proc, rank, addresses, secret, mode, tmp_path, timeout=10.0):
    job = {
        "rank": rank,
        "addresses": addresses,
        "secret": secret.hex(),
        "mode": mode,
        "timeout": timeout,
        "out": str(tmp_path / f"rank{rank}.npy"),
    }
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()


def test_ranks_as_separate_processes(tmp_path):
    secret = secrets.token_bytes(32)
    procs, addresses = start_workers(range(3))
    ordered = [addresses[rank] for rank in range(3)]
    for rank, proc in procs.items():
        send_job(proc, rank, ordered, secret, "run", tmp_path)
    for proc in procs.values():
        assert proc.wait(timeout=30) == 0
    x = np.arange(50_000, dtype=np.float64)
    for rank in range(3):
        summed, last_row, broadcast = np.load(tmp_path / f"rank{rank}.npy")
        np.testing.assert_array_equal(summed, 6 * x)
        np.testing.assert_array_equal(last_row, 3 * x)
        np.testing.assert_array_equal(broadcast, 2 * x)


@pytest.mark.parametrize("death", ["exit", "kill"])
def test_a_process_dying_mid_allreduce_fails_every_survivor_fast(tmp_path, death):
    """Rank 3 of 4 (a process) dies inside an allreduce, by os._exit or SIGKILL: ranks 0..2, rank 1 not even linked
    to it, fail without waiting for their timeout (an hour), each naming the allreduce and rank 3."""
    secret = secrets.token_bytes(32)
    procs, worker_addresses = start_workers([3])
    listeners = [Listener() for _ in range(3)]
    addresses = [listener.address for listener in listeners] + [worker_addresses[3]]
    send_job(procs[3], 3, addresses, secret, death, tmp_path, timeout=FOREVER)
    in_allreduce = threading.Event()

    def kill_when_inside():
        assert procs[3].stdout.readline().strip() == "in allreduce"
        in_allreduce.set()
        if death == "kill":
            time.sleep(0.3)
            os.kill(procs[3].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_inside, daemon=True)
    killer.start()

    def survivor(rank):
        with SparkdlCommunicator.connect(
            rank, addresses, listeners[rank], secret, timeout=FOREVER, shared_memory=False
        ) as comm:
            try:
                comm.allreduce(np.ones(1_000_000, dtype=np.float32), algorithm="ring")
            except CollectiveError as exc:
                return exc
        return None

    with ThreadPoolExecutor(max_workers=3) as pool:
        errors = list(pool.map(survivor, range(3)))
    killer.join(timeout=30)
    assert in_allreduce.is_set()
    assert procs[3].wait(timeout=10) == (1 if death == "exit" else -signal.SIGKILL)
    for rank, error in enumerate(errors):
        # Failed because the peer's connection broke (and the others said so): the hour's timeout cannot end it.
        assert isinstance(error, CollectiveError) and not isinstance(error, CollectiveTimeout), (rank, error)
        message = str(error)
        assert message.startswith(f"rank {rank}:") and "rank 3 closed the connection during allreduce" in message
        assert "timed out" not in message, message


def _array_header(dims: list[int], dtype: int, nbytes: int | None = None) -> tuple[Header, bytes]:
    """The shape frame of a message (tag 5) as send_array makes it, with any dims, dtype code and length."""
    meta = np.array(dims, np.int64).tobytes()
    return Header(Kind.MESSAGE, OP_CODES["send"], len(meta) if nbytes is None else nbytes, dtype, tag=5), meta


@pytest.mark.parametrize(
    "frame",
    [
        _array_header([], dtype_code(np.float32), nbytes=2**64 - 1),  # a shape frame of 2^64-1 bytes
        _array_header([2, 2**62, 2**62], dtype_code(np.float32)),  # a size that overflows
        _array_header([1, 4], 200),  # no such dtype
        _array_header([1, 2**50], dtype_code(np.float64)),  # 8 PiB
    ],
    ids=["length 2^64-1", "size overflows", "dtype code 200", "8 PiB"],
)
def test_a_malformed_message_header_fails_the_receiver_naming_its_sender(frame):
    """Rank 0 sends a message whose shape frame is malformed: rank 1's recv fails its communicator, naming rank 0,
    and rank 0 is told at once (was: a ValueError from numpy, the communicator untouched, the link open and rank 0
    waiting out its timeout; or, for a bad dtype or a huge shape, errors naming nobody)."""

    def body(comm):
        if comm.rank == 0:
            comm._job.links.link(1).send(*frame).result(10)
            with pytest.raises(CollectiveError) as info:
                comm.recv(1, tag=6)
            return str(info.value)
        with pytest.raises(CollectiveError) as info:
            comm.recv(0, tag=5)
        with pytest.raises(CollectiveError, match="already failed"):
            comm.barrier()
        return str(info.value)

    sender, receiver = run_ranks(2, body, timeout=5.0)
    assert receiver.startswith("rank 1: ") and "from rank 0" in receiver, receiver
    assert "rank 1 gave up" in sender and "timed out" not in sender, sender


def test_silent_peer_times_out_with_descriptive_message():
    timed_out = threading.Event()

    def body(comm):
        if comm.rank == 1:
            # Never joins the collective, and keeps its links open until rank 0 has timed out: a close racing
            # the timeout would end rank 0's wait as "closed the connection" instead.
            assert timed_out.wait(30)
            return None
        try:
            with pytest.raises(CollectiveTimeout) as info:
                comm.allreduce(np.ones(3))
        finally:
            timed_out.set()
        with pytest.raises(CollectiveError, match="already failed"):
            comm.allreduce(np.ones(3))
        return str(info.value)

    message = run_ranks(2, body, timeout=0.5)[0]
    for part in ("rank 0", "rank 1", "allreduce", "0.5"):
        assert part in message


def test_a_receive_that_times_out_says_so_naming_its_source():
    """Rank 1 waits for a message rank 0 never sends: its error says the recv timed out, from rank 0 (was: "send
    timed out", the name of the frames it waited for)."""
    timed_out = threading.Event()

    def body(comm):
        if comm.rank == 0:
            assert timed_out.wait(30)  # its links open until then: the wait ends by the clock
            return None
        try:
            with pytest.raises(CollectiveTimeout) as info:
                comm.recv(0, tag=3)
        finally:
            timed_out.set()
        return str(info.value)

    message = run_ranks(2, body, timeout=0.5)[1]
    assert message.startswith("rank 1: recv timed out after 0.5s waiting to receive from rank 0"), message
    assert "check that rank 0 (on 127.0.0.1) is alive" in message, message  # the host it waits for
    assert "send" not in message, message


def test_async_work_wait_is_bounded_by_its_own_timeout():
    release = threading.Event()

    def body(comm):
        if comm.rank == 1:
            assert release.wait(30)
            return comm.allreduce(np.ones(2)).tolist()
        work = comm.allreduce_async(np.ones(2))
        with pytest.raises(CollectiveTimeout, match="rank 0: allreduce was not done after waiting 0.2s"):
            work.wait(timeout=0.2)
        release.set()
        return work.wait(timeout=30).tolist()  # it went on running

    assert run_ranks(2, body) == [[2, 2], [2, 2]]


def test_closed_peer_fails_collective():
    def body(comm):
        if comm.rank == 2:
            return None  # leaves (closes its links) without taking part
        with pytest.raises(CollectiveError) as info:
            comm.allreduce(np.ones(10))
        assert not isinstance(info.value, CollectiveTimeout)
        return True

    # A rank fails in its allreduce or, where rank 2 left before that rank had linked to its neighbours, while
    # linking: either way with the error that names the closed link, not a timeout.
    for result in run_ranks(3, body, timeout=5.0, capture=True)[:2]:
        assert result is True or (isinstance(result, CollectiveError) and not isinstance(result, CollectiveTimeout)), (
            repr(result)
        )


def test_a_rank_that_closed_its_communicator_fails_no_rank_still_opening_a_link():
    """Rank 4 of 5 waits for rank 2 to open their link while rank 3, linked to it, has finished and closed its
    communicator: rank 4 must go on waiting, not take the closed link for a failed job (gossip's rounds end so when
    the ranks that sit out the last ones leave first). Ranks 2 and 4 are linked on first use: neither the ring nor
    connect's barrier (a binomial tree from rank 0) links them. Rank 2 connects well after rank 3 closed (5 of the
    waiting rank's checks of its links), so the close always falls inside the wait."""
    waiting, closed, received = threading.Event(), threading.Event(), threading.Event()

    def body(comm):
        if comm.rank == 2:
            assert closed.wait(30)
            time.sleep(1.0)
            comm.send(np.arange(5.0), 4)
        elif comm.rank == 3:
            assert waiting.wait(30)
            comm.close()
            closed.set()
        elif comm.rank == 4:
            waiting.set()
            message = comm.recv(2).tolist()
            received.set()
            return message
        else:
            assert received.wait(30)
        return None

    assert run_ranks(5, body, timeout=FOREVER)[4] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_failure_poisons_the_subgroups_too():
    def body(comm):
        local = comm.local()
        if comm.rank == 1:
            comm.broadcast(np.zeros(5, np.int64), root=1)  # the others allgather: out of step
        else:
            with pytest.raises(CollectiveError):
                comm.allgather(np.zeros(5, np.int64))
        with pytest.raises(CollectiveError, match="already failed|gave up|closed"):
            local.allreduce(np.ones(2))
        return True

    assert run_ranks(4, body, capture=True, hosts=["a", "a", "b", "b"]) == [True] * 4


def test_ranks_with_mismatched_secrets_fail_within_timeout():
    # run_ranks waits 120 s for a rank: the 1 s timeout must be what ends it, naming the secret.
    with pytest.raises(CollectiveTimeout, match="same job secret"):
        run_ranks(2, lambda comm: None, timeout=1.0, secrets_by_rank=[b"one", b"two"])


def test_unsupported_dtype_rejected_before_sending():
    def body(comm):
        for bad in (np.array(["a"]), np.zeros(3, dtype=">f4"), np.array([object()])):
            with pytest.raises(TypeError, match="Expected an array of one of the dtypes"):
                comm.allreduce(bad)
            with pytest.raises(TypeError):
                comm.send(bad, 1 - comm.rank)
            with pytest.raises(TypeError):
                comm.alltoall([bad, bad])
        with pytest.raises(TypeError, match="floor-divided"):
            from sparkdl.collective import ReduceOp

            comm.allreduce(np.ones(3, np.int32), ReduceOp.MEAN)
        return comm.allreduce(np.ones(3)).tolist()  # nothing was sent: still in step

    assert run_ranks(2, body) == [[2, 2, 2]] * 2
