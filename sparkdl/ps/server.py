"""Parameter server: serves shards of a model's parameters to asynchronous workers.

Runs on the Spark driver for the length of a training job.  Each shard has its
own :class:`~sparkdl.net.listener.ServingListener` on exactly ``host``: clients
authenticate with the job secret (challenge/response, see
:mod:`sparkdl.ps.protocol`) on its selector, and every authenticated
connection gets its own thread (at most a few per worker), which answers its
requests in order (:mod:`sparkdl.ps.shard_server`); with ``encrypt`` every
connection is sealed (:mod:`sparkdl.net.secure`).  The server stores nothing
itself: it calls the :class:`Shard` objects it was given.

Modes:

- ``async``: pushes are applied as they arrive; ``apply`` and ``read`` of a
  shard are serialised by a per-shard lock.
- ``hogwild``: no lock: concurrent pushes call ``shard.apply`` concurrently
  (one thread per connection) and reads don't wait for applies.
- ``ssp``: as ``async``, and a pull by worker w is held until
  ``clock[w] - min(active clocks) <= max_staleness`` (see
  :class:`sparkdl.ps.staleness.ClockTracker`; the shard-0 server advances a
  worker's clock once per push).
- ``sync_ps``: synchronous rounds (:class:`sparkdl.ps.rules.Rounds`): each shard
  collects one push per worker for step t, applies their mean (weighted by the
  rows behind each) once, and holds every worker's pull until then, so all pull
  the same weights for step t+1. Before its first step a worker joins
  (shard 0): it learns every worker's training rows, from which all compute one
  schedule (:class:`sparkdl.ps.rules.Roster`). With ``epoch_steps`` the first
  round of each epoch waits until :meth:`ParameterServer.epoch_saved` says the
  driver saved the state after the epoch before.

How a shard turns pushes into updates is its rule's (:mod:`sparkdl.ps.rules`).

A server hosts all shards of a model (on the driver), or, under ``server_placement="executors"``,
some of them in a Spark task of its own (``first_shard``: the index of its first shard in the
whole layout, which its listeners prove in the handshake and which the clients address). Each
server keeps its own clocks and roster: its first shard advances the clocks and takes the joins,
so workers of servers that run apart join and finish with every shard
(``ParameterClient(separate_servers=True)``). With ``controller`` the shards also take one more
client rank, ``num_workers``: the driver, which asks them for their state (``Msg.STATE``) to write
its checkpoints; a worker rank cannot ask, and the controller can do nothing else.

With ``compression`` ("bf16" or "fp16") pushes arrive at half the bytes, narrowed once by
the worker, and each shard widens them to float32 as it applies them (:mod:`sparkdl.ps.wire`);
pulls always send float32 weights.

Every wait is bounded: a handshake by ``min(timeout, handshake_timeout)``, a
connection with no request for ``timeout`` seconds is closed (clients
reconnect by themselves before that), sends and the ssp gate by ``timeout``.
A connection that breaks the protocol is closed; nothing it sent is applied
unless a complete, well-formed push arrived, and a push holding NaN or
infinity is refused with ``BAD_REQUEST`` before anything is applied.
"""

from __future__ import annotations

import contextlib
import threading
import time
import typing
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from sparkdl.collective import compression as compressions
from sparkdl.net.acceptor import HANDSHAKE_TIMEOUT, MAX_PENDING
from sparkdl.ps import wire
from sparkdl.ps.rules import Roster, Rounds
from sparkdl.ps.shard_server import ShardServer
from sparkdl.ps.staleness import ClockTracker

MODES = ("async", "hogwild", "ssp", "sync_ps")


class Shard(typing.Protocol):
    size: int  # number of float32 parameters in this shard

    def read(self) -> np.ndarray | Sequence[np.ndarray]:
        """Current weights: a 1-D float32 snapshot of length ``size``, or several whose concatenation is one
        (sent one after the other, never joined); unchanged until the caller drops them."""

    def apply(self, gradient: np.ndarray) -> None:
        """Apply one pushed gradient: 1-D of length ``size``, float32 or, under ``compression``, its half-width
        dtype, which the shard widens to float32. It is the connection's receive buffer: valid during the call."""


