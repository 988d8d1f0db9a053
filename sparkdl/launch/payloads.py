"""Large bytes between the driver and its tasks, kept out of the JVMs: chunks over the relay's connection.

A task's result (the trained ``.keras`` archive, a history) goes up and a
payload the driver offers (the model to train) comes down over the task's
authenticated connection to the driver's output relay, in frames of at most
``MAX_FRAME_BYTES``, into one buffer (sizes are checked, nothing is unpickled).
Neither direction passes through a JVM heap, Spark's task results
(``spark.driver.maxResultSize``) or a Spark Connect message, so no Spark
setting limits their size; the driver's and the tasks' Python processes hold
them in memory. An upload's buffer grows as its bytes arrive, never beyond the
size the task announced, so an announcement costs the driver nothing until the
bytes come; one beyond the driver's physical memory (``MAX_RESULT_BYTES``) is
refused at once, naming the rank and the size.

Results are kept by partition AND task attempt: a task uploads before it
reports success (its small result row names its attempt), and the driver keeps
only the attempt Spark kept, so a payload of a failed or retried attempt never
mixes with the successful one. Every upload is acknowledged: a task whose
result did not arrive fails, and Spark retries it like any failed task.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Mapping

from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.relay_frames import MAX_FRAME_BYTES, recv_bytes, recv_into, send_frame
from sparkdl.net.secure import Channel

_log = logging.getLogger(__name__)

# Frame kinds on the relay's connection, after the relay's own (output, errors, progress).
_RESULT, _CHUNK, _FETCH, _REPLY = 5, 6, 7, 8  # task -> driver: _RESULT, _FETCH, _CHUNK; driver -> task: _REPLY, _CHUNK


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): no limit beyond what a bytearray holds
        return sys.maxsize


#: The largest result an upload may announce: the driver's physical memory, which holds a result whole
#: (a larger announcement could never be received, only cost the driver until it fails).
MAX_RESULT_BYTES = _physical_memory()


class PayloadExchange:
    """Driver side: serves the payloads tasks fetch, keeps the results they upload by partition and attempt."""

    def __init__(self, offered: Mapping[str, bytes] | None = None):
        self._offered = dict(offered or {})
        self._lock = threading.Lock()
        self._results: dict[tuple[int, int], bytearray] = {}

    def open(self, rank: int) -> _Session:
        """The handler of one task connection (the relay calls it for the frame kinds it names)."""
        return _Session(self, rank)

    def take(self, partition: int, attempt: int, size: int) -> bytearray:
        """The result ``partition``'s task attempt ``attempt`` uploaded, which its result row says is ``size`` bytes."""
        with self._lock:
            result = self._results.pop((partition, attempt), None)
        if result is None:
            raise RuntimeError(
                f"Partition {partition}'s task (attempt {attempt}) finished, but its {size}-byte result "
                "never reached the driver's relay."
            )
        if len(result) != size:
            raise RuntimeError(
                f"Partition {partition}'s task (attempt {attempt}) reported a {size}-byte result, but "
                f"the driver's relay received {len(result)} bytes."
            )
        return result

    def take_if_uploaded(self, partition: int, attempt: int) -> bytearray | None:
        """The result ``partition``'s task attempt ``attempt`` uploaded; None where it uploaded none."""
        with self._lock:
            return self._results.pop((partition, attempt), None)

    def discard_rest(self) -> None:
        """Drops the results of attempts Spark did not keep (failed, retried or speculative ones)."""
        with self._lock:
            rest, self._results = self._results, {}
        for (partition, attempt), result in sorted(rest.items()):
            _log.debug(
                "sparkdl: dropped the %d-byte result of partition %d, task attempt %d (an attempt Spark did not keep)",
                len(result),
                partition,
                attempt,
            )

    def _keep(self, partition: int, attempt: int, result: bytearray) -> None:
        with self._lock:
            self._results[(partition, attempt)] = result
        _log.debug(
            "sparkdl: received the %d-byte result of partition %d, task attempt %d", len(result), partition, attempt
        )


