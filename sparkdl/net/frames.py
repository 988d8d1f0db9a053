"""The one frame header every sparkdl link that carries arrays speaks: collectives, messages, parameter server.

A frame is this fixed 40-byte header followed by ``nbytes`` of raw payload
(array bytes in native order, or a short UTF-8 message). Nothing received is
ever deserialised into objects: the receiver already knows (or checks) the
dtype and size it expects, and a header that is not a sparkdl frame of this
version is refused before anything is allocated from it.

=========  ======  ================================================================
field      type    meaning
=========  ======  ================================================================
magic      4s      ``SDLF``
version    u8      :data:`VERSION`; another version is refused, naming both
kind       u8      :class:`Kind`: what the frame is (which fields below matter)
op         u8      the operation (a collective's code, or a request type)
dtype      u8      payload dtype code (:func:`dtype_code`), 0 for bytes
status     u8      a response's status (0 = OK)
flags      u8      0 (reserved)
(pad)      u16     0
group      u32     the communicator (sub)group a collective frame belongs to
tag        u32     a message's tag
seq        u32     the operation's sequence number within its group or connection
value      u64     kind-specific: a parameter-server shard's version
nbytes     u64     payload bytes that follow
=========  ======  ================================================================
"""

from __future__ import annotations

import dataclasses
import enum
import struct

import numpy as np

MAGIC = b"SDLF"
VERSION = 1
HEADER = struct.Struct("!4sBBBBBBHIIIQQ")


class Kind(enum.IntEnum):
    """What a frame is: the receiver matches collectives by (group, seq), messages by (source, tag)."""

    COLLECTIVE = 1
    MESSAGE = 2
    #: a rank's communicator failed; the payload says why (UTF-8), and the receiver fails too
    ABORT = 3
    REQUEST = 4
    RESPONSE = 5
    #: a rank closed its communicator: nothing more comes on this link, and the rank has not failed
    CLOSE = 6


class FrameError(ConnectionError):
    """The bytes on a link are not a sparkdl frame of this version: the stream is corrupt or foreign."""


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    kind: int
    op: int
    nbytes: int
    dtype: int = 0
    status: int = 0
    group: int = 0
    tag: int = 0
    seq: int = 0
    value: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            VERSION,
            self.kind,
            self.op,
            self.dtype,
            self.status,
            0,
            0,
            self.group,
            self.tag,
            self.seq & 0xFFFFFFFF,
            self.value,
            self.nbytes,
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview, *, source: str) -> Header:
        """The header in ``data``, or :class:`FrameError` naming ``source`` when it is not one."""
        magic, version, kind, op, dtype, status, flags, pad, group, tag, seq, value, nbytes = HEADER.unpack(data)
        if magic != MAGIC:
            raise FrameError(f"corrupt frame from {source} (bad magic {magic!r}); the byte stream is out of sync")
        if version != VERSION:
            raise FrameError(
                f"frame from {source} is of wire version {version}, this sparkdl speaks {VERSION}: "
                "every worker and the driver must run the same sparkdl"
            )
        if flags or pad or kind not in _KINDS:
            raise FrameError(f"malformed frame from {source} (kind {kind}, flags {flags}, pad {pad})")
        return cls(kind, op, nbytes, dtype, status, group, tag, seq, value)


_KINDS = frozenset(Kind)


def _bfloat16() -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:  # the Horovod stack's TensorFlow 2.12 does not bring it
        return None
    return np.dtype(ml_dtypes.bfloat16)


#: The dtypes a frame can carry, by wire code (0: raw bytes); bfloat16 where ml_dtypes is installed.
DTYPES: tuple[np.dtype | None, ...] = (
    np.dtype("uint8"),
    *(
        np.dtype(name)
        for name in (
            "float16",
            "float32",
            "float64",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint16",
            "uint32",
            "uint64",
            "complex64",
            "complex128",
            "bool",
        )
    ),
    _bfloat16(),
)
_CODES = {dtype: code for code, dtype in enumerate(DTYPES) if dtype is not None}


def dtype_code(dtype) -> int:
    """Wire code of a dtype a frame can carry; TypeError naming the supported ones before anything is sent."""
    try:
        return _CODES[np.dtype(dtype)]
    except (KeyError, TypeError):
        supported = ", ".join(d.name for d in _CODES)
        raise TypeError(
            f"Expected an array of one of the dtypes {supported} (native byte order). Received: {dtype}"
        ) from None


def dtype_of(code: int) -> np.dtype:
    """The dtype of a wire code; FrameError for a code this sparkdl does not know."""
    dtype = DTYPES[code] if 0 <= code < len(DTYPES) else None
    if dtype is None:
        raise FrameError(f"unknown dtype code {code} in a frame")
    return dtype


def dtype_name(code: int) -> str:
    try:
        return dtype_of(code).name
    except FrameError:
        return f"unknown dtype code {code}"
