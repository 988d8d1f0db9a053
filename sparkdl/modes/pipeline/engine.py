"""One pipeline stage's training step on a worker, in GPipe's schedule: every micro-batch forward, then back, then apply.

Stage s holds only its own layers (:func:`sparkdl.modes.pipeline.cut.build_stage`) and talks only to
stages s-1 and s+1, by point-to-point messages of raw float32 arrays:

- Streams. A communicator runs its operations one at a time, in call order. The edges between
  neighbours alternate between two subgroup communicators split from ``comm``, so a stage's receives
  from s-1 never queue behind its sends to s+1; all receives of a phase are posted when it starts, and
  sends are asynchronous: a stage computes the next micro-batch while the last one is on the wire.
- Tags: ``2 m`` carries micro-batch m's activation, ``2 m + 1`` its gradient. Messages of one tag from
  one peer arrive in the order sent, so successive steps cannot mix either.
- Tape kept, not recomputed: each micro-batch's forward runs under its own ``tf.GradientTape``, kept
  until its backward (GPipe's memory without re-materialisation: M micro-batches' activations), so
  dropout draws one mask for both passes. Backward runs the micro-batches in reverse order: the last
  stage starts on the last micro-batch as soon as its forward is done.
- Micro-batches: ``np.array_split`` (with a remainder, the first ``B % M`` have one row more; more
  micro-batches than rows is refused). Micro-batch m's loss weighs ``rows_m / B`` (1 for a loss whose
  reduction is ``"sum"``) and the stage's regularization penalties ``rows_m / B``, so the accumulated
  gradient is exactly the whole batch's, whatever the split.
- Result: every stage returns its share of the step's loss: the last stage the compiled loss over the
  batch plus its own penalties, the others their penalties (0.0 without regularizers). The shares sum
  to the loss Keras' ``train_on_batch`` reports; with ``replicas``, each is the mean over the replicas.
- With ``replicas`` (this stage's copies in the other data-parallel replicas), the accumulated
  gradients are averaged by one allreduce before the stage's optimizer applies them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from sparkdl.collective.api import Communicator, ReduceOp, Work
from sparkdl.modes.pipeline.timeline import BACKWARD_END, BACKWARD_START, FORWARD_END, FORWARD_START, StageTimeline
from sparkdl.modes.step_clock import StepClock


class PipelineStage:
    """Stage ``comm.rank`` of ``comm.size``: trains ``model`` (this stage's layers) with ``optimizer``.

    ``comm``'s ranks are the stages of one replica (collective: every stage constructs its own at once).
    ``loss`` is the full model's compiled loss (``model.loss``: a Loss, a function or its name). Every wait
    on a message or on the replicas gives up after ``timeout`` seconds. With a ``timeline``, each training step's
    micro-batches mark when their forward and backward passes start and end (``profile=True``).
    """

    def __init__(
        self,
        model: keras.Model,
        comm: Communicator,
        micro_batches: int,
        loss: Any,
        optimizer: keras.optimizers.Optimizer,
        *,
        replicas: Communicator | None = None,
        timeout: float = 300.0,
        observe: Callable[[np.ndarray, tf.Tensor], None] | None = None,
        timeline: StageTimeline | None = None,
    ):
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(
                f"Expected `micro_batches` to be a positive integer. Received: micro_batches={micro_batches!r}"
            )
        self.model, self.optimizer, self.replicas, self.timeout = model, optimizer, replicas, timeout
        self._observe = observe  # the last stage's: each micro-batch's labels and outputs (metrics)
        self._timeline = timeline  # profile=True: when each micro-batch's passes start and end
        self.stage, self.stages, self.micro_batches = comm.rank, comm.size, micro_batches
        self._loss = keras.losses.get(loss) if isinstance(loss, str) else loss
        self._loss_weighs_rows = getattr(self._loss, "reduction", None) != "sum"
        self._streams = (stream_of(comm), stream_of(comm))
        self._upstream = self._streams[(self.stage - 1) % 2]  # the edge (s-1, s)
        self._downstream = self._streams[self.stage % 2]  # the edge (s, s+1)
        self._clock = StepClock(f"pipeline stage {self.stage} of {self.stages}", ("compute", "wait", "allreduce"))
        # The stage's layers as one compiled function (its gradient is compiled too, from the tape that records the
        # call): a micro-batch is a few ops to TensorFlow instead of every layer's, one by one.
        self._call = tf.function(self._layers, reduce_retracing=True)
        self._apply = tf.function(self._apply_gradients)  # Keras applies an optimizer op by op, unless compiled
        self._steps = 0

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def train_step(
        self, x: np.ndarray | None = None, y: np.ndarray | None = None, *, micro_batches: int | None = None
    ) -> float:
        """One step on a batch: ``x`` (its inputs) on the first stage only, ``y`` (its labels) on the last only,
        in ``micro_batches`` (default: the stage's; every stage must pass the same: a batch of fewer rows than the
        stage's micro-batches is cut into one a row). Returns this stage's share of the step's loss (see the
        module's docstring)."""
        count = self._count(x, y, micro_batches)
        if self._timeline is not None:
            self._timeline.begin_step()
        records, sends = self._forward(self._split(x, "x", count), self._split(y, "y", count), count)
        gradients, share = self._backward(records, sends, count)
        for work, what in sends:
            self._wait(work, what)
        if self.replicas is not None:
            gradients, share = self._average_over_replicas(self.replicas, gradients, share)
        if self.model.trainable_variables:
            with self._clock.timing("compute"):
                self._apply(gradients)
        self._steps += 1
        return share

    def evaluate_step(
        self, x: np.ndarray | None = None, y: np.ndarray | None = None, *, micro_batches: int | None = None
    ) -> float:
        """The forward pass alone, on held-out rows (as :meth:`train_step` takes them): the last stage returns the
        batch's mean loss (without regularization penalties, as Keras's validation loss), the others 0.0."""
        count = self._count(x, y, micro_batches)
        xs, ys, s = self._split(x, "x", count), self._split(y, "y", count), self.stage
        received = [] if self.first else [self._upstream.recv_async(s - 1, tag=2 * m) for m in range(count)]
        sends: list[tuple[Work, str]] = []
        total, rows = 0.0, 0
        for m in range(count):
            entering = xs[m] if xs is not None else self._received(received[m], m)
            outputs, _, loss = self._call(tf.convert_to_tensor(entering), self._labels(ys, m, len(entering)), False)
            if ys is not None:
                total += float(loss) * len(ys[m])
                rows += len(ys[m])
                if self._observe is not None:
                    self._observe(ys[m], outputs)
            if not self.last:
                work = self._downstream.send_async(self._activation(outputs, m), s + 1, tag=2 * m)
                sends.append((work, f"sending micro-batch {m}'s activation to stage {s + 1}"))
        for work, what in sends:
            self._wait(work, what)
        return total / rows if rows else 0.0

    def _count(self, x, y, micro_batches: int | None) -> int:
        for name, value, needed, where in (("x", x, self.first, "the first"), ("y", y, self.last, "the last")):
            if (value is not None) != needed:
                raise ValueError(
                    f"Expected `{name}` on {where} stage only. Received: {name}="
                    f"{'None' if value is None else 'an array'} on stage {self.stage} of {self.stages}"
                )
        return self.micro_batches if micro_batches is None else micro_batches

    def _received(self, work: Work, m: int) -> np.ndarray:
        entering = self._wait(work, f"receiving micro-batch {m}'s activation from stage {self.stage - 1}")
        _check_shape(entering, self.model.inputs[0].shape, f"stage {self.stage}'s micro-batch {m}")
        return entering

    def _forward(self, xs: list | None, ys: list | None, count: int) -> tuple[list[dict], list[tuple[Work, str]]]:
        s = self.stage
        received = [] if self.first else [self._upstream.recv_async(s - 1, tag=2 * m) for m in range(count)]
        records, sends = [], []
        for m in range(count):
            entering = xs[m] if xs is not None else self._received(received[m], m)
            self._mark(FORWARD_START, m)
            with self._clock.timing("compute"):
                inputs = tf.convert_to_tensor(entering)
                with tf.GradientTape() as tape:
                    if not self.first:
                        tape.watch(inputs)
                    outputs, penalty, loss = self._call(inputs, self._labels(ys, m, len(entering)), True)
                if ys is not None and self._observe is not None:
                    self._observe(ys[m], outputs)
                records.append(dict(tape=tape, inputs=inputs, outputs=outputs, penalty=penalty, loss=loss))
                if not self.last:
                    activation = self._activation(outputs, m)
            self._mark(FORWARD_END, m)
            if not self.last:
                work = self._downstream.send_async(activation, s + 1, tag=2 * m)
                sends.append((work, f"sending micro-batch {m}'s activation to stage {s + 1}"))
        return records, sends

    def _backward(
        self, records: list[dict], sends: list[tuple[Work, str]], count: int
    ) -> tuple[list[tf.Tensor], float]:
        s = self.stage
        rows = sum(int(record["outputs"].shape[0]) for record in records)
        order = range(count - 1, -1, -1)
        received = {} if self.last else {m: self._downstream.recv_async(s + 1, tag=2 * m + 1) for m in order}
        variables = self.model.trainable_variables
        accumulated: list[tf.Tensor] | None = None
        share = 0.0
        for m in order:
            record = records.pop()  # micro-batch m's: once done with, its tape and activations are freed
            if not self.last:
                upstream = self._wait(received[m], f"receiving micro-batch {m}'s gradient from stage {s + 1}")
                _check_shape(upstream, record["outputs"].shape, f"stage {s}'s gradient {m} from stage {s + 1}")
            self._mark(BACKWARD_START, m)
            with self._clock.timing("compute"):
                row_weight = int(record["outputs"].shape[0]) / rows
                loss_weight = row_weight if self._loss_weighs_rows else 1.0
                targets, seeds = [], []
                for term, weight in ((record["loss"], loss_weight), (record["penalty"], row_weight)):
                    if term is not None:
                        targets.append(term)
                        seeds.append(tf.constant(weight, term.dtype))
                        share += weight * float(term)
                if not self.last:
                    targets.append(record["outputs"])
                    seeds.append(tf.cast(upstream, record["outputs"].dtype))
                sources = [*variables] + ([] if self.first else [record["inputs"]])
                gradients = record["tape"].gradient(
                    targets, sources, output_gradients=seeds, unconnected_gradients=tf.UnconnectedGradients.ZERO
                )
                weights = gradients[: len(variables)]
                accumulated = weights if accumulated is None else [a + g for a, g in zip(accumulated, weights)]
                passed_back = None if self.first else gradients[-1].numpy()
            self._mark(BACKWARD_END, m)
            if passed_back is not None:
                work = self._upstream.send_async(passed_back, s - 1, tag=2 * m + 1)
                sends.append((work, f"sending micro-batch {m}'s gradient to stage {s - 1}"))
        return accumulated or [], share

    def _average_over_replicas(
        self, replicas: Communicator, gradients: list[tf.Tensor], share: float
    ) -> tuple[list[tf.Tensor], float]:
        with self._clock.timing("allreduce"):
            parts = [np.asarray(g, np.float32).reshape(-1) for g in gradients]
            work = replicas.allreduce_async(np.concatenate([*parts, [share]]).astype(np.float32), ReduceOp.MEAN)
        mean = self._wait(work, "averaging the gradients over the replicas", clock="allreduce")
        averaged, position = [], 0
        for gradient, part in zip(gradients, parts):
            averaged.append(tf.constant(mean[position : position + part.size].reshape(gradient.shape), gradient.dtype))
            position += part.size
        return averaged, float(mean[-1])

    def _split(self, array: np.ndarray | None, name: str, count: int) -> list[np.ndarray] | None:
        if array is None:
            return None
        array = np.asarray(array)
        if array.ndim == 0 or len(array) < count:
            raise ValueError(
                f"Expected `micro_batches` ({count}) to be at most the batch size. "
                f"Received: a batch of {len(array) if array.ndim else 0} rows in `{name}`"
            )
        return np.array_split(array, count)

    def _apply_gradients(self, gradients: list[tf.Tensor]) -> None:
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))

    def _layers(self, inputs: tf.Tensor, y: tf.Tensor | None, training: bool) -> tuple:
        """The stage's outputs; the sum of its regularization penalties when training (None without any); the loss
        of labels ``y`` (the last stage's; None elsewhere)."""
        outputs = self.model(inputs, training=training)
        penalties = self.model.losses if training else []
        loss = batch_loss(self._loss, y, outputs) if y is not None else None
        return outputs, (tf.add_n(penalties) if penalties else None), loss

    def _labels(self, ys: list | None, m: int, rows: int) -> tf.Tensor | None:
        """Micro-batch ``m``'s labels (on the last stage), checked against the ``rows`` its activation brought."""
        if ys is None:
            return None
        if len(ys[m]) != rows:
            raise ValueError(
                f"Expected stage {self.stage}'s micro-batch {m} to have the rows of its labels ({len(ys[m])}). "
                f"Received: {rows} rows from stage {self.stage - 1}"
            )
        return tf.convert_to_tensor(ys[m])

    def _activation(self, outputs: tf.Tensor, m: int) -> np.ndarray:
        if not outputs.dtype.is_floating:
            raise ValueError(
                f"Expected stage {self.stage}'s output (micro-batch {m}) to be floating point to flow to stage "
                f"{self.stage + 1}: an integer activation carries no gradient back. Received: {outputs.dtype.name}; "
                "cut elsewhere with `cut_points`"
            )
        return outputs.numpy().astype(np.float32, copy=False)

    def _mark(self, event: int, m: int) -> None:
        if self._timeline is not None:
            self._timeline.mark(event, m)

    def _wait(self, work: Work, what: str, clock: str = "wait") -> Any:
        return self._clock.wait(work, what, clock, self.timeout)

    def summary(self) -> dict[str, float | int]:
        """Seconds computing, waiting on the neighbours and averaging over replicas, over every step so far; the
        idle ("bubble") fraction of computing plus waiting, and GPipe's bound on it, (S-1)/(M+S-1)."""
        compute, wait = self._clock.seconds["compute"], self._clock.seconds["wait"]
        return {
            "stage": self.stage,
            "stages": self.stages,
            "micro_batches": self.micro_batches,
            "steps": self._steps,
            "compute_seconds": compute,
            "wait_seconds": wait,
            "allreduce_seconds": self._clock.seconds["allreduce"],
            "idle_fraction": wait / (compute + wait) if compute + wait else 0.0,
            "gpipe_bound": (self.stages - 1) / (self.micro_batches + self.stages - 1),
        }

    def close(self) -> None:
        """Ends the stage's two message streams (``comm`` stays open)."""
        for stream in self._streams:
            stream.close()


def batch_loss(loss: Any, y: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """The compiled loss of a batch, as Keras reports it (a per-row loss averaged over the rows)."""
    value = loss(y, outputs)
    return tf.reduce_mean(value) if value.shape.rank else value


def stream_of(comm: Communicator) -> Communicator:
    """A communicator of ``comm``'s ranks with a stream of operations of its own (collective)."""
    stream = comm.split(range(comm.size))
    assert stream is not None  # every rank is a member
    return stream


def _check_shape(array: np.ndarray, expected: tuple, what: str) -> None:
    """Refuses an array that is not float32 or does not fit ``expected`` (None: any length)."""
    fits = len(array.shape) == len(expected) and all(e is None or e == a for e, a in zip(expected, array.shape))
    if array.dtype != np.float32 or not fits:
        raise ValueError(
            f"Expected {what} to be float32 of shape {tuple(expected)}. Received: {array.dtype} {array.shape}"
        )
