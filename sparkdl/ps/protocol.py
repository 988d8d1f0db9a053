"""What the parameter server says over the one sparkdl frame (:mod:`sparkdl.net.frames`).

A connection starts with the network layer's mutual HMAC-SHA256
challenge/response (:mod:`sparkdl.net.auth`): the client proves
the job secret as "rank" = its worker id towards "rank" = the shard index, so a
client that mixes up shard addresses fails authentication too.  After that the
client sends requests and the server answers each one, in order, every one a
:class:`~sparkdl.net.frames.Header` (packed and unpacked by it alone) and its payload:

request  = ``Header(kind=REQUEST, op=Msg, dtype=request_dtype(op), seq, nbytes)`` + payload
response = ``Header(kind=RESPONSE, op=Msg, status=Status, dtype, seq, value=shard version, nbytes)`` + payload

``seq`` counts a connection's requests (from 1, wrapping at 2**32); a response
repeats its request's ``op`` and ``seq``.  Every other header field
(``status`` of a request, ``group``, ``tag``, ``value`` of a request) is 0,
except a push's ``value``, the worker's global step the gradient belongs to (the
last of the steps it sums, with ``push_every``: :mod:`sparkdl.ps.positions`), and,
to a synchronous server (``mode="sync_ps"``, :mod:`sparkdl.ps.rules`), its ``tag``,
the training rows behind it (0 for a filler step), which weigh it in the step's mean;
a hold's ``value``, the step after which a synchronous server's rounds wait; and a
state request's ``value``, the complete epochs the state is taken after (0: a step
checkpoint's).
Payloads are raw array bytes in native (little-endian on every supported
platform) order, never pickled objects. A push carries the server's push dtype:
float32, or the half-width dtype of its ``compression`` (bfloat16 or float16,
:mod:`sparkdl.ps.wire`); pulled weights are always float32:

========  ============================================  =================================================
op        request payload (``dtype``)                   OK response payload (``dtype``)
========  ============================================  =================================================
PULL      none (0)                                      the shard's weights, exactly 4*size bytes
                                                        (``dtype_code(float32)``)
PUSH      one gradient, exactly itemsize*size bytes     none (0)
          (``dtype_code(push dtype)``)
DONE      none (0)                                      none (0)
JOIN      this worker's training rows, exactly 8 bytes  every worker's training rows, exactly
          (``dtype_code(int64)``; sync_ps only, to      8*num_workers bytes (``dtype_code(int64)``), once
          shard 0, or to every shard of servers that    every worker has joined
          run apart)
STATE     none (0); from the controller only            the shard's weights, then its optimizer's
                                                        variables, each in its own dtype, end to end:
                                                        exactly the size both sides compute from the
                                                        shard's variables, then the workers' positions
                                                        on it (:func:`positions_nbytes`; raw bytes, 0)
RESUME    this worker's training rows and their keys'   the first of this worker's steps the shard has
          sum, exactly 16 bytes (``dtype_code(int64)``) not applied, -1 for none, exactly 8 bytes
                                                        (``dtype_code(int64)``)
HOLD      none (0); sync_ps only, from a worker that    none (0)
          asks for a step checkpoint after ``value``
========  ============================================  =================================================

STATE is how the driver checkpoints shards that run in Spark tasks of their own
(``server_placement="executors"``): it connects as the *controller*, an extra
client rank (``num_workers``) that a server takes only when it was started with
``controller=True``; the controller sends STATE only and a worker never does. The
state is read under the shard's lock (as it is under hogwild), with the workers'
positions on the shard (each worker's next step, its rows and their keys' sum:
:mod:`sparkdl.ps.positions`), and where the server holds its synchronous rounds for
checkpoints the answer also opens them: those of the epoch after the request's
``value`` (``epoch_steps``), and those after a step a worker held them at (HOLD).

A worker that starts (again) asks every shard where it stands with RESUME and
resumes at the least step they name; a worker of a synchronous server that asks
for a step checkpoint sends HOLD to every shard before its push of that step.

The server knows the exact header and payload size of every request type in
advance and closes the connection on any other header without allocating from
the announced length: not a frame of this version (bad magic, another wire
version, non-zero flags: :class:`~sparkdl.net.frames.FrameError`), another
kind of frame, an unknown op, a wrong dtype code, non-zero fields a request
leaves 0, any other length.  Where the header was a frame of this version it
first answers ``BAD_REQUEST`` saying why.  A push holding NaN or infinity is
answered with ``BAD_REQUEST`` and a message starting with ``NON_FINITE``;
nothing of it is applied and the connection stays usable.  A response with a
non-OK status carries a short UTF-8 message (``dtype`` 0, at most
``MAX_MESSAGE_BYTES``) that the client puts into its exception; the client
refuses a response of another kind, op or seq, or with a dtype, length or
non-zero field other than the table's.
"""