class StatefulShard(Shard, typing.Protocol):
    """A shard the controller may ask for its state (``Msg.STATE``): ``sparkdl.ps.server_model.OptimizerShard``."""

    state_nbytes: int  # the bytes of ``state()``'s arrays end to end

    def state(self) -> Sequence[np.ndarray]:
        """The shard's variables and its optimizer's, copied (the caller holds the shard's lock)."""


class ParameterServer:
    """Serves ``shards`` to :class:`sparkdl.ps.client.ParameterClient` workers; see the module doc."""

    def __init__(
        self,
        shards: Sequence[Shard],
        *,
        host: str,
        secret: bytes,
        mode: str,
        num_workers: int,
        max_staleness: int = 0,
        timeout: float = 600.0,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending: int = MAX_PENDING,
        encrypt: bool = False,
        compression: str | None = None,
        epoch_steps: Callable[[list[int]], int] | None = None,
        first_shard: int = 0,
        controller: bool = False,
    ):
        """``epoch_steps`` (sync_ps, where the driver checkpoints): the steps per epoch of workers holding the
        joined rows; the rounds of each epoch then wait for :meth:`epoch_saved` of the epoch before.
        ``first_shard``: the index of ``shards[0]`` in the model's whole layout (a server task hosting shard k of
        several); ``controller``: take the driver's connection as rank ``num_workers`` for ``Msg.STATE``."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not shards:
            raise ValueError("a parameter server needs at least one shard")
        if not host or host in ("0.0.0.0", "::"):
            raise ValueError(
                f"host must be one specific interface address (e.g. the driver's "
                f"spark.driver.host), not {host!r}: the parameter server never listens on "
                f"every interface"
            )
        if not secret:
            raise ValueError("secret must be a non-empty per-job secret")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        for i, shard in enumerate(shards):
            if int(shard.size) < 0:
                raise ValueError(f"shard {i} has negative size {shard.size}")
        if first_shard < 0:
            raise ValueError(f"first_shard must be >= 0, got {first_shard}")
        self.host = host
        self.secret = bytes(secret)
        self.mode = mode
        self.num_workers = num_workers
        self.max_staleness = max_staleness
        self.timeout = float(timeout)
        self.handshake_timeout = float(handshake_timeout)
        self.max_pending = int(max_pending)
        self.encrypt = encrypt  # seal every connection (sparkdl.net.secure): the session encrypts its RPC
        self.push_dtype = wire.push_dtype(compressions.check(compression))  # what every push must carry
        self.tracker = ClockTracker(num_workers, max_staleness if mode == "ssp" else None)
        self.roster = Roster(num_workers, epoch_steps) if mode == "sync_ps" else None
        self.first_shard = int(first_shard)  # the shard that owns the clocks, the roster and the counts
        self.controller: int | None = num_workers if controller else None  # the driver's client rank, if taken
        self._shards = [ShardServer(self, first_shard + i, shard) for i, shard in enumerate(shards)]
        self._lock = threading.Lock()
        self._finished: set[int] = set()  # workers whose DONE some shard answered
        self.last_request = time.monotonic()  # when a shard last read a request (its start, before any)
        self._all_finished = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._counters = dict(pushes=0, pulls=0, bytes_in=0, bytes_out=0, protocol_errors=0)
        self._seconds = dict(check_seconds=0.0, apply_seconds=0.0, read_seconds=0.0)
        self._started = False
        self._stopped = False
        self.addresses: list[str] = []

    def start(self) -> list[str]:
        if self._stopped:
            raise RuntimeError("a stopped ParameterServer cannot be restarted; create a new one")
        if self._started:
            return list(self.addresses)
        self._started = True
        try:
            self.addresses = [shard.start() for shard in self._shards]
        except BaseException:
            self.stop()
            raise
        return list(self.addresses)

    def stop(self, join_timeout: float = 10.0) -> None:
        """Close listeners and connections and join the threads; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        self.tracker.stop()
        if self.roster is not None:
            self.roster.stop()
        for shard in self._shards:
            shard.close_listener(join_timeout)  # a thread inside shard.apply finishes that call first

    def __enter__(self) -> ParameterServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @contextlib.contextmanager
    def holding_updates(self) -> Iterator[None]:
        """While the block runs no shard applies a push or serves a pull: the state of one moment.

        Hogwild shards have no lock: there the state is read as it is, as their workers read it.
        """
        with contextlib.ExitStack() as stack:
            for shard in self._shards:
                if shard.lock is not None:
                    stack.enter_context(shard.lock)
            yield

    def wait_finished(self, poll: float = 1.0) -> bool:
        """Waits until every worker has said DONE and had its answer (True), or the server stops (False): how a
        server task knows its job is over. Spark ends the server tasks of a stage that fails; should a worker vanish
        without that, a wait in which no worker sent a request for ``timeout`` seconds raises ``TimeoutError`` naming
        the workers that never said DONE."""
        with self._all_finished:
            while len(self._finished) < self.num_workers:
                if self._stopping.is_set():
                    return False
                if time.monotonic() - self.last_request > self.timeout:
                    missing = sorted(set(range(self.num_workers)) - self._finished)
                    raise TimeoutError(
                        f"parameter server shard(s) {[s.index for s in self._shards]}: no worker sent a request for "
                        f"timeout={self.timeout}s, and worker(s) {missing} never said they were done (their tasks "
                        "were lost?); raise timeout if a worker's step, validation or callbacks take that long"
                    )
                self._all_finished.wait(poll)
            return True

    def _finished_worker(self, worker: int) -> None:
        with self._all_finished:
            self._finished.add(worker)
            self._all_finished.notify_all()

    def epoch_saved(self, epoch: int) -> None:
        """sync_ps with ``epoch_steps``: the driver saved the state after ``epoch``, the next epoch's rounds may run."""
        if self.roster is not None:
            self.roster.epoch_saved(epoch)

    def stats(self) -> dict:
        """Counters since start.

        ``pushes``/``pulls``: worker operations (each counted once, on the first
        shard, although it reaches every shard); ``bytes_in``/``bytes_out``: request and
        response frames (headers + payloads) over all shards, handshakes excluded;
        ``max_staleness``: the largest ``clock[w] - min(active clocks)`` seen by a
        granted pull; ``versions``: updates applied per shard;
        ``refused_connections``: failed or refused handshakes; ``check_seconds``,
        ``apply_seconds``, ``read_seconds``: time the shards spent checking pushes for
        NaN and infinity, applying them (under the lock, where there is one) and
        reading weights for pulls, summed over shards and connections; extra keys:
        ``protocol_errors`` (authenticated connections closed for breaking the
        protocol) and ``clocks`` (pushes completed per worker id); under sync_ps
        ``rounds`` (synchronous updates applied, per shard) and ``replayed_pushes``
        (pushes of steps applied already, from retried workers catching up, dropped;
        per shard).
        """
        clocks, max_seen = self.tracker.snapshot()
        with self._lock:
            result: dict = {**self._counters, **self._seconds}
            result["refused_connections"] = sum(
                shard.listener.refused for shard in self._shards if shard.listener is not None
            )
            result["versions"] = [shard.version for shard in self._shards]
        rules = [shard.rule for shard in self._shards]
        if self.roster is not None:
            result["rounds"] = [rule.rounds for rule in rules if isinstance(rule, Rounds)]
            result["replayed_pushes"] = [rule.replayed for rule in rules if isinstance(rule, Rounds)]
        result["max_staleness"] = max_seen
        result["clocks"] = clocks
        return result

    # -- internals used by the shard servers -----------------------------------------------

    def _count(self, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._lock:
            self._counters["bytes_in"] += bytes_in
            self._counters["bytes_out"] += bytes_out

    def _time(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds
