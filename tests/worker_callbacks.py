"""Keras callbacks that act on one rank inside the workers (fail, block, perturb, break storage) and leave
files behind, so that tests can see from the driver what each rank did."""

import os
import time
import uuid

import keras


def _partition():
    from pyspark import TaskContext

    return TaskContext.get().partitionId()


class FailOrBlockAtStart(keras.callbacks.Callback):
    """At ``on_train_begin`` (after the weight broadcast, outside any collective) rank ``failing`` raises while
    every other rank blocks until ``release`` appears (at most ``block_seconds``).

    Each rank leaves ``begin-rank<r>-<uuid>`` per attempt and ``pid-rank<r>`` (its process id); a blocked
    rank that got to the end of its wait leaves ``finished-rank<r>``.
    """

    def __init__(self, directory, failing=0, block_seconds=300.0):
        super().__init__()
        self.directory = directory
        self.failing = failing
        self.block_seconds = block_seconds

    def on_train_begin(self, logs=None):
        rank = _partition()
        open(os.path.join(self.directory, f"begin-rank{rank}-{uuid.uuid4().hex}"), "w").close()
        with open(os.path.join(self.directory, f"pid-rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
        if rank == self.failing:
            raise ValueError(f"rank {rank} gives up on purpose")
        deadline = time.monotonic() + self.block_seconds
        while time.monotonic() < deadline and not os.path.exists(os.path.join(self.directory, "release")):
            time.sleep(0.05)
        open(os.path.join(self.directory, f"finished-rank{rank}"), "w").close()


class PerturbWeightsOnRank(keras.callbacks.Callback):
    """At ``on_train_end`` rank ``rank`` adds ``delta`` to its first weight: the replicas diverge."""

    def __init__(self, rank=1, delta=1.0):
        super().__init__()
        self.rank = rank
        self.delta = delta

    def on_train_end(self, logs=None):
        if _partition() == self.rank:
            weights = self.model.get_weights()
            weights[0] = weights[0] + self.delta
            self.model.set_weights(weights)


class ReplaceDirectoryWithFile(keras.callbacks.Callback):
    """At the start of epoch ``epoch`` rank 0 moves ``directory`` aside (to ``<directory>.moved``) and puts a file
    in its place, so that the checkpoints written from then on cannot be."""

    def __init__(self, directory, epoch=1):
        super().__init__()
        self.directory = directory
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch and _partition() == 0:
            os.rename(self.directory, f"{self.directory}.moved")  # atomic: a write in flight goes on there
            with open(self.directory, "w") as f:
                f.write("a file where the checkpoint directory was")


class RecordHorovod(keras.callbacks.Callback):
    """At every epoch end each rank writes what Horovod says from inside it to ``<directory>/horovod-rank<r>.json``:
    whether it is initialised and, if so, its rank and size (Horovod stack only)."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_epoch_end(self, epoch, logs=None):
        import json

        import horovod.tensorflow as hvd

        state = {"initialized": bool(hvd.is_initialized()), "epoch": epoch}
        if state["initialized"]:
            state.update(rank=hvd.rank(), size=hvd.size())
        with open(os.path.join(self.directory, f"horovod-rank{_partition()}.json"), "w") as f:
            json.dump(state, f)