from __future__ import annotations

import enum

import numpy as np

from sparkdl.net.frames import dtype_code

#: Start of the BAD_REQUEST message refusing a push that holds NaN or infinity.
NON_FINITE = "non-finite gradient"

#: Longest error message a response may carry; the client rejects longer ones.
MAX_MESSAGE_BYTES = 1024

FLOAT = np.dtype("<f4")
#: The frame dtype code of a float32 payload (pulled weights; pushed gradients without compression).
FLOAT_CODE = dtype_code(np.float32)
#: Row counts (a join's request and response).
ROWS = np.dtype("<i8")
ROWS_CODE = dtype_code(np.int64)


class Msg(enum.IntEnum):
    PULL = 1
    PUSH = 2
    DONE = 3
    #: sync_ps: a worker's training rows in, every worker's out once all have joined (their common schedule)
    JOIN = 4
    #: the controller (the driver, for checkpoints of shards served by executors): the shard's whole state out
    STATE = 5
    #: a worker that starts: its rows in, the first of its steps the shard has not applied out
    RESUME = 6
    #: sync_ps: a worker asks for a step checkpoint after the step in ``value``: later rounds wait for the driver
    HOLD = 7


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
    #: sync_ps: a pull (or a join) waited ``timeout`` seconds for other workers' pushes (or joins); the message
    #: names them
    ROUND_TIMEOUT = 5


def msg_name(code: int) -> str:
    try:
        return Msg(code).name.lower()
    except ValueError:
        return f"unknown message type {code}"


def expected_request_payload(msg: int, shard_size: int, push_dtype: np.dtype = FLOAT) -> int | None:
    """Exact payload bytes of a request, or None if ``msg`` is not a request type."""
    if msg == Msg.PUSH:
        return np.dtype(push_dtype).itemsize * shard_size
    if msg in (Msg.PULL, Msg.DONE, Msg.STATE, Msg.HOLD):
        return 0
    if msg == Msg.JOIN:
        return ROWS.itemsize
    return 2 * ROWS.itemsize if msg == Msg.RESUME else None


def request_dtype(msg: int, push_dtype: np.dtype = FLOAT) -> int:
    """The dtype code a request of type ``msg`` carries: the push dtype's for a push's gradient, int64's for a
    join's or a resume's rows, else 0."""
    if msg == Msg.PUSH:
        return dtype_code(push_dtype)
    return ROWS_CODE if msg in (Msg.JOIN, Msg.RESUME) else 0


def response_dtype(msg: int, status: int) -> int:
    """The dtype code of a response: float32's for a pull's weights, int64's for a join's rows and a resume's step,
    0 for no payload or an error message."""
    if status != Status.OK:
        return 0
    return FLOAT_CODE if msg == Msg.PULL else ROWS_CODE if msg in (Msg.JOIN, Msg.RESUME) else 0


def positions_nbytes(num_workers: int) -> int:
    """The bytes of the workers' positions a STATE answer ends with: each worker's next step on the shard, then its
    training rows, then their keys' sum, int64 each (``sparkdl.ps.positions``)."""
    return 3 * ROWS.itemsize * num_workers


def expected_response_payload(msg: int, shard_size: int, num_workers: int = 0, state_nbytes: int = 0) -> int:
    """Exact payload bytes of an OK response to ``msg`` (a join's: ``num_workers`` row counts; a state's:
    ``state_nbytes``, which the controller computes from its own copy of the shard's variables, and the positions
    of ``num_workers``)."""
    if msg == Msg.PULL:
        return FLOAT.itemsize * shard_size
    if msg == Msg.STATE:
        return state_nbytes + positions_nbytes(num_workers)
    if msg == Msg.RESUME:
        return ROWS.itemsize
    return ROWS.itemsize * num_workers if msg == Msg.JOIN else 0
