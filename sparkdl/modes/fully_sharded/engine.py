"""One rank's replica of a model whose weights, gradients and optimizer state are all sharded (ZeRO stage 3).

Each rank trains the whole model on its own rows, but between uses it holds only its shard of the
trainable weights (1/N of each unit, ``units``), the optimizer's state over that shard, and the
non-trainable weights. A step, per unit in chain order (FSDP's schedule):

- Forward: the unit's weights are all-gathered (the next unit's gather starts before this unit
  runs), the unit runs on them (``stateless_call``; its own Keras variables hold nothing,
  ``sparkdl.keras.deferred``) and they are dropped. Only the activation entering each unit is kept.
- Backward, from the last unit to the first: the unit's weights are gathered again, its forward runs
  again under a tape from the kept activation, with the non-trainable values it ran with (so dropout
  draws the same mask), and its gradients are taken; the weights are dropped and the weights' gradient
  is reduce-scattered while the units before it run.
- Update: each rank applies the optimizer to its shard with its part of the averaged gradient.

The last units' weights (at least the last's; ``kept_gathered``) are kept from their forward to their
backward pass, which takes their gradients from the forward's tape: no weights gathered twice and no forward
run again for them, for their whole weights and activations held during a step (between steps, still 1/N).
With ``reshard_after_forward=False`` (FSDP's name for it) every unit's are kept; left out, as many as fit
``KEPT_GATHERED_BYTES`` (``fully_sharded.driver``).

The wire carries what ZeRO-3 costs: per step, every unit's weights gathered twice (but the kept ones') and
its gradient reduce-scattered once, up to 1.5 times an allreduce's bytes; the compute is up to one forward
pass more than sync mode's (every unit's but the kept ones' recomputed). With every unit kept, the weights
are gathered once: an allreduce's bytes, and sync mode's compute. With ``compression``, gradients travel as
bfloat16 or float16; weights always travel as float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from sparkdl.collective import compression as compressions
from sparkdl.collective.api import Communicator, ReduceOp, Work
from sparkdl.keras import adopted, compiled_update, deferred, random_state
from sparkdl.modes.fully_sharded import state, units
from sparkdl.modes.fully_sharded.stateless_unit import Unit
from sparkdl.modes.pipeline.cut import StagePlan, build_stage
from sparkdl.modes.pipeline.engine import stream_of
from sparkdl.modes.step_clock import StepClock
from sparkdl.modes.sync.sharded import SHARD, ShardLayout
from sparkdl.schedule import StepScales

_Pending = tuple[Work, np.ndarray] | None  # a gather under way: its work and the rows it fills


class FullyShardedReplica:
    """This rank's replica: ``unit_models`` (deferred, in chain order), trained on the shard ``weights`` (this
    rank's, of ``layout``) with ``optimizer`` (its class and config; its state in ``optimizer_arrays``: the slots'
    shards as ``slot:<name>``, its own variables as ``global:<name>``), ``statistics``: each unit's non-trainable
    weights, whole (chain order).

    ``scales`` (per step from the replica's first: ``schedule.StepScales``) weigh this rank's gradient by its rows.
    ``overlap``: gathers run ahead and reduce-scatters behind the compute (else each waits where it is started).
    ``kept_gathered``: how many units, counted back from the last, keep their gathered weights and their forward
    pass's tape until their backward pass (at least the last; all of them: ``reshard_after_forward=False``).
    ``observe``: the metrics' update, with each batch's labels and outputs. It runs a step as the pipeline's stage
    runner does (``pipeline.epoch.StageEpochs``), as both stages' ends.
    """

    first = last = True
    micro_batches = 1

    def __init__(
        self,
        unit_models: Sequence[keras.Model],
        layout: ShardLayout,
        comm: Communicator,
        *,
        weights: np.ndarray,
        statistics: Sequence[Sequence[Any]],
        optimizer: keras.optimizers.Optimizer,
        optimizer_arrays: dict[str, np.ndarray],
        loss: Any,
        scales: StepScales | None = None,
        compression: str | None = None,
        overlap: bool = True,
        kept_gathered: int = 1,
        timeout: float = 300.0,
        observe: Callable[[np.ndarray, Any], None] | None = None,
    ):
        count = len(unit_models)
        if not 1 <= kept_gathered <= count:
            raise ValueError(f"Expected kept_gathered within 1..{count} (the units). Received: {kept_gathered}")
        self.units = [Unit(m, loss, last=u == count - 1, first=u == 0) for u, m in enumerate(unit_models)]
        self.layout, self.comm, self.timeout, self.overlap = layout, comm, timeout, overlap
        # the units whose weights stay gathered from their forward to their backward pass, which runs off its tape
        self._taped = set(range(count - kept_gathered, count))
        self._scales, self._step, self.observe = scales, 0, observe
        self._compression = compression
        self._wire = np.dtype(np.float32) if compression is None else compressions.wire_dtype(compression)
        self.statistics = [unit.starting_statistics(values) for unit, values in zip(self.units, statistics)]
        self.shard = keras.Variable(weights, name=SHARD)
        self.optimizer = type(optimizer).from_config(optimizer.get_config())
        self.optimizer.build([self.shard])
        self._load_optimizer(optimizer_arrays)

        mean = 1.0 / comm.size

        def apply(summed):  # the ranks' summed gradient: its mean, in the update's own (fused) function
            self.optimizer.apply([summed * mean], [self.shard])

        # one XLA function for a large shard, as sync mode's update (``sparkdl.keras.compiled_update``)
        self._apply = (compiled_update.compiled if compiled_update.pays(self.optimizer, [self.shard]) else tf.function)(
            apply
        )
        self._columns = np.cumsum([0] + [layout.part(u) for u in range(count)])
        self._gathers, self._scatters = stream_of(comm), stream_of(comm)  # a gather never waits behind a scatter
        self._clock = StepClock(
            f"fully sharded rank {comm.rank} of {comm.size}", ("compute", "gather", "reduce_scatter", "update")
        )
        self._steps = 0
        self._held: np.ndarray = self.shard.numpy()  # the shard the gathers send (refreshed after each update)
        # the summed gradient's shard, reduce-scattered into place and read by the update where it lies
        self._summed = adopted.BufferPool(int(self._columns[-1]), np.float32)
        self._gathered = adopted.HeldBytes()  # every unit's gathered weights, counted until dropped

    @classmethod
    def from_part(
        cls,
        plan: StagePlan,
        layout: ShardLayout,
        comm: Communicator,
        part: dict[str, np.ndarray],
        compile_config: dict,
        **options: Any,
    ) -> FullyShardedReplica:
        """This rank's replica from its part of the model (``state.rank_part``'s arrays): the units built deferred,
        the last one compiled with the whole model's ``compile_config`` (its loss, metrics and optimizer)."""
        unit_models = [deferred.build(functools.partial(build_stage, plan, u)) for u in range(plan.num_stages)]
        last = unit_models[-1]
        last.compile(**keras.saving.deserialize_keras_object(compile_config))  # no optimizer variable is built
        statistics = [
            [part[f"{state.STATISTIC}{u}:{k}"] for k in range(len(units.statistics(units.own_layers(model))))]
            for u, model in enumerate(unit_models)
        ]
        optimizer_arrays = {name: value for name, value in part.items() if name.startswith((state.SLOT, "global:"))}
        return cls(
            unit_models,
            layout,
            comm,
            weights=part[state.WEIGHTS],
            statistics=statistics,
            optimizer=last.optimizer,
            optimizer_arrays=optimizer_arrays,
            loss=last.loss,
            **options,
        )

    @property
    def kept_gathered(self) -> int:
        """How many units, the last ones, keep their gathered weights from their forward to their backward pass."""
        return len(self._taped)

    @property
    def model(self) -> keras.Model:
        """The last unit's model (its compiled loss and metrics)."""
        return self.units[-1].model

    def train_step(self, x: np.ndarray, y: np.ndarray, *, micro_batches: int = 1, rows: int | None = None) -> float:
        """One step on this rank's batch; this rank's loss on it (the compiled loss plus every penalty). As a
        pipeline stage's runner takes it: ``micro_batches`` and ``rows`` (``x``'s) change nothing here."""
        labels = tf.convert_to_tensor(y)
        entering, before, taped, share = self._forward(tf.convert_to_tensor(x), labels, y)
        summed = self._backward(entering, before, taped, labels, self._next_scale())
        with self._clock.timing("update"):
            self._apply(adopted.tensor_of(summed))  # aligned: read in place
            self._held = adopted.array_of(tf.convert_to_tensor(self.shard))  # the updated shard, not copied
        self._steps += 1
        return share

    def _forward(self, x: tf.Tensor, labels: tf.Tensor, y: np.ndarray) -> tuple[list, list, dict, float]:
        """The activation entering each unit, each unit's non-trainable values before its call, the taped passes of
        the units whose weights stay gathered (``_taped``), and this rank's loss."""
        entering, before, taped, share = [x], [], {}, 0.0
        pending: _Pending = self._start_gather(0)
        for u, unit in enumerate(self.units):
            weights = self._finish_gather(u, pending)
            pending = None  # the rows are in the weights now: let go before the next unit's arrive
            pending = self._start_gather(u + 1) if u + 1 < len(self.units) else None
            with self._clock.timing("compute"):
                before.append(self.statistics[u])
                target = labels if unit.last else None
                if u in self._taped:  # the tape holds the weights until the backward pass
                    taped[u], statistics = unit.forward_taped(entering[-1], weights, self.statistics[u], target)
                    outputs, penalty, loss = taped[u].outputs, taped[u].penalty, taped[u].loss
                else:
                    outputs, statistics, penalty, loss = unit.forward(
                        entering[-1], weights, self.statistics[u], target, True
                    )
                self.statistics[u] = list(statistics)
                share += sum(float(term) for term in (penalty, loss) if term is not None)
            if not unit.last:
                entering.append(outputs)
            elif self.observe is not None:
                self.observe(y, outputs)
            del weights  # before the next unit's are made
        return entering, before, taped, share

    def _backward(self, entering: list, before: list, taped: dict, labels: tf.Tensor, scale: float) -> np.ndarray:
        """This rank's part of the sum over ranks of every unit's (scaled) gradient, in shard order (an aligned
        buffer of :attr:`_summed`)."""
        count = len(self.units)
        upstream, scatters, summed = None, {}, self._summed.take()
        scale_tensor = tf.constant(scale, tf.float32)
        regathered = iter([u for u in range(count - 1, -1, -1) if u not in taped])  # in the order their passes run
        first = next(regathered, None)
        pending: _Pending = self._start_gather(first) if first is not None else None
        for u in range(count - 1, -1, -1):
            unit = self.units[u]
            if u in taped:
                with self._clock.timing("compute"):
                    flat, upstream = unit.backward_taped(taped.pop(u), upstream, scale_tensor, self.layout.padded(u))
            else:
                weights = self._finish_gather(u, pending)
                pending = None  # the rows are in the weights now: let go before the next unit's arrive
                following = next(regathered, None)
                pending = self._start_gather(following) if following is not None else None
                with self._clock.timing("compute"):
                    flat, upstream = unit.backward(
                        entering[u],
                        weights,
                        before[u],
                        upstream,
                        labels if unit.last else None,
                        scale_tensor,
                        self.layout.padded(u),
                    )
                    del weights  # the unit's whole weights are dropped before the next unit's are used
            # read in place (``.numpy()`` would copy it): a reduce-scatter only reads the array it sends
            scatters[u] = self._start_scatter(
                u, adopted.array_of(flat), summed[self._columns[u] : self._columns[u + 1]]
            )
            entering.pop()
        for u in range(count):
            self._finish_scatter(u, scatters[u], summed[self._columns[u] : self._columns[u + 1]])
        return summed

    def evaluate_step(self, x: np.ndarray, y: np.ndarray, *, micro_batches: int = 1, rows: int | None = None) -> float:
        """The forward pass alone, on held-out rows: the batch's mean loss (without penalties, as Keras's)."""
        activation, labels, loss = tf.convert_to_tensor(x), tf.convert_to_tensor(y), None
        pending: _Pending = self._start_gather(0)
        for u, unit in enumerate(self.units):
            weights = self._finish_gather(u, pending)
            pending = None  # the rows are in the weights now: let go before the next unit's arrive
            pending = self._start_gather(u + 1) if u + 1 < len(self.units) else None
            with self._clock.timing("compute"):
                activation, _, _, loss = unit.forward(
                    activation, weights, self.statistics[u], labels if unit.last else None, False
                )
            del weights  # before the next unit's are made
        if self.observe is not None:
            self.observe(y, activation)
        return float(loss)  # type: ignore[arg-type]  # the last unit's: never None

    def evaluate_nothing(self) -> None:
        """An evaluation step with no rows of this rank's: it gathers every unit's weights for the ranks that have."""
        for u in range(len(self.units)):
            work, _ = self._start_gather(u)
            self._wait(work, f"gathering unit {u}'s weights", "gather")

    def start_random_state(self, *, seed: int, rank: int, saved: np.ndarray | None) -> None:
        """Seeds the units' generators (Dropout's) for ``rank`` from ``seed`` at ``saved`` draws (a checkpoint's;
        None: none), as ``random_state.start`` seeds a whole model's: the units' generators in chain order are its."""
        places = self._generator_places()
        states = random_state.starting_states(len(places), seed=seed, rank=rank, saved=saved)
        for (u, k), value in zip(places, states):
            self.statistics[u][k] = tf.constant(value, self.statistics[u][k].dtype)

    def seed_draws(self) -> np.ndarray:
        """Each generator's draws so far (the same on every rank: each runs every unit in every step)."""
        return random_state.draws_of([self.statistics[u][k] for u, k in self._generator_places()])

    def _generator_places(self) -> list[tuple[int, int]]:
        return [(u, k) for u, unit in enumerate(self.units) for k in unit.generator_places]

    def average_statistics(self) -> None:
        """Collective: the float non-trainable values (BatchNorm's moving statistics) averaged over the ranks, as
        sync mode does after each epoch's last step (a seed generator's state stays each rank's own)."""
        places = [
            (u, k)
            for u, unit in enumerate(self.units)
            for k in unit.statistic_places
            if self.statistics[u][k].dtype.is_floating
        ]
        if not places:
            return
        parts = [np.asarray(self.statistics[u][k], np.float64).reshape(-1) for u, k in places]
        mean = self.comm.allreduce(np.concatenate(parts), ReduceOp.MEAN)
        position = 0
        for (u, k), part in zip(places, parts):
            value = self.statistics[u][k]
            self.statistics[u][k] = tf.constant(mean[position : position + part.size].reshape(value.shape), value.dtype)
            position += part.size

    def gather_state(self) -> tuple[list[np.ndarray], dict, list[list]] | None:
        """Collective: the whole trainable weights (chain order), the optimizer's arrays over them and each unit's
        non-trainable weights (rank 0's), at rank 0; None elsewhere. Gathered one array (the weights, each slot) at a
        time, each variable a view of its bucket's joined parts: rank 0 holds the whole state and one array's shards.
        """
        slots = [v for v in self.optimizer.variables if v.name.startswith(SHARD + "_")]
        shapes = [shape for unit in self.units for shape in unit.shapes]
        wholes = []
        for own in (self.shard, *slots):
            gathered = self.comm.gather(np.asarray(own.numpy(), np.float32), root=0)
            if gathered is not None:
                by_index = dict(self.layout.variables_of(gathered))
                wholes.append([by_index[i].reshape(shape) for i, shape in enumerate(shapes)])
            del gathered
        if not wholes:
            return None
        weights = wholes[0]
        optimizer: dict[str, np.ndarray] = {}
        for slot, values in zip(slots, wholes[1:]):
            name = slot.name[len(SHARD) + 1 :]
            optimizer.update({f"slot:{i}:{name}": value for i, value in enumerate(values)})
        for variable in self.optimizer.variables:
            if not variable.name.startswith(SHARD + "_"):
                optimizer[f"global:{variable.name}"] = np.asarray(variable.numpy())
        statistics = [
            [np.asarray(values[k]) for k in unit.statistic_places] for unit, values in zip(self.units, self.statistics)
        ]
        return weights, optimizer, statistics

    def held_bytes(self) -> dict[str, int]:
        """The bytes this rank holds between steps: its shard of the weights, its optimizer's variables, the
        non-trainable values; and the most gathered weights it held at once (one unit's in use, the next one's
        arriving), counted until TensorFlow let them go."""
        return {
            "weight_bytes": int(self.shard.numpy().nbytes),
            "optimizer_bytes": sum(int(np.asarray(v.numpy()).nbytes) for v in self.optimizer.variables),
            "statistics_bytes": sum(int(np.asarray(v).nbytes) for values in self.statistics for v in values),
            "gathered_peak_bytes": self._gathered.peak,
            "whole_weight_bytes": 4 * sum(self.layout.sizes),
        }

    def summary(self) -> dict[str, float | int]:
        """Seconds computing, waiting on gathers and reduce-scatters and updating, over the steps so far."""
        return {"steps": self._steps, **{f"{kind}_seconds": seconds for kind, seconds in self._clock.seconds.items()}}

    def close(self) -> None:
        for stream in (self._gathers, self._scatters):
            stream.close()

    def _load_optimizer(self, arrays: dict[str, np.ndarray]) -> None:
        for variable in self.optimizer.variables:
            if variable.name.startswith(SHARD + "_"):
                key = "slot:" + variable.name[len(SHARD) + 1 :]
            else:
                key = f"global:{variable.name}"
            if key in arrays:
                variable.assign(arrays[key])

    def _next_scale(self) -> float:
        scale = 1.0 if self._scales is None else self._scales.at(self._step)
        self._step += 1
        return scale

    def _start_gather(self, u: int) -> tuple[Work, np.ndarray]:
        part = self.layout.part(u)
        rows = self._gathered.empty(self.layout.padded(u), np.float32).reshape(self.comm.size, part)
        work = self._gathers.allgather_async(self._held[self._columns[u] : self._columns[u] + part], out=rows)
        if not self.overlap:
            self._wait(work, f"gathering unit {u}'s weights", "gather")
        return work, rows

    def _finish_gather(self, u: int, pending: tuple[Work, np.ndarray] | None) -> list[tf.Tensor]:
        assert pending is not None  # each unit's gather was started before it is needed
        work, rows = pending
        self._wait(work, f"gathering unit {u}'s weights", "gather")
        flat, weights, position = rows.reshape(-1), [], 0
        for shape in self.units[u].shapes:
            size = int(np.prod(shape))
            view = flat[position : position + size].reshape(shape)
            weights.append(adopted.tensor_of(view))  # an aligned view is read in place: the rows' count holds it
            if not adopted.is_aligned(view):
                self._gathered.track(weights[-1], 4 * size)  # a copy, counted on its own
            position += size
        return weights

    def _start_scatter(self, u: int, flat: np.ndarray, into: np.ndarray) -> Work:
        """Starts reduce-scattering unit ``u``'s gradient ``flat``: this rank's part of the sum lands ``into`` (as
        float32 there; the wire's dtype in between)."""
        wire = flat if self._compression is None else compressions.narrow(flat, self._compression)
        out = into if self._compression is None else np.empty(self.layout.part(u), self._wire)
        work = self._scatters.reduce_scatter_async(wire, ReduceOp.SUM, out=out)
        if not self.overlap:
            self._wait(work, f"reduce-scattering unit {u}'s gradient", "reduce_scatter")
        return work

    def _finish_scatter(self, u: int, work: Work, into: np.ndarray) -> None:
        part = self._wait(work, f"reduce-scattering unit {u}'s gradient", "reduce_scatter")
        if self._compression is not None:
            into[:] = compressions.widen(part)

    def _wait(self, work: Work, what: str, kind: str) -> Any:
        return self._clock.wait(work, what, kind, self.timeout)
