"""A barrier mode registered by a test, as another package would register one: parameter averaging, written as a
plan's ``train`` in sparkdl's barrier frame (``sparkdl.modes.barrier``).

``mode="step_average"``: each rank trains its replica on its own rows (``train_on_batch`` on the schedule every
mode follows) and after every step the ranks average their weights and optimizer state, one allreduce a variable,
by the algorithm ``average_with`` names (None: the communicator's choice). An algorithm registered on the driver
travels with the plan (its class) and is registered in the tasks too. The writer reports each epoch, saves the checkpoints and
returns the averaged model; ``stats["wire_bytes"]`` holds the bytes every rank sent, by transport and operation, as
its communicator counted them.
"""

import dataclasses
import time

import keras
import numpy as np

from sparkdl.collective import Algorithm, ReduceOp, register_algorithm
from sparkdl.collective import algorithms as registered_algorithms
from sparkdl.keras import serialization
from sparkdl.modes import whole_replicas
from sparkdl.modes.barrier import BarrierPlan
from sparkdl.modes.base import Mode, Option

NAME = "step_average"
AVERAGE_WITH = Option("average_with", "the allreduce algorithm that averages the replicas after each step", kind=str)


@dataclasses.dataclass(frozen=True)
class StepAveragePlan(BarrierPlan):
    average_with: str | None = None
    algorithm: type[Algorithm] | None = None  # the class of the registered algorithm of that name, for the tasks

    runs_callbacks = False

    def train(self, ranks):
        if self.algorithm is not None and self.average_with not in registered_algorithms.names():
            register_algorithm(self.algorithm())  # a task's Python has only the algorithms sparkdl builds in
        comm, settings = ranks.comm, ranks.settings
        start = ranks.whole_model_start()
        model = serialization.model_from_bytes(start.model_bytes, settings.custom_objects)
        steps, history = settings.steps_per_epoch, {}
        averaged = [
            v for v in [*model.trainable_variables, *model.optimizer.variables] if keras.backend.is_float_dtype(v.dtype)
        ]
        with ranks.checkpointing(start) as checkpointer:
            for epoch in range(start.epoch, settings.epochs):
                started, losses = time.monotonic(), []
                for batch in settings.batches(ranks.rows, epoch * steps, (epoch + 1) * steps):
                    losses.append(float(model.train_on_batch(*batch, return_dict=True)["loss"]))
                    for variable in averaged:
                        mean = comm.allreduce(np.asarray(variable), ReduceOp.MEAN, algorithm=self.average_with)
                        variable.assign(mean)
                rows = ranks.counts[:, 0]
                loss = float(comm.allgather(np.array([np.mean(losses)]))[:, 0] @ rows / rows.sum())
                history.setdefault("loss", []).append(loss)
                ranks.report_epoch(epoch, {"loss": loss}, time.monotonic() - started)
                if checkpointer is not None:
                    checkpointer.record({"loss": loss})
                    checkpointer.save(epoch + 1, serialization.model_to_bytes(model))
        stats = {"wire_bytes": whole_replicas.wire_bytes(comm)}  # collective: every rank's bytes, on the writer
        if not ranks.writer:
            return None
        return ranks.result(serialization.model_to_bytes(model), history, start, stats)


class StepAverageMode(Mode):
    """Parameter averaging: each worker takes a step on its replica, then the replicas average their weights and
    optimizer state, one allreduce a variable, by the algorithm ``average_with`` names."""

    names = (NAME,)

    def options(self, name):
        return (AVERAGE_WITH,)

    def configure(self, name, model, values):
        chosen = values["average_with"]
        if chosen is None:
            return StepAveragePlan(name)
        algorithm = registered_algorithms.registered().get(chosen)
        if algorithm is None or "allreduce" not in algorithm.operations:
            allreduces = registered_algorithms.ALGORITHMS["allreduce"]
            raise ValueError(f"Expected `average_with` among {list(allreduces)}. Received: average_with={chosen!r}")
        return StepAveragePlan(name, chosen, type(algorithm))
