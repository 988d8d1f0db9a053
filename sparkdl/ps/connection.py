"""One worker's connection to one parameter-server shard: the frames of its requests and the checks of its answers.

:class:`ShardConnection` sends a request's header and payload, reads the response's header and checks that it
answers that request (kind, type, sequence number, dtype, exact payload size), maps an error status to the
exception that names the worker, the shard and the setting to check (:class:`NonFiniteGradientError` for a
refused NaN or infinite push), and receives payloads exactly, into the caller's buffers.
:class:`~sparkdl.ps.client.ParameterClient` holds one per shard and drives them all at once.

Idle connections: the server closes a connection that has sent no request for
its ``timeout``; a connection idle for more than half of its client's
``timeout`` is therefore replaced by a fresh one before its next request (the
server keeps all state, so this is invisible to the caller).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np

from sparkdl.net.auth import ConnectGaveUp
from sparkdl.net.errors import CollectiveError, CollectiveTimeout
from sparkdl.net.frames import HEADER, FrameError, Header, Kind
from sparkdl.net.io import shutdown_and_close
from sparkdl.net.secure import Channel, connect_channel
from sparkdl.ps import protocol
from sparkdl.ps.protocol import FLOAT, Msg, Status


class NonFiniteGradientError(ValueError):
    """A worker pushed NaN or infinite gradients, which the parameter server refused (nothing was applied)."""


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    """What every shard connection of one worker's client connects and waits with (``ParameterClient``'s settings)."""

    worker: int
    secret: bytes
    timeout: float
    encrypt: bool  # seal the connections: the server does (its session encrypts its RPC)
    push_dtype: np.dtype  # the server's: what its pushes must carry
    wait_grace: float  # how much longer than timeout a pull or join may be held (sync_ps)


class ShardConnection:
    """One shard's connection; used by one thread at a time."""

    def __init__(self, client: ClientSettings, index: int, address: str, size: int):
        self.client = client
        self.index = index
        self.address = address
        self.size = size
        self.channel: Channel | None = None
        self.seq = 0
        self.last_used = 0.0
        self.version = 0
        # requests sent and payload bytes (headers excluded) each way, for benchmarks and tests of the patterns
        self.requests = self.bytes_sent = self.bytes_received = 0
        self.pushes = 0  # pushes the shard took
        self._header = bytearray(HEADER.size)
        self._send_error: OSError | None = None

    def where(self) -> str:
        return f"worker {self.client.worker}: shard {self.index} at {self.address}"

    def connect(self) -> None:
        timeout = self.client.timeout
        try:
            channel = connect_channel(
                self.address,
                self.client.worker,
                self.index,
                self.client.secret,
                timeout,
                encrypt=self.client.encrypt,
                peer_name=f"parameter server shard {self.index}",
            )
        except ConnectGaveUp as exc:
            raise CollectiveTimeout(
                f"{self.where()}: could not connect and authenticate within timeout={timeout}s "
                f"(last error: {exc.last_error}); check that the parameter server is running "
                f"and reachable at that address, that the addresses are in shard order, that "
                f"the worker id is below the server's num_workers, and that the worker uses the "
                f"job's secret"
            ) from None
        channel.sock.settimeout(timeout)
        self.channel = channel
        self.last_used = time.monotonic()

    def close(self) -> None:
        if self.channel is not None:
            shutdown_and_close(self.channel.sock)
            self.channel = None

    def request(self, msg: Msg, payload: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray | None:
        """Send one request and read its response; a pull's weights are returned (in ``out`` when given), a join's row
        counts in ``out``."""
        self.send(msg, payload)
        return self.receive(msg, out)

    def send(self, msg: Msg, payload: np.ndarray | None = None, step: int = 0, rows: int = 0) -> None:
        """First half of a request: the frame goes out, the response is left for :meth:`receive`."""
        if self.channel is None:
            raise CollectiveError(f"{self.where()}: the connection is closed")
        if time.monotonic() - self.last_used > self.client.timeout / 2:
            self.close()  # the server drops connections idle for `timeout`
            self.connect()
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        body = payload.view(np.uint8).data if payload is not None else b""
        header = Header(
            kind=Kind.REQUEST,
            op=msg,
            dtype=protocol.request_dtype(msg, self.client.push_dtype),
            seq=self.seq,
            value=step,  # a push's step (its rows under sync_ps), a hold's; 0 otherwise
            tag=rows,
            nbytes=len(body),
        ).pack()
        self._send_error = None
        with self._errors(msg):
            try:
                self.channel.send([header, body])
                self.requests, self.bytes_sent = self.requests + 1, self.bytes_sent + len(body)
            except OSError as exc:
                # The server may have refused the request and said why: receive() reads that first.
                self._send_error = exc
                self.channel.sock.settimeout(min(1.0, self.client.timeout))

    def receive(self, msg: Msg, out: np.ndarray | None = None) -> np.ndarray | None:
        """Second half of a request: read and check its response; a pull's weights land in ``out`` when given, a join's
        row counts in ``out`` (int64, one per worker), a resume's step in ``out`` (one int64)."""
        op = protocol.msg_name(msg)
        held = msg in (Msg.PULL, Msg.JOIN) and self.client.wait_grace > 0 and self._send_error is None
        with self._errors(msg):
            try:
                if held and self.channel is not None:  # the server may hold it for its timeout, then say why
                    self.channel.sock.settimeout(self.client.timeout + self.client.wait_grace)
                self._recv_exact(memoryview(self._header), op)
            except (OSError, CollectiveError):
                if self._send_error is not None:
                    raise self._send_error from None
                raise
            finally:
                if held and self.channel is not None:
                    self.channel.sock.settimeout(self.client.timeout)
            response = self._check_header(op, msg)
            status, length = response.status, response.nbytes
            if status != Status.OK:
                self._raise_status(op, status, length)
            if self._send_error is not None:
                raise self._send_error
            expected = protocol.expected_response_payload(msg, self.size, 0 if out is None else out.size)
            if msg == Msg.JOIN and length != expected:
                raise CollectiveError(
                    f"{self.where()}: join response has {length} payload bytes, expected {expected}: the row counts "
                    f"of {0 if out is None else out.size} workers; check that the server runs this job's num_workers"
                )
            if length != expected:
                raise CollectiveError(
                    f"{self.where()}: {op} response has {length} payload bytes, expected "
                    f"{expected}: the shard holds {length // FLOAT.itemsize} parameters but "
                    f"this client was given shard_sizes[{self.index}]={self.size}; check shard_sizes"
                )
            result = None
            if msg == Msg.PULL:
                result = np.empty(self.size, dtype=FLOAT) if out is None else out
                self._recv_exact(result.view(np.uint8).data, op)
            elif msg in (Msg.JOIN, Msg.RESUME) and out is not None:
                result = out
                self._recv_exact(result.view(np.uint8).data, op)
            self.bytes_received += length
            self.pushes += msg == Msg.PUSH
            self.version = response.value
            self.last_used = time.monotonic()
            return result

    def _check_header(self, op: str, msg: Msg) -> Header:
        """The response header just received, if it answers this request; else CollectiveError."""
        try:
            response = Header.unpack(self._header, source=f"parameter server shard {self.index} at {self.address}")
        except FrameError as exc:
            raise CollectiveError(
                f"{self.where()}: {op} got a malformed response ({exc}); check that the address is a sparkdl "
                f"parameter server of the same sparkdl version"
            ) from None
        if (
            response.kind != Kind.RESPONSE
            or response.op != msg
            or response.seq != self.seq
            or response.dtype != protocol.response_dtype(msg, response.status)
            or response.group
            or response.tag
        ):
            raise CollectiveError(
                f"{self.where()}: {op} got a malformed or out-of-order response "
                f"(kind {response.kind}, type {response.op}, dtype {response.dtype}, seq {response.seq}, "
                f"expected a {Kind.RESPONSE.name} to type {int(msg)} with seq {self.seq}); check that the "
                f"address is a sparkdl parameter server"
            )
        return response

    @contextlib.contextmanager
    def _errors(self, msg: Msg):
        """Turn socket errors into CollectiveError/CollectiveTimeout naming worker, shard and setting."""
        op = protocol.msg_name(msg)
        try:
            yield
        except TimeoutError:
            hint = (
                " (under mode='ssp' the server holds a pull while this worker is more than "
                "max_staleness pushes ahead of the slowest worker)"
                if msg == Msg.PULL
                else ""
            )
            raise CollectiveTimeout(
                f"{self.where()}: {op} timed out after timeout={self.client.timeout}s{hint}; "
                f"check that the parameter server (Spark driver) is alive and not overloaded, "
                f"or raise timeout"
            ) from None
        except OSError as exc:
            raise CollectiveError(
                f"{self.where()}: {op} failed: {exc}; check that the parameter server (Spark driver) is still running"
            ) from exc

    def _raise_status(self, op: str, status: int, length: int) -> None:
        if length > protocol.MAX_MESSAGE_BYTES:
            raise CollectiveError(
                f"{self.where()}: {op} failed with status {status} and an oversized error message ({length} bytes)"
            )
        text = bytearray(length)
        self._recv_exact(memoryview(text), op)
        message = text.decode("utf-8", "replace")
        if status == Status.STALENESS_TIMEOUT:
            raise CollectiveTimeout(f"{self.where()}: {op} refused under mode='ssp': {message}")
        if status == Status.ROUND_TIMEOUT:
            raise CollectiveTimeout(
                f"{self.where()}: {op} gave up waiting for other workers under mode='sync_ps': {message}"
            )
        if status == Status.BAD_REQUEST and message.startswith(protocol.NON_FINITE):
            raise NonFiniteGradientError(
                f"worker {self.client.worker}: push #{self.pushes + 1} (this worker's step that sent it) "
                f"holds NaN or infinite gradients, which the parameter server refused (shard {self.index}: "
                f"{message}); the training diverged: lower the learning rate, or check the data and the loss "
                f"for values that overflow"
            )
        if status == Status.STOPPING:
            raise CollectiveError(f"{self.where()}: {op} failed: {message}")
        raise CollectiveError(f"{self.where()}: {op} failed on the server: {message}")

    def _recv_exact(self, view: memoryview, op: str) -> None:
        if self.channel is None:
            raise CollectiveError(f"{self.where()}: {op} on a connection that is closed")
        if self.channel.recv_into(view) < len(view):
            raise CollectiveError(
                f"{self.where()}: the parameter server closed the connection during {op}; "
                f"check that the server is running and that shard_sizes and the secret "
                f"match the server's"
            )