class _Session:
    """One task connection's payload frames: at most one upload at a time, fetches answered in full."""

    KINDS = (_RESULT, _CHUNK, _FETCH)

    def __init__(self, exchange: PayloadExchange, rank: int):
        self._exchange = exchange
        self._rank = rank
        self._upload: tuple[int, int] | None = None  # attempt, announced size
        self._buffer = bytearray()  # what arrived of the upload so far
        self._frame = bytearray()  # where a chunk lands before it joins the buffer (allocated at the first one)

    def handle(self, channel: Channel, kind: int, length: int, stopping: threading.Event) -> None:
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"rank {self._rank} sent a malformed frame (kind {kind}, {length} bytes)")
        if kind == _CHUNK:
            self._receive_chunk(channel, length, stopping)
            return
        message = recv_bytes(channel, length, stopping)
        if message is None:
            return
        if kind == _RESULT:
            try:
                header = json.loads(message)
                attempt, size = int(header["attempt"]), int(header["size"])
            except (KeyError, TypeError) as exc:
                raise ValueError(f"rank {self._rank} announced a result with a malformed header: {exc!r}") from None
            self._begin(channel, attempt, size, stopping)
        else:
            self._serve(channel, message.decode("utf-8", "replace"), stopping)

    def close(self) -> None:
        """The connection ended: an unfinished upload is dropped with this session (its attempt failed)."""

    def _begin(self, channel: Channel, attempt: int, size: int, stopping: threading.Event) -> None:
        if self._upload is not None:
            raise ValueError(f"rank {self._rank} announced a result of {size} bytes in the middle of another one")
        if not 0 <= size <= MAX_RESULT_BYTES:
            raise ValueError(
                f"Expected rank {self._rank}'s result to be 0 to {MAX_RESULT_BYTES:,} bytes (the driver's physical "
                f"memory, which holds a result whole). Received: an announced size of {size:,} bytes"
            )
        self._upload = (attempt, size)
        self._complete_if_done(channel, stopping)

    def _receive_chunk(self, channel: Channel, length: int, stopping: threading.Event) -> None:
        if self._upload is None:
            raise ValueError(f"rank {self._rank} sent result bytes without announcing a result")
        size = self._upload[1]
        if length > size - len(self._buffer):
            raise ValueError(f"rank {self._rank} sent more bytes than the {size} it announced")
        if not self._frame:
            self._frame = bytearray(MAX_FRAME_BYTES)
        with memoryview(self._frame)[:length] as chunk:
            if not recv_into(channel, chunk, stopping):
                raise ValueError(f"rank {self._rank}'s result was cut off")
            self._buffer += chunk  # grown as the bytes arrive (a MemoryError drops the connection)
        self._complete_if_done(channel, stopping)

    def _complete_if_done(self, channel: Channel, stopping: threading.Event) -> None:
        assert self._upload is not None, "called once the upload has started"
        attempt, size = self._upload
        if len(self._buffer) < size:
            return
        self._exchange._keep(self._rank, attempt, self._buffer)
        self._upload, self._buffer, self._frame = None, bytearray(), bytearray()
        _send_frame(channel, _REPLY, json.dumps({"received": True}).encode(), stopping)

    def _serve(self, channel: Channel, name: str, stopping: threading.Event) -> None:
        payload = self._exchange._offered.get(name)
        if payload is None:
            answer = {
                "error": f"The driver offers no payload named {name!r}; it offers {sorted(self._exchange._offered)}."
            }
            _send_frame(channel, _REPLY, json.dumps(answer).encode(), stopping)
            return
        _send_frame(channel, _REPLY, json.dumps({"size": len(payload)}).encode(), stopping)
        view = memoryview(payload)
        for start in range(0, len(view), MAX_FRAME_BYTES):
            _send_frame(channel, _CHUNK, view[start : start + MAX_FRAME_BYTES], stopping)


def _send_frame(channel: Channel, kind: int, data, stopping: threading.Event) -> None:
    """Driver side: the socket's timeouts are short so that a slow task cannot outlast the relay."""
    try:
        send_frame(channel, kind, data, stopping=stopping)
    except ConnectionAbortedError:
        raise ConnectionAbortedError("the relay stopped while sending a payload") from None


def upload(reporter: TaskReporter, payload: bytes, attempt: int) -> None:
    """Inside a task: sends ``payload`` as the result of task attempt ``attempt``; returns once the driver has it."""
    connection = reporter.connection
    connection.send(_RESULT, json.dumps({"attempt": attempt, "size": len(payload)}).encode(), must_arrive=True)
    connection.send(_CHUNK, payload, must_arrive=True)
    if not _reply(reporter).get("received"):
        raise ConnectionError("The driver's relay did not acknowledge this task's result.")


def fetch(reporter: TaskReporter, name: str) -> bytearray:
    """Inside a task: the payload the driver offers as ``name`` (``run_tasks(..., offered={name: ...})``)."""
    connection = reporter.connection
    connection.send(_FETCH, name.encode(), must_arrive=True)
    answer = _reply(reporter)
    if "error" in answer:
        raise ValueError(answer["error"])
    buffer = bytearray(int(answer["size"]))
    view = memoryview(buffer)
    while len(view):
        kind, length = connection.receive_header()
        if kind != _CHUNK or not 0 < length <= min(len(view), MAX_FRAME_BYTES):
            raise ConnectionError(
                f"The driver's relay sent a malformed frame (kind {kind}, {length} bytes) while sending {name!r}."
            )
        connection.receive_into(view[:length])
        view = view[length:]
    return buffer


def _reply(reporter: TaskReporter) -> dict:
    kind, length = reporter.connection.receive_header()
    if kind != _REPLY or length > MAX_FRAME_BYTES:
        raise ConnectionError(f"The driver's relay sent a malformed frame (kind {kind}, {length} bytes).")
    message = bytearray(length)
    reporter.connection.receive_into(memoryview(message))
    return json.loads(message)
