"""What a barrier task sets up before the training code runs: sparkdl's communicator or Horovod."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

from sparkdl.collective import context
from sparkdl.launch.forward import TaskReporter
from sparkdl.launch.stage import connect_collective

#: Whose collectives a barrier task uses: sparkdl's communicator (which picks ring, tree, hierarchical or shared
#: memory per call) or Horovod's.
BACKENDS = ("sparkdl", "horovod")


def check_backend(backend: str) -> None:
    """On the driver, before any job: the backend exists, and Horovod is installed if asked for."""
    if backend == "ring":  # its name before it chose among algorithms
        raise ValueError(
            "Expected backend='sparkdl' for sparkdl's communicator, whose ring is one of the algorithms it chooses "
            "among (ring, tree, hierarchical, shared memory). Received: backend='ring'"
        )
    if backend not in BACKENDS:
        raise ValueError(f"Expected `backend` to be one of {list(BACKENDS)}. Received: backend={backend!r}")
    if backend == "horovod" and importlib.util.find_spec("horovod") is None:
        raise ValueError(
            "backend='horovod' needs Horovod, which is not installed here. Build the Horovod stack "
            "with conf/horovod/install.sh (see the README), or use backend='sparkdl'."
        )


@contextlib.contextmanager
def trainer_communicator(
    backend: str, reporter: TaskReporter, secret: bytes, timeout: float, *, encrypt: bool = False
) -> Iterator:
    """For sparkdl's own trainer: a communicator (rank, size, allreduce, ...) over the chosen backend."""
    if backend == "sparkdl":
        with connect_collective(reporter, secret, timeout, encrypt=encrypt) as comm:
            yield comm
        return
    from sparkdl.collective.horovod import HorovodCommunicator, horovod_environment

    with horovod_environment(timeout), HorovodCommunicator() as comm:
        yield comm


@contextlib.contextmanager
def user_backend(
    backend: str, reporter: TaskReporter, secret: bytes, timeout: float, *, encrypt: bool = False
) -> Iterator[None]:
    """For a user's function: ``sparkdl.collective`` works (sparkdl), or ``hvd.init()`` joins the job (horovod)."""
    if backend == "sparkdl":
        with connect_collective(reporter, secret, timeout, encrypt=encrypt) as comm, context.bound(comm):
            yield
        return
    from sparkdl.collective.horovod import horovod_environment

    with horovod_environment(timeout):
        yield
