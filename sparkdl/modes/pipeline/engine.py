"""One pipeline stage's training step on a worker: its micro-batches' passes in its schedule's order, as one compiled
function.

Stage s holds only its own layers (:func:`sparkdl.modes.pipeline.cut.build_stage`) and talks only to
stages s-1 and s+1, by point-to-point messages of raw float32 arrays (``messages.StepMessages``: a stream per
direction and kind; the activations' receives posted when the step starts).

- One compiled step. A step's passes (``schedules``: GPipe's, or 1F1B's) are one ``tf.function`` of the stage's
  layers, their gradients, the optimizer's update and, between them, the messages: a message is taken from or
  handed to Python by a ``tf.numpy_function``, which waits on the stream. The passes are chained by a control
  token in the schedule's order, so they run in that order and free each micro-batch's activations where the
  schedule says. Python runs once a step, not once a micro-batch (a digits pipeline step was mostly Python: each
  micro-batch's call under its tape, its gradient, the messages; profiled in docs/benchmarks.md).
- Tape kept, not recomputed: each micro-batch's forward pass runs under its own ``tf.GradientTape``, kept until
  its backward pass (the schedule's activations: GPipe all M micro-batches', 1F1B at most S - s on stage s), so
  dropout draws one mask for both passes.
- Micro-batches: ``np.array_split``'s sizes (with a remainder, the first ``B % M`` have one row more; more
  micro-batches than rows is refused); every stage knows them from the batch's rows. Micro-batch m's loss weighs
  ``rows_m / B`` (1 for a loss whose reduction is ``"sum"``) and the stage's regularization penalties ``rows_m / B``,
  so the accumulated gradient is exactly the whole batch's, whatever the split.
- Result: every stage returns its share of the step's loss: the last stage the compiled loss over the
  batch plus its own penalties, the others their penalties (0.0 without regularizers). The shares sum
  to the loss Keras' ``train_on_batch`` reports; with ``replicas``, each is the mean over the replicas.
- With ``replicas`` (this stage's copies in the other data-parallel replicas), the accumulated
  gradients are averaged by one allreduce before the stage's optimizer applies them.
- A wait that fails inside the compiled step (a neighbour gone, a bad message) is raised as itself once the step
  has stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from sparkdl.collective.api import Communicator, ReduceOp, Work
from sparkdl.modes.pipeline.messages import STREAMS, StepMessages, activation_tag, gradient_tag
from sparkdl.modes.pipeline.schedules import FORWARD, SCHEDULES
from sparkdl.modes.pipeline.timeline import BACKWARD_END, BACKWARD_START, FORWARD_END, FORWARD_START, StageTimeline
from sparkdl.modes.step_clock import StepClock


class PipelineStage:
    """Stage ``comm.rank`` of ``comm.size``: trains ``model`` (this stage's layers) with ``optimizer``.

    ``comm``'s ranks are the stages of one replica (collective: every stage constructs its own at once).
    ``loss`` is the full model's compiled loss (``model.loss``: a Loss, a function or its name). ``schedule`` names
    the order of a step's passes (:data:`~sparkdl.modes.pipeline.schedules.SCHEDULES`); every stage must use the same.
    Every wait on a message or on the replicas gives up after ``timeout`` seconds. With a ``timeline``, each training
    step's micro-batches mark when their forward and backward passes start and end (``profile=True``).
    """

    def __init__(
        self,
        model: keras.Model,
        comm: Communicator,
        micro_batches: int,
        loss: Any,
        optimizer: keras.optimizers.Optimizer,
        *,
        schedule: str = "gpipe",
        replicas: Communicator | None = None,
        timeout: float = 300.0,
        observe: Callable[[tf.Tensor, tf.Tensor], None] | None = None,
        timeline: StageTimeline | None = None,
    ):
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(
                f"Expected `micro_batches` to be a positive integer. Received: micro_batches={micro_batches!r}"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"Expected `schedule` to be one of {sorted(SCHEDULES)}. Received: schedule={schedule!r}")
        self.model, self.optimizer, self.replicas, self.timeout = model, optimizer, replicas, timeout
        self._observe = observe  # the last stage's metrics' update with a step's labels and outputs, compiled in
        self._timeline = timeline  # profile=True: when each micro-batch's passes start and end
        self.stage, self.stages, self.micro_batches = comm.rank, comm.size, micro_batches
        self.schedule = schedule
        self._loss = keras.losses.get(loss) if isinstance(loss, str) else loss
        self._loss_weighs_rows = getattr(self._loss, "reduction", None) != "sum"
        self._streams = tuple(stream_of(comm) for _ in range(STREAMS))  # messages.py says which carries what
        self._clock = StepClock(f"pipeline stage {self.stage} of {self.stages}", ("compute", "wait", "allreduce"))
        self._messages: StepMessages | None = None  # the step in flight's
        self._failure: BaseException | None = None  # what stopped the compiled step from inside, raised after it
        self._trains = bool(model.trainable_variables)  # a stage may hold only weightless layers
        if self._trains and not optimizer.built:
            optimizer.build(model.trainable_variables)  # its variables made outside the compiled step
        # one row of what arrives from stage s-1 and of the gradient that arrives from stage s+1
        self._row_shapes = (tuple(model.inputs[0].shape[1:]), tuple(model.outputs[0].shape[1:]))
        self._train = tf.function(self._train_passes, autograph=False)
        self._evaluate = tf.function(self._evaluate_passes, autograph=False)
        self._concrete: dict[tuple, Any] = {}  # (passes, batch specs, static arguments) -> its concrete function
        self._apply = tf.function(self._apply_gradients)  # Keras applies an optimizer op by op, unless compiled
        self._steps = 0

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def train_step(
        self,
        x: np.ndarray | None = None,
        y: np.ndarray | None = None,
        *,
        micro_batches: int | None = None,
        rows: int | None = None,
    ) -> float:
        """One step on a batch: ``x`` (its inputs) on the first stage only, ``y`` (its labels) on the last only,
        in ``micro_batches`` (default: the stage's; every stage must pass the same: a batch of fewer rows than the
        stage's micro-batches is cut into one a row); ``rows``, the batch's rows, on a stage that holds neither.
        Returns this stage's share of the step's loss (see the module's docstring)."""
        count = self._count(x, y, micro_batches)
        sizes = self._sizes(x, y, count, rows)
        if self._timeline is not None:
            self._timeline.begin_step()
        order = SCHEDULES[self.schedule](self.stage, self.stages, count)
        apply_here = self.replicas is None and self._trains
        gradients, share = self._run(self._train, order, sizes, x, y, count, apply_here)
        share = float(share)
        if self.replicas is not None:
            gradients, share = self._average_over_replicas(self.replicas, gradients, share)
            if self._trains:
                with self._clock.timing("compute"):
                    self._apply(gradients)
        self._steps += 1
        return share

    def evaluate_step(
        self,
        x: np.ndarray | None = None,
        y: np.ndarray | None = None,
        *,
        micro_batches: int | None = None,
        rows: int | None = None,
    ) -> float:
        """The forward pass alone, on held-out rows (as :meth:`train_step` takes them): the last stage returns the
        batch's mean loss (without regularization penalties, as Keras's validation loss), the others 0.0."""
        count = self._count(x, y, micro_batches)
        sizes = self._sizes(x, y, count, rows)
        order = [(FORWARD, m) for m in range(count)]
        return float(self._run(self._evaluate, order, sizes, x, y, count))

    def _run(self, passes, order, sizes: list[int], x, y, *static) -> Any:
        """Runs compiled ``passes`` over one batch with the step's messages, timing its compute and its waits."""
        self._messages = StepMessages(
            self._streams,
            self.stage,
            self.stages,
            order,
            sizes,
            self._row_shapes,
            self._clock,
            self.timeout,
        )
        waited = self._clock.seconds["wait"]
        with self._clock.timing("compute"):
            try:
                x, y = (None if a is None else tf.convert_to_tensor(a) for a in (x, y))
                result = self._compiled(passes, x, y, len(sizes), static)(x, y, tf.constant(sizes, tf.int32), *static)
            except tf.errors.OpError:
                failure, self._failure = self._failure, None
                if failure is None:
                    raise
                raise failure from None
            finally:
                self._clock.seconds["compute"] -= self._clock.seconds["wait"] - waited  # the waits inside it
        return result

    def _compiled(self, passes, x, y, count: int, static: tuple):
        """``passes``'s concrete function for batches like ``x`` and ``y`` (any number of rows) and ``static``,
        traced once: calling it costs a quarter of what a ``tf.function``'s call, which matches its arguments to
        its traces, does (49 against 199 microseconds)."""
        specs = tuple(None if a is None else tf.TensorSpec([None, *a.shape[1:]], a.dtype) for a in (x, y))
        key = (passes, specs, static)
        if key not in self._concrete:
            self._concrete[key] = passes.get_concrete_function(*specs, tf.TensorSpec([count], tf.int32), *static)
        return self._concrete[key]

    # -- the compiled passes --------------------------------------------------------------------------

    def _train_passes(self, x, y, sizes, count: int, apply_here: bool) -> tuple:
        """The step's passes in the schedule's order: the accumulated gradients and this stage's share of the loss;
        the gradients applied here when ``apply_here``, the last stage's metrics updated."""
        xs, ys = (None if a is None else tf.split(a, sizes, num=count) for a in (x, y))
        rows = tf.cast(tf.reduce_sum(sizes), tf.float32)
        variables = self.model.trainable_variables
        token = tf.zeros((), tf.int32)  # each pass starts after the one before it has ended
        kept: dict[int, tuple] = {}  # the micro-batches between their forward and backward pass
        outputs_of: dict[int, tf.Tensor] = {}
        accumulated: list | None = None
        share = tf.zeros((), tf.float32)
        for kind, m in SCHEDULES[self.schedule](self.stage, self.stages, count):
            if kind == FORWARD:
                entering, token = self._entering(xs, m, token)
                with tf.GradientTape() as tape:
                    if not self.first:
                        tape.watch(entering)
                    outputs, penalty, loss = self._layers(entering, None if ys is None else ys[m], True)
                kept[m] = (tape, entering, outputs, penalty, loss)
                token = self._leaving(outputs, m)
                if self.last:
                    outputs_of[m] = outputs
                continue
            tape, entering, outputs, penalty, loss = kept.pop(m)  # its tape and activations freed after this pass
            upstream = None
            if not self.last:
                upstream = self._take(gradient_tag(m), token, outputs.shape)
                token = upstream
            token = self._mark(BACKWARD_START, m, token)
            row_weight = tf.cast(sizes[m], tf.float32) / rows
            targets, seeds = [], []
            for term, weight in ((loss, row_weight if self._loss_weighs_rows else 1.0), (penalty, row_weight)):
                if term is not None:
                    targets.append(term)
                    seeds.append(tf.cast(weight, term.dtype))
                    share += weight * tf.cast(term, tf.float32)
            if upstream is not None:
                targets.append(outputs)
                seeds.append(tf.cast(upstream, outputs.dtype))
            sources = [*variables] + ([] if self.first else [entering])
            with tf.control_dependencies([token]):
                gradients = tape.gradient(
                    targets, sources, output_gradients=seeds, unconnected_gradients=tf.UnconnectedGradients.ZERO
                )
            weights = gradients[: len(variables)]
            accumulated = weights if accumulated is None else [a + g for a, g in zip(accumulated, weights)]
            with tf.control_dependencies(tf.nest.flatten(gradients, expand_composites=True)):
                token = self._mark(BACKWARD_END, m, tf.identity(token))
            if not self.first:
                token = self._give(gradient_tag(m), gradients[-1], token)
        accumulated = accumulated or []
        if apply_here:
            with tf.control_dependencies([token]):
                self._apply_gradients(accumulated)
        if self._observe is not None and y is not None:
            self._observe(y, tf.concat([outputs_of[m] for m in range(count)], 0))
        return accumulated, share

    def _evaluate_passes(self, x, y, sizes, count: int) -> tf.Tensor:
        """Every micro-batch forward, in order: the last stage's mean loss over the batch (its metrics updated)."""
        xs, ys = (None if a is None else tf.split(a, sizes, num=count) for a in (x, y))
        token, total, outputs_of = tf.zeros((), tf.int32), tf.zeros((), tf.float32), []
        for m in range(count):
            entering, token = self._entering(xs, m, token, mark=False)
            outputs, _, loss = self._layers(entering, None if ys is None else ys[m], False)
            token = self._leaving(outputs, m, mark=False)
            if self.last:
                total += tf.cast(loss, tf.float32) * tf.cast(sizes[m], tf.float32)
                outputs_of.append(outputs)
        if not self.last:
            return tf.zeros(())
        if self._observe is not None:
            self._observe(y, tf.concat(outputs_of, 0))
        return total / tf.cast(tf.reduce_sum(sizes), tf.float32)

    def _entering(self, xs, m: int, token, mark: bool = True) -> tuple[tf.Tensor, tf.Tensor]:
        """Micro-batch ``m``'s input (its rows, or stage s-1's activation) once ``token``'s pass has ended, and the
        token of its forward pass's start."""
        if xs is None:
            entering = self._take(activation_tag(m), token, self.model.inputs[0].shape)
        else:
            with tf.control_dependencies([token]):
                entering = tf.identity(xs[m])
        token = self._mark(FORWARD_START, m, entering) if mark else token
        with tf.control_dependencies([token]):
            return tf.identity(entering), token

    def _leaving(self, outputs: tf.Tensor, m: int, mark: bool = True) -> tf.Tensor:
        """Micro-batch ``m``'s forward pass has ended: its activation handed to stage s+1; the token of that."""
        token = self._mark(FORWARD_END, m, outputs) if mark else tf.zeros((), tf.int32)
        if self.last:
            with tf.control_dependencies([outputs]):
                return tf.identity(token)
        if not outputs.dtype.is_floating:
            raise ValueError(
                f"Expected stage {self.stage}'s output (micro-batch {m}) to be floating point to flow to stage "
                f"{self.stage + 1}: an integer activation carries no gradient back. Received: {outputs.dtype.name}; "
                "cut elsewhere with `cut_points`"
            )
        return self._give(activation_tag(m), tf.cast(outputs, tf.float32), token)

    def _take(self, tag: int, token, shape) -> tf.Tensor:
        array = tf.numpy_function(self._taken, [tf.constant(tag), token], tf.float32, stateful=True)
        array.set_shape([None, *shape[1:]])
        return array

    def _give(self, tag: int, array: tf.Tensor, token) -> tf.Tensor:
        return tf.numpy_function(self._given, [tf.constant(tag), array, token], tf.int32, stateful=True)

    def _mark(self, event: int, m: int, after: tf.Tensor) -> tf.Tensor:
        """With a timeline, ``event`` of micro-batch ``m`` once ``after`` is computed; a token of it either way."""
        if self._timeline is None:
            zero = tf.zeros((), tf.int32)
            with tf.control_dependencies([after]):
                return tf.identity(zero)
        return tf.numpy_function(self._marked, [tf.constant([event, m]), after], tf.int32, stateful=True)

    # -- what the compiled passes call back ----------------------------------------------------------

    def _taken(self, tag, _token) -> np.ndarray:
        return self._calling_back(lambda messages: messages.take(int(tag)))

    def _given(self, tag, array, _token) -> np.int32:
        self._calling_back(lambda messages: messages.give(int(tag), array))
        return np.int32(0)

    def _marked(self, event_and_m, _after) -> np.int32:
        assert self._timeline is not None  # marks are compiled in with a timeline only
        self._timeline.mark(int(event_and_m[0]), int(event_and_m[1]))
        return np.int32(0)

    def _calling_back(self, call: Callable[[StepMessages], Any]) -> Any:
        """``call`` on the step's messages; what it raises is kept, to be raised as itself once the compiled step
        has stopped."""
        assert self._messages is not None  # the step in flight's (``_run``)
        try:
            return call(self._messages)
        except BaseException as exc:
            self._failure = exc
            raise

    # -- the parts ---------------------------------------------------------------------------------

    def _count(self, x, y, micro_batches: int | None) -> int:
        for name, value, needed, where in (("x", x, self.first, "the first"), ("y", y, self.last, "the last")):
            if (value is not None) != needed:
                raise ValueError(
                    f"Expected `{name}` on {where} stage only. Received: {name}="
                    f"{'None' if value is None else 'an array'} on stage {self.stage} of {self.stages}"
                )
        return self.micro_batches if micro_batches is None else micro_batches

    def _sizes(self, x, y, count: int, rows: int | None) -> list[int]:
        """Each micro-batch's rows: ``np.array_split``'s of the batch's rows into ``count``."""
        for name, array in (("x", x), ("y", y)):
            if array is None:
                continue
            length = len(array) if np.ndim(array) else 0
            if length < count:
                raise ValueError(
                    f"Expected `micro_batches` ({count}) to be at most the batch size. "
                    f"Received: a batch of {length} rows in `{name}`"
                )
            if rows is not None and rows != length:
                raise ValueError(f"Expected `{name}` to have `rows` ({rows}) rows. Received: {length}")
            rows = length
        if rows is None:
            raise ValueError(
                f"Expected `rows` (the batch's rows) on stage {self.stage} of {self.stages}, which holds neither "
                "`x` nor `y`. Received: rows=None"
            )
        if rows < count:
            raise ValueError(
                f"Expected `micro_batches` ({count}) to be at most the batch size. Received: a batch of {rows} rows"
            )
        return [len(part) for part in np.array_split(np.arange(rows), count)]

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

    def _apply_gradients(self, gradients: list[tf.Tensor]) -> None:
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))

    def _layers(self, inputs: tf.Tensor, y: tf.Tensor | None, training: bool) -> tuple:
        """The stage's outputs; the sum of its regularization penalties when training (None without any); the loss
        of labels ``y`` (the last stage's; None elsewhere)."""
        outputs = self.model(inputs, training=training)
        penalties = self.model.losses if training else []
        loss = batch_loss(self._loss, y, outputs) if y is not None else None
        return outputs, (tf.add_n(penalties) if penalties else None), loss

    def _wait(self, work: Work, what: str, clock: str = "wait") -> Any:
        return self._clock.wait(work, what, clock, self.timeout)

    def summary(self) -> dict[str, float | int | str]:
        """Seconds computing, waiting on the neighbours and averaging over replicas, over every step so far; the
        idle ("bubble") fraction of computing plus waiting, and the bound on it of GPipe (and of 1F1B, whose
        bubble is the same), (S-1)/(M+S-1)."""
        compute, wait = self._clock.seconds["compute"], self._clock.seconds["wait"]
        return {
            "stage": self.stage,
            "stages": self.stages,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "steps": self._steps,
            "compute_seconds": compute,
            "wait_seconds": wait,
            "allreduce_seconds": self._clock.seconds["allreduce"],
            "idle_fraction": wait / (compute + wait) if compute + wait else 0.0,
            "gpipe_bound": (self.stages - 1) / (self.micro_batches + self.stages - 1),
        }

    def close(self) -> None:
        """Ends the stage's message streams (``comm`` stays open)."""
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
