"""Worker side of the parameter server: one authenticated connection per shard.

``pull`` and ``push`` talk to all shards at once (one thread per shard).  Every
wait is bounded by ``timeout``; every failure raises
:class:`~sparkdl.net.errors.CollectiveError` (or
:class:`~sparkdl.net.errors.CollectiveTimeout`) naming the worker, the shard
and its address, the operation and the setting to check.  After a failure the
client is unusable (the byte stream of the failed connection is in an unknown
state); a retried Spark task simply creates a new client with the same worker id.
A push holding NaN or infinity is refused by the server before anything is
applied; the client raises :class:`NonFiniteGradientError` naming the worker
and its push. With ``compression`` ("bf16" or "fp16", the server's too) pushes
travel at half the bytes: a gradient already of that dtype is sent as it is, a
float32 one is narrowed here (``sparkdl.collective.compression``, which refuses a
value beyond float16's range); pulls always return float32 weights, into the
caller's buffers when it passes them. A synchronous server (``mode="sync_ps"``)
takes each push with its step and rows, is joined once before the first push
(:meth:`ParameterClient.join`), and holds a pull until the step's update is
applied; ``wait_grace`` lets such a pull (or join) wait that much longer than
``timeout``, so that the server's own timeout, whose answer names the workers
it waited for, comes first. Where the shards run in servers of their own
(``server_placement="executors"``: one Spark task each), each keeps its own
clocks and roster, so a client made with ``separate_servers`` joins and says
DONE to every shard, not to shard 0 alone.

:func:`fetch_state` is the controller's side (the driver's): one shard's whole
state, for a checkpoint, of exactly the size the driver computes itself.

Each shard's connection, its frames, checks and error messages, is a
:class:`~sparkdl.ps.connection.ShardConnection`; this module drives them all at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from sparkdl.collective import compression as compressions
from sparkdl.net.auth import ConnectGaveUp
from sparkdl.net.errors import CollectiveError, CollectiveTimeout
from sparkdl.net.frames import HEADER, FrameError, Header, Kind
from sparkdl.net.io import shutdown_and_close
from sparkdl.net.secure import connect_channel
from sparkdl.ps import protocol, wire
from sparkdl.ps.connection import ClientSettings, NonFiniteGradientError, ShardConnection
from sparkdl.ps.protocol import FLOAT, Msg, Status

#: Shards of more bytes than this are sent and received by one thread each (smaller ones are
#: pipelined from the calling thread, which measured as fast or faster on 2 cores).
THREADED_BYTES = 8 << 20


class ParameterClient:
    """Connection of one worker to every shard of a :class:`~sparkdl.ps.server.ParameterServer`."""

    def __init__(
        self,
        addresses: list[str],
        *,
        worker: int,
        secret: bytes,
        shard_sizes: list[int],
        timeout: float = 600.0,
        encrypt: bool = False,
        compression: str | None = None,
        wait_grace: float = 0.0,
        separate_servers: bool = False,
    ):
        if len(addresses) != len(shard_sizes):
            raise ValueError(f"{len(addresses)} shard addresses but {len(shard_sizes)} shard_sizes")
        if not addresses:
            raise ValueError("addresses must name at least one shard")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.worker = int(worker)
        self.compression = compressions.check(compression)  # the server's: what its pushes must carry
        self.push_dtype = wire.push_dtype(compression)
        self.shard_sizes = [int(s) for s in shard_sizes]
        self.separate_servers = separate_servers  # each shard its own server: join and DONE go to every shard
        settings = ClientSettings(
            worker=self.worker,
            secret=bytes(secret),
            timeout=float(timeout),
            encrypt=encrypt,
            push_dtype=self.push_dtype,
            wait_grace=float(wait_grace),
        )
        self._conns = [ShardConnection(settings, i, a, s) for i, (a, s) in enumerate(zip(addresses, self.shard_sizes))]
        self._pool = (
            ThreadPoolExecutor(len(self._conns), thread_name_prefix=f"ps-worker{worker}")
            if len(self._conns) > 1
            else None
        )
        self._failed: Exception | None = None
        self.pushes = 0  # pushes completed
        self._next_step = 0  # the step a push names where its caller names none: where it resumed, then one a push
        try:
            self._each(lambda conn: conn.connect())
        except BaseException:
            self.close()
            raise

    @property
    def versions(self) -> list[int]:
        """Per-shard update counts as of this client's last response from each shard."""
        return [conn.version for conn in self._conns]

    def traffic(self) -> list[tuple[int, int, int]]:
        """(payload bytes sent, payload bytes received, requests) so far on each shard's connection, by shard."""
        return [(conn.bytes_sent, conn.bytes_received, conn.requests) for conn in self._conns]

    def pull(self, out: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Current float32 weights of every shard (fetched concurrently), received into ``out``'s arrays when given
        (one writable, C-contiguous float32 array of each shard's size)."""
        if out is not None:
            if len(out) != len(self._conns):
                raise ValueError(f"worker {self.worker}: pull got {len(out)} buffers for {len(self._conns)} shards")
            for i, (buffer, size) in enumerate(zip(out, self.shard_sizes)):
                if buffer.dtype != FLOAT or buffer.shape != (size,) or not buffer.flags.c_contiguous:
                    raise ValueError(
                        f"worker {self.worker}: pull buffer {i} must be a C-contiguous float32 array of shape "
                        f"({size},), shard_sizes[{i}]; got {buffer.dtype} of shape {buffer.shape}"
                    )
        return self._exchange(Msg.PULL, None, out)

    def join(self, rows: int, num_workers: int) -> list[int]:
        """sync_ps, before the first push: tells the server this worker's training rows and returns every worker's
        (``num_workers`` of them), once all have joined."""
        if self.separate_servers:  # every shard's roster: each answers with the same counts
            request = np.array([rows], protocol.ROWS)
            answers = [np.empty(num_workers, protocol.ROWS) for _ in self._conns]
            self._exchange(Msg.JOIN, [request] * len(self._conns), answers)
            if any(not np.array_equal(answer, answers[0]) for answer in answers):
                raise CollectiveError(
                    f"worker {self.worker}: the shards answered its join with different row counts "
                    f"{[a.tolist() for a in answers]}: they are not the servers of one job"
                )
            return [int(n) for n in answers[0]]
        counts = np.empty(num_workers, protocol.ROWS)
        self._run(self._conns[0], lambda conn: conn.request(Msg.JOIN, np.array([rows], protocol.ROWS), counts))
        return [int(n) for n in counts]

    def resume(self, rows: int, key_sum: int) -> list[int]:
        """Before the first push: tells every shard this worker's training rows and their keys' sum
        (``sparkdl.position.key_sum``) and returns, per shard, the first of its steps the shard has not applied
        (``sparkdl.ps.positions.UNKNOWN`` for none): where it resumes."""
        told = np.array([rows, np.uint64(key_sum).view(np.int64)], protocol.ROWS)
        answers = [np.empty(1, protocol.ROWS) for _ in self._conns]
        self._exchange(Msg.RESUME, [told] * len(self._conns), answers)
        steps = [int(answer[0]) for answer in answers]
        self._next_step = min((step for step in steps if step >= 0), default=0)
        return steps

    def hold(self, step: int) -> None:
        """sync_ps, before the push of ``step``: asks every shard to hold the rounds after it until the driver has
        saved a step checkpoint of the state after it."""
        self._exchange(Msg.HOLD, None, step=step)

    def push(self, gradients: list[np.ndarray], *, step: int | None = None, rows: int = 0) -> None:
        """Send one gradient per shard (concurrently); advances this worker's clock by one.

        Each is sent as the server's push dtype: one already of that dtype as it is, any other
        converted to float32 and, under ``compression``, narrowed. ``step``: the worker's global step it belongs to
        (the last it sums), which a shard that applied it already drops (``sparkdl.ps.positions``; None: the step
        after the previous push's, from where :meth:`resume` said, or 0); a synchronous server (sync_ps) takes it as
        this worker's part of that step, weighed by its ``rows`` training rows.
        """
        if len(gradients) != len(self._conns):
            raise ValueError(f"worker {self.worker}: push got {len(gradients)} gradients for {len(self._conns)} shards")
        flat = []
        for i, (gradient, size) in enumerate(zip(gradients, self.shard_sizes)):
            array = np.asarray(gradient).reshape(-1)
            if array.dtype != self.push_dtype:
                array = np.asarray(array, dtype=FLOAT)
                if self.compression is not None:
                    array = compressions.narrow(array, self.compression)
            array = np.ascontiguousarray(array)
            if array.size != size:
                raise ValueError(
                    f"worker {self.worker}: gradient for shard {i} has {array.size} values, shard_sizes[{i}] is {size}"
                )
            flat.append(array)
        step = self._next_step if step is None else step
        self._exchange(Msg.PUSH, flat, step=step, rows=rows)
        self.pushes += 1
        self._next_step = step + 1

    def done(self) -> None:
        """This worker has finished; under ssp it no longer holds back the others."""
        if self.separate_servers:  # each server's own clocks, and each server task waits for every worker's DONE
            self._exchange(Msg.DONE, None)
            return
        # Clocks live in one tracker shared by all shards of the server; shard 0 owns them.
        self._run(self._conns[0], lambda conn: conn.request(Msg.DONE))

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> ParameterClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _run(self, conn: ShardConnection, fn):
        if self._failed is not None:
            raise CollectiveError(
                f"worker {self.worker}: this ParameterClient failed earlier ({self._failed}); create a new one"
            )
        try:
            return fn(conn)
        except (CollectiveError, NonFiniteGradientError) as exc:
            self._failed = exc
            raise

    def _exchange(
        self,
        msg: Msg,
        payloads: list[np.ndarray] | None,
        out: list[np.ndarray] | None = None,
        *,
        step: int = 0,
        rows: int = 0,
    ) -> list:
        """One request to every shard, all shards working at once.

        Small messages are pipelined from this thread: every request goes out
        before any response is read (the server answers only after reading a
        whole request, so this cannot deadlock), which avoids a thread hand-off
        per shard.  Shards of more than ``THREADED_BYTES`` parameters bytes get
        one thread each, so that their copies run in parallel.
        """

        def payload(conn: ShardConnection) -> np.ndarray | None:
            return None if payloads is None else payloads[conn.index]

        def buffer(conn: ShardConnection) -> np.ndarray | None:
            return None if out is None else out[conn.index]

        if self._pool is not None and max(self.shard_sizes) * FLOAT.itemsize > THREADED_BYTES:
            return self._each(lambda conn: self._request(conn, msg, payload(conn), buffer(conn), step, rows))
        if self._failed is not None:
            raise CollectiveError(
                f"worker {self.worker}: this ParameterClient failed earlier ({self._failed}); create a new one"
            )
        try:
            for conn in self._conns:
                conn.send(msg, payload(conn), step, rows)
            return [conn.receive(msg, buffer(conn)) for conn in self._conns]
        except (CollectiveError, NonFiniteGradientError) as exc:
            self._failed = exc
            raise

    @staticmethod
    def _request(conn: ShardConnection, msg: Msg, payload, out, step: int, rows: int):
        conn.send(msg, payload, step, rows)
        return conn.receive(msg, out)

    def _each(self, fn) -> list:
        """Run ``fn`` on every shard's connection concurrently; first error wins."""
        if self._failed is not None:
            raise CollectiveError(
                f"worker {self.worker}: this ParameterClient failed earlier ({self._failed}); create a new one"
            )
        if self._pool is None:
            return [self._run(self._conns[0], fn)]
        futures = [self._pool.submit(fn, conn) for conn in self._conns]
        results, error = [], None
        for future in futures:  # wait for all, so no thread still uses a socket afterwards
            try:
                results.append(future.result())
            except BaseException as exc:
                error = error or exc
        if error is not None:
            if isinstance(error, (CollectiveError, NonFiniteGradientError)):
                self._failed = error
            raise error
        return results


def fetch_state(
    address: str,
    *,
    shard: int,
    controller: int,
    secret: bytes,
    nbytes: int,
    epochs: int = 0,
    timeout: float = 600.0,
    encrypt: bool = False,
    positions: np.ndarray | None = None,
) -> bytearray:
    """The controller's request (the driver's): shard ``shard``'s whole state at ``address``, its variables and its
    optimizer's end to end (``OptimizerShard.state``), exactly ``nbytes`` bytes, which the caller computes from its
    own copy of the shard; ``controller``: the rank the server takes it as (its ``num_workers``). ``epochs``: the
    complete epochs the state is after, 0 for a step checkpoint (a synchronous server then runs the next epoch's
    rounds, or those after the step it held). The workers' positions on the shard that follow the state in the
    answer (``protocol.positions_nbytes``: each worker's next step, its rows, their keys' sum) land in
    ``positions`` where given (int64, three per worker)."""
    where = f"the driver: shard {shard} at {address}"
    try:
        channel = connect_channel(
            address,
            controller,
            shard,
            secret,
            timeout,
            encrypt=encrypt,
            peer_name=f"parameter server shard {shard}",
            refused_is_final=True,  # it was serving: a refusal means its task has ended
        )
    except ConnectGaveUp as exc:
        raise CollectiveTimeout(
            f"{where}: could not connect and authenticate within timeout={timeout}s to read its state for a "
            f"checkpoint (last error: {exc.last_error}); with server_placement='executors' the driver must reach the "
            "executors' addresses"
        ) from None
    try:
        channel.sock.settimeout(timeout)
        header = Header(kind=Kind.REQUEST, op=Msg.STATE, seq=1, value=epochs, nbytes=0).pack()
        channel.send([header, b""])
        raw = bytearray(HEADER.size)
        if channel.recv_into(memoryview(raw)) < len(raw):
            raise CollectiveError(f"{where}: the server closed the connection before answering the state request")
        try:
            response = Header.unpack(raw, source=f"parameter server shard {shard} at {address}")
        except FrameError as exc:
            raise CollectiveError(f"{where}: a malformed answer to the state request ({exc})") from None
        if response.kind != Kind.RESPONSE or response.op != Msg.STATE or response.seq != 1 or response.dtype:
            raise CollectiveError(f"{where}: an answer that is not the state request's ({response})")
        if response.status != Status.OK:
            if response.nbytes > protocol.MAX_MESSAGE_BYTES:
                raise CollectiveError(f"{where}: status {response.status} and an oversized error message")
            text = bytearray(response.nbytes)
            channel.recv_into(memoryview(text))
            raise CollectiveError(f"{where}: the state request failed: {text.decode('utf-8', 'replace')}")
        positions = np.empty(3 * controller, protocol.ROWS) if positions is None else positions
        if positions.dtype != protocol.ROWS or positions.shape != (3 * controller,):
            raise ValueError(f"positions must be an int64 array of shape ({3 * controller},): {positions.shape}")
        if response.nbytes != nbytes + positions.nbytes:
            raise CollectiveError(
                f"{where}: the state answer announced {response.nbytes} bytes, but the shard's variables and its "
                f"optimizer's hold exactly {nbytes}, and the positions of {controller} workers {positions.nbytes}: "
                "the server holds another model or optimizer, or serves another number of workers"
            )
        state = bytearray(nbytes)
        if (
            channel.recv_into(memoryview(state)) < nbytes
            or channel.recv_into(positions.view(np.uint8).data) < positions.nbytes
        ):
            raise CollectiveError(f"{where}: the server closed the connection while sending the state")
        return state
    except TimeoutError:
        raise CollectiveTimeout(f"{where}: the state request timed out after timeout={timeout}s") from None
    except OSError as exc:
        raise CollectiveError(f"{where}: the state request failed: {exc}") from exc
    finally:
        shutdown_and_close(channel.sock)
