"""A pipeline stage's messages of one step: each receive posted as early as its stream allows, each checked on arrival.

A stage talks to its two neighbours over two streams (communicators that each run their operations one at a time,
in call order): ``upstream``, the edge to stage s-1 (activations in, gradients out), and ``downstream``, the edge to
stage s+1 (activations out, gradients in). The step's schedule (``schedules``) fixes the order of each stream's
operations; a receive is posted as soon as every operation before it on its stream has been, so that its message
lands while the stage computes, and a send is posted when the compiled step hands its array over. Tags: ``2 m``
carries micro-batch m's activation, ``2 m + 1`` its gradient; messages of one tag from one peer arrive in the order
sent, so successive steps cannot mix either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparkdl.collective.api import Communicator, Work
from sparkdl.modes.pipeline.schedules import FORWARD
from sparkdl.modes.step_clock import StepClock

RECEIVE, SEND = "receive", "send"


def activation_tag(m: int) -> int:
    return 2 * m


def gradient_tag(m: int) -> int:
    return 2 * m + 1


class _Stream:
    """One stream's operations of the step, in order, and how far they have been posted."""

    def __init__(self, comm: Communicator, peer: int, operations: list[tuple[str, int]]):
        self.comm, self.peer, self.operations, self.next = comm, peer, operations, 0


class StepMessages:
    """Stage ``stage`` of ``stages``'s messages in one step that runs ``order`` (a schedule's passes).

    ``sizes``: each micro-batch's rows; ``entering`` and ``leaving``: the shapes of one row of the stage's input and
    output (what arrives from s-1 and the gradient that arrives from s+1). Waits are timed on ``clock`` (``"wait"``)
    and give up after ``timeout`` seconds with an error that names the micro-batch and the neighbour.
    """

    def __init__(
        self,
        streams: tuple[Communicator, Communicator],
        stage: int,
        stages: int,
        order: Sequence[tuple[str, int]],
        sizes: Sequence[int],
        shapes: tuple[tuple, tuple],
        clock: StepClock,
        timeout: float,
    ):
        upstream, downstream = streams
        self.stage, self.sizes, self.clock, self.timeout = stage, list(sizes), clock, timeout
        self._entering, self._leaving = shapes
        self._streams: dict[str, _Stream] = {}
        if stage > 0:  # activations in, gradients out
            ops = [(RECEIVE, activation_tag(m)) if kind == FORWARD else (SEND, gradient_tag(m)) for kind, m in order]
            self._streams["up"] = _Stream(upstream, stage - 1, ops)
        if stage < stages - 1:  # activations out, gradients in
            ops = [(SEND, activation_tag(m)) if kind == FORWARD else (RECEIVE, gradient_tag(m)) for kind, m in order]
            self._streams["down"] = _Stream(downstream, stage + 1, ops)
        self._received: dict[int, Work] = {}
        self._sent: list[tuple[Work, str]] = []
        for stream in self._streams.values():
            self._post_receives(stream)

    def take(self, tag: int) -> np.ndarray:
        """The array of ``tag`` from its neighbour, once arrived and checked (float32, the expected shape)."""
        m, gradient = divmod(tag, 2)
        peer = self.stage + 1 if gradient else self.stage - 1
        what = f"micro-batch {m}'s {'gradient' if gradient else 'activation'}"
        array = self.clock.wait(self._received.pop(tag), f"receiving {what} from stage {peer}", "wait", self.timeout)
        expected = (self.sizes[m], *(self._leaving if gradient else self._entering))
        row_fits = len(array.shape) == len(expected) and all(
            e in (None, a) for e, a in zip(expected[1:], array.shape[1:])
        )
        if array.dtype != np.float32 or not row_fits:
            raise ValueError(
                f"Expected stage {self.stage}'s {what} from stage {peer} to be float32 of shape {expected}. "
                f"Received: {array.dtype} {array.shape}"
            )
        if array.shape[0] != expected[0]:
            raise ValueError(
                f"Expected stage {self.stage}'s {what} from stage {peer} to have {self.sizes[m]} rows (the batch's "
                f"{sum(self.sizes)} rows in {len(self.sizes)} micro-batches). Received: {array.shape[0]} rows"
            )
        return array

    def give(self, tag: int, array: np.ndarray) -> None:
        """Sends ``array`` (a copy: it may be a buffer of the compiled step's) as ``tag``, then posts the receives
        that follow it on its stream."""
        m, gradient = divmod(tag, 2)
        stream = self._streams["up" if gradient else "down"]
        assert stream.operations[stream.next] == (SEND, tag), (stream.operations[stream.next], tag)
        stream.next += 1
        work = stream.comm.send_async(np.array(array, np.float32), stream.peer, tag=tag)
        self._sent.append(
            (work, f"sending micro-batch {m}'s {'gradient' if gradient else 'activation'} to stage {stream.peer}")
        )
        self._post_receives(stream)

    def finish(self) -> None:
        """Waits until every send of the step has left."""
        for work, what in self._sent:
            self.clock.wait(work, what, "wait", self.timeout)
        self._sent.clear()

    def _post_receives(self, stream: _Stream) -> None:
        while stream.next < len(stream.operations) and stream.operations[stream.next][0] == RECEIVE:
            tag = stream.operations[stream.next][1]
            self._received[tag] = stream.comm.recv_async(stream.peer, tag=tag)
            stream.next += 1
