"""Wire format of the parameter server.

A connection starts with the network layer's mutual HMAC-SHA256
challenge/response (:mod:`sparkdl.net.auth`): the client proves
the job secret as "rank" = its worker id towards "rank" = the shard index, so a
client that mixes up shard addresses fails authentication too.  After that the
client sends requests and the server answers each one, in order:

request  = ``_REQUEST``  header (magic, type, 0, 0, seq, payload bytes) + payload
response = ``_RESPONSE`` header (magic, type, status, 0, seq, shard version, payload bytes) + payload

All integers are big-endian.  Payloads are raw float32 bytes in native
(little-endian on every supported platform) order, never pickled objects:

========  =====================================  ==========================================
type      request payload                        OK response payload
========  =====================================  ==========================================
PULL      none                                   the shard's weights, exactly 4*size bytes
PUSH      one gradient, exactly 4*size bytes     none
DONE      none                                   none
========  =====================================  ==========================================

The server knows the exact payload size of every request type in advance and
closes the connection on any other header (bad magic, unknown type, non-zero
reserved fields, any other length) without allocating from the announced
length.  A push holding NaN or infinity is answered with ``BAD_REQUEST`` and
a message starting with ``NON_FINITE``; nothing of it is applied and the
connection stays usable.  A response with a non-OK status carries a short UTF-8 message
(at most ``MAX_MESSAGE_BYTES``) that the client puts into its exception.
"""

from __future__ import annotations

import enum
import struct

import numpy as np

REQUEST_MAGIC = b"SDLP"
RESPONSE_MAGIC = b"SDLR"

#: magic, type, reserved (0), reserved (0), sequence number, payload bytes
REQUEST = struct.Struct("!4sBBHIQ")
#: magic, type, status, reserved (0), sequence number, shard version, payload bytes
RESPONSE = struct.Struct("!4sBBHIQQ")

#: Start of the BAD_REQUEST message refusing a push that holds NaN or infinity.
NON_FINITE = "non-finite gradient"

#: Longest error message a response may carry; the client rejects longer ones.
MAX_MESSAGE_BYTES = 1024

FLOAT = np.dtype("<f4")


class Msg(enum.IntEnum):
    PULL = 1
    PUSH = 2
    DONE = 3


class Status(enum.IntEnum):
    OK = 0
    #: an ssp pull waited ``timeout`` seconds for the slowest worker
    STALENESS_TIMEOUT = 1
    #: the request was malformed (e.g. a gradient of the wrong size); the server closes the connection
    BAD_REQUEST = 2
    #: the shard raised while reading or applying
    SHARD_ERROR = 3
    #: the server is stopping
    STOPPING = 4


def msg_name(code: int) -> str:
    try:
        return Msg(code).name.lower()
    except ValueError:
        return f"unknown message type {code}"


def expected_request_payload(msg: int, shard_size: int) -> int | None:
    """Exact payload bytes of a request, or None if ``msg`` is not a request type."""
    if msg == Msg.PUSH:
        return FLOAT.itemsize * shard_size
    if msg in (Msg.PULL, Msg.DONE):
        return 0
    return None


def pack_request(msg: Msg, seq: int, payload_bytes: int) -> bytes:
    return REQUEST.pack(REQUEST_MAGIC, msg, 0, 0, seq & 0xFFFFFFFF, payload_bytes)


def pack_response(msg: int, status: Status, seq: int, version: int, payload_bytes: int) -> bytes:
    return RESPONSE.pack(RESPONSE_MAGIC, msg, status, 0, seq, version, payload_bytes)
