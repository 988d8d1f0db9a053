"""The relay's wire format, shared by the driver's :mod:`~sparkdl.launch.relay` and the tasks' :mod:`~sparkdl.launch.forward`.

A frame is a fixed header (kind, payload length) and at most ``MAX_FRAME_BYTES``
of payload: output text, a JSON error report or progress event, or a chunk of
a large payload (:mod:`sparkdl.launch.payloads` adds its own kinds). Nothing is
unpickled. Frames travel over a :class:`~sparkdl.net.secure.Channel`, sealed
when the session encrypts its RPC.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import threading
import traceback

from sparkdl.net.secure import Channel

HEADER = struct.Struct("!BI")  # kind, payload length
STDOUT, STDERR, ERROR, PROGRESS = 1, 2, 3, 4
MAX_FRAME_BYTES = 1 << 20
RELAY_ID = 0xFFFF_FFFE  # the "rank" the relay proves itself as; tasks authenticate as their partition index

# Failures that follow another rank's failure (its ring or Horovod peers vanished), or Spark's (the task's input
# lost with an executor: launch.errors.InputLost): Spark's own retry of the stage is the remedy, so they neither
# cancel the job nor hide the rank that failed first.
_SECONDARY_FAILURES = ("CollectiveError", "CollectiveTimeout", "ConnectGaveUp", "HorovodInternalError", "InputLost")
# TensorFlow reports an exception raised inside a tf.numpy_function (the ring's allreduce in the
# compiled train step) as its own error whose message holds a line "<TypeName>: <message>".
_WRAPPED_SECONDARY = re.compile(rf"^(?:[\w.]+\.)?(?:{'|'.join(_SECONDARY_FAILURES)}): ", re.M)


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """An exception raised in one rank's task, as text."""

    rank: int
    type_name: str
    message: str
    traceback: str

    @property
    def secondary(self) -> bool:
        return (
            self.type_name.rsplit(".", 1)[-1] in _SECONDARY_FAILURES
            or _WRAPPED_SECONDARY.search(self.message) is not None
        )

    @property
    def summary(self) -> str:
        """The error in one line: ``Type: message``, the sparkdl error TensorFlow wrapped where it did."""
        wrapped = _WRAPPED_SECONDARY.search(self.message)
        if wrapped is not None:
            return self.message[wrapped.start() :].splitlines()[0]
        return f"{self.type_name.rsplit('.', 1)[-1]}: {(self.message.splitlines() or [''])[0]}"

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> ErrorReport:
        kind = type(exc)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        return cls(rank, name, str(exc), "".join(traceback.format_exception(exc)))

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()[:MAX_FRAME_BYTES]

    @classmethod
    def from_json(cls, payload: bytes) -> ErrorReport:
        """The report in ``payload``; ValueError when it is not a JSON object with every field."""
        try:
            fields = json.loads(payload.decode("utf-8", "replace"))
            return cls(int(fields["rank"]), str(fields["type_name"]), str(fields["message"]), str(fields["traceback"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"Expected an error report: a JSON object with rank, type_name, message and "
                f"traceback. Received: {payload[:200]!r} ({type(exc).__name__}: {exc})"
            ) from None


def send_frame(channel: Channel, kind: int, data, *, stopping: threading.Event | None = None) -> None:
    """One frame of ``kind`` holding ``data`` (at most ``MAX_FRAME_BYTES``); see :meth:`Channel.send` for ``stopping``."""
    channel.send([HEADER.pack(kind, len(data)), data], stopping=stopping)


def recv_bytes(channel: Channel, size: int, stopping: threading.Event | None) -> bytes | None:
    """``size`` bytes, or None when the peer closed cleanly before the first byte (or the relay stops)."""
    buffer = bytearray(size)
    return bytes(buffer) if recv_into(channel, memoryview(buffer), stopping) else None


def recv_into(channel: Channel, view: memoryview, stopping: threading.Event | None) -> bool:
    """Fills ``view``; False when the peer closed cleanly before the first byte (or ``stopping`` is set).

    Without ``stopping`` (a task's side) the socket's timeout ends the wait with ``TimeoutError``;
    with it (the driver's side, short socket timeouts) the wait lasts until the relay stops.
    """
    received = channel.recv_into(view, stopping=stopping)
    if received == len(view):
        return True
    if received and not (stopping is not None and stopping.is_set()):
        raise ValueError(f"connection closed in the middle of a frame ({received} of {len(view)} bytes)")
    return False
