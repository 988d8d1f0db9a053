"""Parameter server: serves shards of a model's parameters to asynchronous workers.

Runs on the Spark driver for the length of a training job.  Each shard has its
own :class:`~sparkdl.net.listener.ServingListener` on exactly ``host``: clients
authenticate with the job secret (challenge/response, see
:mod:`sparkdl.ps.protocol`) on its selector, and every authenticated
connection gets its own thread (at most a few per worker), which answers its
requests in order (:mod:`sparkdl.ps.shard_server`); with ``encrypt`` every
connection is sealed (:mod:`sparkdl.net.secure`).  The server stores nothing
itself: it calls the :class:`~sparkdl.ps.shard_server.Shard` objects it was given.

Update rules (:mod:`sparkdl.ps.rules`, the ``rule`` it is given):

- ``Immediate`` (async): pushes are applied as they arrive; ``apply`` and ``read`` of a
  shard are serialised by a per-shard lock.
- ``Hogwild``: no lock: concurrent pushes call ``shard.apply`` concurrently
  (one thread per connection) and reads don't wait for applies.
- ``BoundedStaleness`` (ssp): as ``Immediate``, and a pull by worker w is held until
  ``clock[w] - min(active clocks) <= max_staleness`` (see
  :class:`sparkdl.ps.staleness.ClockTracker`; the shard-0 server advances a
  worker's clock once per push).
- ``SyncRounds`` (sync_ps): synchronous rounds (:class:`sparkdl.ps.rules.RoundUpdates`): each shard
  collects one push per worker for step t, applies their mean (weighted by the
  rows behind each) once, and holds every worker's pull until then, so all pull
  the same weights for step t+1. Before its first step a worker joins
  (shard 0): it learns every worker's training rows, from which all compute one
  schedule (:class:`sparkdl.ps.rules.Roster`). With ``epoch_steps`` the first
  round of each epoch waits until :meth:`ParameterServer.epoch_saved` says the
  driver saved the state after the epoch before.

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
from collections.abc import Callable, Iterator, Sequence

from sparkdl.collective import compression as compressions
from sparkdl.net.acceptor import HANDSHAKE_TIMEOUT, MAX_PENDING
from sparkdl.ps import wire
from sparkdl.ps.attendance import Attendance
from sparkdl.ps.counters import ServerCounters
from sparkdl.ps.positions import UNKNOWN, WorkerPositions, WorkerRows
from sparkdl.ps.rules import UpdateRule
from sparkdl.ps.shard_server import Bookkeeping, Serving, Shard, ShardServer


class ParameterServer:
    """Serves ``shards`` to :class:`sparkdl.ps.client.ParameterClient` workers; see the module doc."""

    def __init__(
        self,
        shards: Sequence[Shard],
        *,
        host: str,
        secret: bytes,
        rule: UpdateRule,
        num_workers: int,
        timeout: float = 600.0,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending: int = MAX_PENDING,
        encrypt: bool = False,
        compression: str | None = None,
        epoch_steps: Callable[[list[int]], int] | None = None,
        first_shard: int = 0,
        controller: bool = False,
        positions: WorkerPositions | None = None,
        min_workers: int | None = None,
    ):
        """``epoch_steps`` (``SyncRounds``, where the driver checkpoints): the steps per epoch of workers holding the
        joined rows; the rounds of each epoch then wait for :meth:`epoch_saved` of the epoch before.
        ``first_shard``: the index of ``shards[0]`` in the model's whole layout (a server task hosting shard k of
        several); ``controller``: take the driver's connection as rank ``num_workers`` for ``Msg.STATE``.
        ``positions``: where the workers stood when the shards' state was saved (``sparkdl.ps.positions``: a
        resumed fit's), for every shard of the layout; None: nowhere yet. ``min_workers``: the fewest workers the
        others go on with, where the rule makes them wait (ssp: ``ClockTracker``); None: all of them."""
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
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        for i, shard in enumerate(shards):
            if int(shard.size) < 0:
                raise ValueError(f"shard {i} has negative size {shard.size}")
        if first_shard < 0:
            raise ValueError(f"first_shard must be >= 0, got {first_shard}")
        if positions is not None and (
            positions.num_workers != num_workers or len(positions.next_steps) < first_shard + len(shards)
        ):
            raise ValueError(
                f"positions of {positions.num_workers} workers on {len(positions.next_steps)} shards, for a server of "
                f"{num_workers} workers hosting shards {first_shard}..{first_shard + len(shards) - 1}"
            )
        self.host = host
        self.rule = rule
        self.num_workers = num_workers
        self.timeout = float(timeout)
        self.serving = Serving(
            host=host,
            secret=bytes(secret),
            rule=rule,
            num_workers=num_workers,
            controller=num_workers if controller else None,  # the driver's client rank, if taken
            first_shard=int(first_shard),
            push_dtype=wire.push_dtype(compressions.check(compression)),
            timeout=self.timeout,
            handshake_timeout=float(handshake_timeout),
            max_pending=int(max_pending),
            encrypt=encrypt,  # seal every connection (sparkdl.net.secure): the session encrypts its RPC
        )
        self.tracker = rule.clocks(num_workers, spare=num_workers - (min_workers or num_workers))
        self.roster = rule.roster(num_workers, epoch_steps)
        self.counters = ServerCounters()
        self.attendance = Attendance(num_workers)
        if positions is None:
            workers = WorkerRows.unknown(num_workers)
            next_steps = [[UNKNOWN] * num_workers for _ in shards]
        else:
            workers = WorkerRows(positions.rows, positions.key_sums)
            next_steps = [list(positions.next_steps[first_shard + i]) for i in range(len(shards))]
        books = Bookkeeping(self.counters, self.attendance, self.tracker, workers, self.roster)
        self._books = books
        self._shards = [
            ShardServer(first_shard + i, shard, self.serving, books, next_steps[i]) for i, shard in enumerate(shards)
        ]
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
        self.attendance.stop()
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

    def positions(self) -> tuple[list[int], list[int], list[list[int]]]:
        """Where the workers stand: their training rows and their keys' sums (``UNKNOWN`` rows: not told yet), and
        per shard each worker's first step not applied (call it inside :meth:`holding_updates` for a state of one
        moment)."""
        rows, key_sums = self._books.workers.snapshot()
        return rows, key_sums, [shard.updates.next_steps() for shard in self._shards]

    def wait_finished(self, poll: float = 1.0) -> bool:
        """Waits until every worker has said DONE and had its answer (True), or the server stops (False): how a
        server task knows its job is over. Spark ends the server tasks of a stage that fails; should a worker vanish
        without that, a wait in which no worker sent a request for ``timeout`` seconds raises ``TimeoutError`` naming
        the workers that never said DONE."""
        return self.attendance.wait(self.timeout, self.indices, poll)

    @property
    def indices(self) -> list[int]:
        """The index of each shard it serves in the model's whole layout, in the order of ``addresses``."""
        return [shard.index for shard in self._shards]

    def epoch_saved(self, epoch: int) -> None:
        """``SyncRounds`` with ``epoch_steps``: the driver saved the state after ``epoch``, the next epoch's rounds may run."""
        if self.roster is not None:
            self.roster.epoch_saved(epoch)

    def step_saved(self) -> None:
        """``SyncRounds``: the driver saved the step checkpoint a worker held the rounds for (``Msg.HOLD``): the next
        rounds may run."""
        if self.roster is not None:
            self.roster.step_saved()

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
        protocol), ``clocks`` (pushes completed per worker id) and ``workers_set_aside`` (under ssp with
        ``min_workers``: the workers the others went on without, each time one was set aside); under sync_ps
        ``rounds`` (synchronous updates applied, per shard) and ``replayed_pushes``
        (pushes of steps applied already, from retried workers catching up, dropped;
        per shard).
        """
        clocks, max_seen, set_aside = self.tracker.snapshot()
        result: dict = self.counters.snapshot()
        result["refused_connections"] = sum(
            shard.listener.refused for shard in self._shards if shard.listener is not None
        )
        result["versions"] = [shard.version for shard in self._shards]
        for shard in self._shards:  # the rule's own counts, one per shard (SyncRounds': rounds, replayed pushes)
            for name, count in shard.updates.stats().items():
                result.setdefault(name, []).append(count)
        result["max_staleness"] = max_seen
        result["clocks"] = clocks
        result["workers_set_aside"] = set_aside
        return result
