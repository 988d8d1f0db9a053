"""Tests for sparkdl.collective.shm: ranks of one host exchanging through shared memory, in real processes.

Every rank is a spawned process; each checks its own results against numpy
(all ranks' inputs are reproducible from their seeds) and reports failures, so
no rank stops early and leaves the others waiting.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from functools import reduce

import ml_dtypes
import numpy as np
import pytest
from attackers import OTHER_USER, Squatter
from collective_ranks import run_ranks

from sparkdl.collective.shm import segment as shm_segment
from sparkdl.collective.shm.group import INITIAL_DATA_BYTES, PIECE_BYTES, SharedMemoryGroup
from sparkdl.net import auth
from sparkdl.net.errors import CollectiveError, CollectiveTimeout

CTX = mp.get_context("spawn")
UFUNCS = {"sum": np.add, "min": np.minimum, "max": np.maximum}
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8, np.float16, ml_dtypes.bfloat16]
SIZES = [0, 1, 7, 10, 1001]  # 7 divides by no group size, 10 by 2 only
BIG = PIECE_BYTES // 4 + 1003  # float32: two pieces, and more than the initial segment holds


def global_ranks(size):
    """Global ranks unlike the local ones, so that messages are seen to name the global rank."""
    return [10 + 3 * local for local in range(size)]


def rank_data(local_rank, n, dtype, case):
    """Small integers: sums are exact in every dtype, float16 and bfloat16 included."""
    return np.random.default_rng([case, local_rank]).integers(0, 40, size=n).astype(dtype)


def _compare(failures, label, got, expected):
    if got.dtype in (np.float16, ml_dtypes.bfloat16):
        ok = np.allclose(got.astype(np.float32), expected.astype(np.float32), rtol=1e-2)
    else:
        ok = np.array_equal(got, expected)
    if not ok:
        failures.append(f"{label}: got {got[:8]}, expected {expected[:8]}")


def collectives(group, queue, name):
    failures, size, rank = [], group.local_size, group.local_rank
    case = 0
    for dtype in DTYPES:
        for n in SIZES + ([BIG] if dtype is np.float32 else []):
            for op, ufunc in UFUNCS.items():
                case += 1
                label = f"allreduce {op} {np.dtype(dtype).name}[{n}]"
                x = rank_data(rank, n, dtype, case)
                expected = reduce(ufunc, [rank_data(q, n, dtype, case) for q in range(size)])
                out = np.empty_like(x)
                group.allreduce(x, op, out)
                _compare(failures, label, out, expected)
                _compare(failures, label + " (input kept)", x, rank_data(rank, n, dtype, case))
                group.allreduce(x, op, x)
                _compare(failures, label + " in place", x, expected)
                # reduce_scatter by np.array_split's bounds: this rank's range
                x = rank_data(rank, n, dtype, case)
                x.setflags(write=False)  # only read: a read-only view (of a tensor's memory) will do
                bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(n), size)]).tolist()
                lo, hi = bounds[rank], bounds[rank + 1]
                out = np.empty(hi - lo, x.dtype)
                group.reduce_scatter(x, op, out, bounds)
                _compare(failures, f"reduce_scatter {op} {np.dtype(dtype).name}[{n}]", out, expected[lo:hi])
                _compare(failures, f"reduce_scatter {op} [{n}] (input kept)", x, rank_data(rank, n, dtype, case))
            rows = np.stack([rank_data(q, n, dtype, case) for q in range(size)])
            gathered = np.zeros_like(rows)
            gathered[rank] = rows[rank]
            group.allgather(gathered)
            _compare(failures, f"allgather {np.dtype(dtype).name}[{n}]", gathered.reshape(-1), rows.reshape(-1))
    for n in (1, 1001, BIG):
        for root in range(size):
            case += 1
            x = rank_data(rank, n, np.float32, case)
            out = np.empty_like(x)
            group.broadcast(x, root, out)
            _compare(failures, f"broadcast[{n}] from {root}", out, rank_data(root, n, np.float32, case))
            _compare(failures, f"broadcast[{n}] from {root} (input kept)", x, rank_data(rank, n, np.float32, case))
            group.broadcast(x, root, x)
            _compare(failures, f"broadcast[{n}] from {root} in place", x, rank_data(root, n, np.float32, case))
    time.sleep(0.05 * rank)
    arrived = time.monotonic()
    group.barrier()
    left = time.monotonic()
    membership = group._membership
    return {
        "failures": failures,
        "arrived": arrived,
        "left": left,
        "data_bytes": membership.data.size if membership else None,
        "modes": [os.fstat(s.fd).st_mode & 0o777 for s in (membership.control, membership.data)] if membership else [],
        "names": [os.readlink(f"/proc/self/fd/{s.fd}") for s in (membership.control, membership.data)]
        if membership
        else [],
        "listener_gone": _listener_gone(name),
    }


def _listener_gone(name):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect("\0sparkdl-" + name)
        except ConnectionRefusedError:
            return True
    return False


def stalled(group, queue, name):
    """One local rank (the last unless told) joins and then never calls allreduce: it waits (at most a minute) until
    every other rank has failed (each leaves a file named after it in ``SHM_TEST_FAILED``), or is killed."""
    queue.put((group.local_rank, "ready", None))
    failed = os.environ.get("SHM_TEST_FAILED", "")
    if group.local_rank == int(os.environ.get("SHM_TEST_STALLER", group.local_size - 1)):
        others, deadline = group.local_size - 1, time.monotonic() + 60
        while (not failed or len(os.listdir(failed)) < others) and time.monotonic() < deadline:
            time.sleep(0.02)
        return None
    x = np.ones(1000, np.float32)
    try:
        group.allreduce(x, "sum", x)
    except CollectiveError as exc:
        first = (type(exc).__name__, str(exc))
    else:
        return "allreduce returned"
    held = segment_holdings(name)  # the group is open still, and failed
    if failed:
        open(os.path.join(failed, str(group.local_rank)), "w").close()
    try:
        group.barrier()
    except CollectiveError as exc:
        return {"first": first, "later": (type(exc).__name__, str(exc)), "held": held}
    return "barrier returned"


def segment_holdings(name=""):
    """(descriptors, mappings) of this process that hold a memfd of the group ``name`` (any group's by default)."""
    fds = 0
    for fd in glob.glob("/proc/self/fd/*"):
        try:
            fds += f"memfd:sparkdl-{name}" in os.readlink(fd)
        except OSError:  # the descriptor glob itself read the directory with, closed since
            pass
    with open("/proc/self/maps") as maps:
        return fds, sum(f"memfd:sparkdl-{name}" in line for line in maps)


def simple(group, queue, name):
    x = np.full(10, group.local_rank + 1, np.int64)
    group.allreduce(x, "sum", x)
    return x.tolist()


SCENARIOS = {"collectives": collectives, "stalled": stalled, "simple": simple}


def _rank_main(local_rank, size, name, secret, timeout, scenario, queue, env):
    os.environ.update(env)
    try:
        with SharedMemoryGroup.open(local_rank, global_ranks(size), name=name, secret=secret, timeout=timeout) as group:
            result = SCENARIOS[scenario](group, queue, name)
        queue.put((local_rank, "done", result))
    except BaseException as exc:
        queue.put((local_rank, "error", f"{type(exc).__name__}: {exc}"))


class Ranks:
    """Processes running ``scenario`` as the local ranks of one group."""

    def __init__(self, size, scenario, *, timeout=30.0, env=None):
        self.size, self.scenario, self.timeout, self.env = size, scenario, timeout, env or {}
        self.name, self.secret = secrets.token_hex(16), secrets.token_bytes(32)
        self.queue = CTX.Queue()
        self.processes = {}

    def start(self, *local_ranks):
        for local in local_ranks or range(self.size):
            args = (local, self.size, self.name, self.secret, self.timeout, self.scenario, self.queue, self.env)
            self.processes[local] = CTX.Process(target=_rank_main, args=args, daemon=True)
            self.processes[local].start()

    def messages(self, kind, count, wait=90.0):
        found, deadline = {}, time.monotonic() + wait
        while len(found) < count:
            local, got, value = self.queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if got == kind or got == "error":
                found[local] = value if got == kind else AssertionError(value)
        return found

    def results(self):
        found = self.messages("done", self.size)
        self.join()
        return found

    def join(self):
        for process in self.processes.values():
            process.join(30)
            if process.is_alive():
                process.kill()


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_collectives_match_numpy(size):
    ranks = Ranks(size, "collectives")
    ranks.start()
    results = ranks.results()
    for local, result in results.items():
        assert not isinstance(result, Exception), result
        assert result["failures"] == [], (local, result["failures"][:5])
    assert min(r["left"] for r in results.values()) >= max(r["arrived"] for r in results.values())  # barrier
    if size > 1:
        for result in results.values():
            assert result["data_bytes"] > INITIAL_DATA_BYTES  # the big calls regrew the segment
            assert result["modes"] == [0o600, 0o600]
            assert all(link.startswith(f"/memfd:sparkdl-{ranks.name}") for link in result["names"])
            assert result["listener_gone"]


def _handshake(name, secret, rank):
    """Connect to the group's listener and authenticate as ``rank``; HandshakeFailed when refused."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 30
    while True:
        try:
            sock.connect("\0sparkdl-" + name)
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "local rank 0 never listened"
            time.sleep(0.02)
    sock.settimeout(10)
    return sock, lambda: auth.client_handshake(sock, rank, 0, shm_segment.group_key(secret, name))


def test_listener_refuses_strangers_and_lets_peers_in():
    ranks = Ranks(3, "simple")
    ranks.start(0)
    idle, _ = _handshake(ranks.name, ranks.secret, 1)  # connects and never says a word
    forger, attempt = _handshake(ranks.name, secrets.token_bytes(32), 1)  # claims rank 1 with the wrong secret
    with forger, pytest.raises(auth.HandshakeFailed):
        attempt()
    stranger = None
    if os.geteuid() == 0 and os.path.exists("/usr/bin/python3"):  # another uid is closed before any greeting
        code = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({chr(0) + 'sparkdl-' + ranks.name!r}); print(len(s.recv(100)))"
        stranger = subprocess.run(
            ["/usr/bin/python3", "-c", code], user=65534, capture_output=True, text=True, timeout=30
        )
    ranks.start(1, 2)
    with idle:
        results = ranks.results()
    assert results == {local: [6] * 10 for local in range(3)}
    if stranger is not None:
        assert stranger.stdout.strip() == "0", stranger


def _elapsed_results(ranks):
    """Every rank's result, and the seconds from starting the ranks' processes to the last result."""
    started = time.monotonic()
    ranks.start()
    results = ranks.results()
    return results, time.monotonic() - started


@pytest.mark.parametrize("listening", [False, True])
def test_a_squatted_name_is_avoided_by_every_rank_at_once(listening):
    """Another user binds the group's name (and maybe listens on it) before the group opens: local rank 0 listens on
    the next name and the others find it there, well within their timeout (was: rank 0 failed with "Address already
    in use" and the others waited out their timeout)."""
    if listening and OTHER_USER is None:
        pytest.skip("a listener of this user would be taken for local rank 0's: needs another user (root)")
    ranks = Ranks(3, "simple", timeout=60.0)
    with Squatter([f"sparkdl-{ranks.name}"], listening=listening):
        results, took = _elapsed_results(ranks)
    assert results == {local: [6] * 10 for local in range(3)}
    assert took < 30.0, took  # the processes' start included


def test_every_rank_reports_at_once_when_every_name_is_squatted():
    """Only the job secret tells the alternative names; a squatter who held them all is reported by every rank at
    once, naming why, instead of the ranks but one waiting out their timeout."""
    if OTHER_USER is None:
        pytest.skip("needs another user (root) to listen on the names")
    ranks = Ranks(3, "simple", timeout=60.0)
    names = shm_segment.listener_names(ranks.name, shm_segment.group_key(ranks.secret, ranks.name))
    with Squatter([name[1:] for name in names], listening=True):
        results, took = _elapsed_results(ranks)
    assert "Address already in use" in str(results[0]), results
    for local in (1, 2):
        assert "other processes listen on every name of the group" in str(results[local]), results
    assert took < 30.0, took  # the processes' start included


def test_a_retried_stage_opens_its_segment_though_another_user_squats_the_last_attempts_name():
    """An attempt's segment name is listed in /proc/net/unix; another user binds it once the attempt is over. The
    retry (same job secret and hosts, new listeners, as Spark's retry of a barrier stage has) opens its segment
    under another name at once (was: the same name, so its local rank 0 failed and the others waited out their
    timeout)."""
    secret = secrets.token_bytes(32)

    def name(comm):
        return comm.segment.name

    def attempt():
        return run_ranks(3, name, shared_memory=True, secrets_by_rank=[secret] * 3, timeout=5.0)

    (first,) = set(attempt())
    with Squatter([f"sparkdl-{first}"], listening=OTHER_USER is not None):
        started = time.monotonic()
        (retried,) = set(attempt())
        took = time.monotonic() - started
    assert retried != first
    assert took < 3.0, took


def _holders(name):
    """Processes whose descriptors or mappings still hold the group's memfds."""
    found = []
    for entry in glob.glob("/proc/[0-9]*"):
        try:
            links = [os.readlink(fd) for fd in glob.glob(entry + "/fd/*")]
            with open(entry + "/maps") as maps:
                links += maps.read().splitlines()
        except OSError:
            continue
        found += [(entry, link) for link in links if f"memfd:sparkdl-{name}" in link]
    return found


@pytest.mark.parametrize("victim", [2, 0])  # 0: the rank that created the segments and holds the connections
def test_killed_rank_is_named_and_nothing_leaks(victim):
    """The others' allreduce ends because the killed rank's doorbell closed: their timeout (an hour) cannot end it.
    They hold nothing of the segment once they have the error (was: a descriptor and a mapping each, kept by the
    failed group until garbage collection)."""
    ranks = Ranks(3, "stalled", timeout=3600.0, env={"SHM_TEST_STALLER": str(victim)})
    ranks.start()
    ranks.messages("ready", 3)
    time.sleep(0.3)  # the others now wait in allreduce
    os.kill(ranks.processes[victim].pid, signal.SIGKILL)
    results = ranks.messages("done", 2)
    ranks.join()
    killed = global_ranks(3)[victim]
    assert sorted(results) == sorted({0, 1, 2} - {victim})
    for local, result in results.items():
        kind, message = result["first"]
        assert kind == "CollectiveError", result
        assert f"rank {global_ranks(3)[local]}: allreduce failed: rank {killed} (same host" in message
        assert "closed its connection (its process died?)" in message and "timed out" not in message
        later_kind, later = result["later"]
        # refused at once, before waiting for anyone: the group remembers its failure
        assert later_kind == "CollectiveError" and "barrier failed: the shared memory group failed before" in later
        assert message in later
        assert result["held"] == (0, 0)  # released with the failure, while the group is still open
    assert _holders(ranks.name) == []
    assert [path for path in glob.glob("/dev/shm/*") if ranks.name in path] == []


_COMMUNICATOR_RANK = r"""
import json, sys
import numpy as np
from test_collective_shm import segment_holdings
from sparkdl.collective import CollectiveError, Listener, SparkdlCommunicator
listener = Listener("127.0.0.1")
print(json.dumps(listener.address), flush=True)
job = json.loads(sys.stdin.readline())
secret = bytes.fromhex(job["secret"])
comm = SparkdlCommunicator.connect(job["rank"], job["addresses"], listener, secret, timeout=3600.0)
x = np.ones(1 << 20, np.float32)
comm.allreduce(x)  # through the segment: all ranks share this host
print(json.dumps(segment_holdings()), flush=True)
if job["rank"] == 2:
    sys.stdin.read()  # until killed
try:
    comm.allreduce(x)
except CollectiveError as exc:
    print(json.dumps({"error": str(exc), "held": segment_holdings()}), flush=True)
"""


def test_survivors_of_a_killed_rank_release_the_communicators_segment_at_once():
    """Three communicator processes on one host; rank 2 is killed while the others are in an allreduce through their
    segment. Each survivor's communicator has failed, naming rank 2, and holds no descriptor or mapping of the
    segment, though the communicator is still open (was: one descriptor and the data segment mapped, until garbage
    collection)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _COMMUNICATOR_RANK],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    try:
        addresses = [json.loads(process.stdout.readline()) for process in processes]
        secret = secrets.token_hex(32)
        for rank, process in enumerate(processes):
            process.stdin.write(json.dumps({"rank": rank, "addresses": addresses, "secret": secret}) + "\n")
            process.stdin.flush()
        ready = [json.loads(process.stdout.readline()) for process in processes]
        time.sleep(0.3)  # the survivors now wait in their allreduce
        processes[2].kill()
        survivors = [json.loads(process.stdout.readline()) for process in processes[:2]]
    finally:
        for process in processes:
            process.kill()
            process.communicate(timeout=30)
    assert all(fds > 0 and maps > 0 for fds, maps in ready), ready  # what is looked for is there to be seen
    for rank, survivor in enumerate(survivors):
        assert survivor["error"].startswith(f"rank {rank}: ") and "rank 2" in survivor["error"], survivor
        assert survivor["held"] == [0, 0], survivor


def test_rank_that_never_arrives_times_out_by_name(tmp_path):
    """The late rank stays in the group until both others have failed: only their timeout can end their wait."""
    ranks = Ranks(3, "stalled", timeout=1.5, env={"SHM_TEST_FAILED": str(tmp_path)})
    ranks.start()
    results = ranks.results()
    late = global_ranks(3)[2]
    assert results[2] is None
    for local in (0, 1):
        kind, message = results[local]["first"]
        assert kind == "CollectiveTimeout"
        assert (
            f"rank {global_ranks(3)[local]}: allreduce timed out after 1.5s waiting for rank {late} (same host"
            in message
        )
        later_kind, later = results[local]["later"]
        assert later_kind == "CollectiveTimeout" and "barrier failed: the shared memory group failed before" in later
        assert message in later


def test_setup_times_out_naming_missing_ranks():
    name, secret = secrets.token_hex(8), secrets.token_bytes(16)
    with pytest.raises(CollectiveTimeout, match=r"rank 10: shared memory setup failed: .*rank 13 \(same host"):
        SharedMemoryGroup.open(0, [10, 13], name=name, secret=secret, timeout=0.3)
    with pytest.raises(CollectiveTimeout, match=r"rank 13: shared memory setup failed: .*rank 10 \(same host"):
        SharedMemoryGroup.open(1, [10, 13], name=name, secret=secret, timeout=0.3)


def test_arguments_are_checked_before_anything_is_shared():
    with pytest.raises(ValueError, match="name"):
        SharedMemoryGroup.open(0, [0, 1], name="../x", secret=b"s", timeout=1)
    with SharedMemoryGroup.open(0, [4], name="ab", secret=b"s", timeout=1) as group:
        assert (group.local_rank, group.local_size, group.ranks) == (0, 1, [4])
        x = np.arange(5.0)
        with pytest.raises(ValueError, match="sum"):
            group.allreduce(x, "mean", x)
        with pytest.raises(ValueError, match="overlap"):
            group.allreduce(x[1:], "sum", x[:-1])
        with pytest.raises(ValueError, match="C-contiguous"):
            group.allreduce(x[::2], "sum", x[::2])
        with pytest.raises(ValueError, match="one dtype"):
            group.allreduce(x, "sum", x.astype(np.float32))
        out = np.empty_like(x)
        group.allreduce(x, "max", out)
        group.broadcast(x, 0, out)
        group.barrier()
        assert np.array_equal(out, x)
    group.close()  # idempotent
    with pytest.raises(CollectiveError, match="rank 4: barrier failed: .*closed"):
        group.barrier()
