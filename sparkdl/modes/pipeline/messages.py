"""A pipeline stage's messages of one step: the activations' receives posted when the step starts, each message
checked on arrival.

A stage talks to its neighbours over four streams (communicators that each run their operations one at a time, in
call order): activations in from stage s-1, activations out to s+1, gradients in from s+1, gradients out to s-1.
Each stream carries one kind of operation, so no receive waits behind a send (or a send behind a receive) whatever
the schedule's order.

- Activations are received as soon as they come: every receive is posted at the step's start, so that they land
  while the stage computes, and a stage sending its activations never waits for its neighbour to ask (1F1B sends
  micro-batch m+1 forward before it takes m's gradient back, which its neighbour sends before it takes m+1).
- A gradient is received when the step takes it, in the thread that takes it: every stage runs its backward passes
  in one order, so a stage sending a gradient waits at most for its neighbour's passes before.
- A send goes out when the compiled step hands its array over, from that thread too (the links queue its bytes).

The edges alternate between two sets of streams (by the parity of the edge), so that a middle stage's activations
in and out are two streams too. Tags: ``2 m`` carries micro-batch m's activation, ``2 m + 1`` its gradient; messages
of one tag from one peer arrive in the order sent, so successive steps cannot mix either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparkdl.collective.api import Communicator, Work
from sparkdl.modes.pipeline.schedules import FORWARD
from sparkdl.modes.step_clock import StepClock

#: The streams a stage's messages need: activations and gradients, on edges of either parity.
STREAMS = 4


def activation_tag(m: int) -> int:
    return 2 * m


def gradient_tag(m: int) -> int:
    return 2 * m + 1


class StepMessages:
    """Stage ``stage`` of ``stages``'s messages in one step that runs ``order`` (a schedule's passes), over
    ``streams`` (:data:`STREAMS` communicators of the replica's stages, the same on every stage).

    ``sizes``: each micro-batch's rows; ``shapes``: the shapes of one row of the stage's input and of its output
    (what arrives from s-1, and the gradient that arrives from s+1). Waits are timed on ``clock`` (``"wait"``) and
    give up after ``timeout`` seconds with an error that names the micro-batch and the neighbour.
    """

    def __init__(
        self,
        streams: Sequence[Communicator],
        stage: int,
        stages: int,
        order: Sequence[tuple[str, int]],
        sizes: Sequence[int],
        shapes: tuple[tuple, tuple],
        clock: StepClock,
        timeout: float,
    ):
        self.stage, self.sizes, self.clock, self.timeout = stage, list(sizes), clock, timeout
        self._entering, self._leaving = shapes
        before, after = (stage - 1) % 2, stage % 2  # the parities of the edges (s-1, s) and (s, s+1)
        self._activations_out, self._gradients_out = streams[after], streams[2 + before]
        self._gradients_in = streams[2 + after]
        self._received: dict[int, Work] = {}  # the activations, posted now
        if stage > 0:
            for m in (m for kind, m in order if kind == FORWARD):
                self._received[activation_tag(m)] = streams[before].recv_async(stage - 1, tag=activation_tag(m))

    def take(self, tag: int) -> np.ndarray:
        """The array of ``tag`` from its neighbour, once arrived and checked (float32, the expected shape)."""
        m, gradient = divmod(tag, 2)
        peer = self.stage + 1 if gradient else self.stage - 1
        what = f"micro-batch {m}'s {'gradient' if gradient else 'activation'}"
        if gradient:
            array = self.clock.run(
                lambda: self._gradients_in.recv(peer, tag=tag), f"receiving {what} from stage {peer}", "wait"
            )
        else:
            array = self.clock.wait(
                self._received.pop(tag), f"receiving {what} from stage {peer}", "wait", self.timeout
            )
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
        """Sends ``array`` as ``tag``; returns once its bytes are on their way (``array`` may be reused then). A send
        is counted as waiting: on loopback it is a copy into the link's buffers, on a network the wire's time."""
        m, gradient = divmod(tag, 2)
        peer = self.stage - 1 if gradient else self.stage + 1
        stream = self._gradients_out if gradient else self._activations_out
        what = f"sending micro-batch {m}'s {'gradient' if gradient else 'activation'} to stage {peer}"
        self.clock.run(lambda: stream.send(np.asarray(array, np.float32), peer, tag=tag), what, "wait")
