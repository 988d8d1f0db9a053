"""``sparkdl.plan(df, model, num_workers)``: measures a short probe on the cluster and prints, for every mode, the
predicted time of an epoch, recommending a mode, a batch size and a number of workers (``planner.weigh``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparkdl.launch import session
from sparkdl.planner import cluster_probe
from sparkdl.planner.planned import PLANNED
from sparkdl.planner.planner import Plan, weigh


def plan(
    df,
    model,
    num_workers: int,
    *,
    features_col="features",
    label_col="label",
    batch_size: int = 32,
    worker_memory: int | None = None,
    modes: Sequence[str] | None = None,
    timeout: float = 600.0,
    show: bool = True,
) -> Plan:
    """Which mode, batch size and number of workers (at most ``num_workers``) train ``model`` on ``df`` fastest.

    Runs a short probe on the cluster: two profiled fits of a few steps on one worker (at ``batch_size`` and
    four times it, on ``df``'s own rows, ``features_col``/``label_col`` as ``sparkdl.fit`` reads them) and the
    ring allreduce's latency and bandwidth between ``num_workers`` tasks; then predicts the time of an epoch of
    every planned mode (``modes``: labels of ``sparkdl.planner.planned.PLANNED``, default all) on 1, 2, 4, ...,
    ``num_workers`` workers with ``batch_size``, 2x and 4x rows per worker, from the cost model of each mode's
    communication (``sparkdl.planner.mode_costs``). ``worker_memory``: bytes a worker may hold for the model (its
    weights, optimizer state and gradients); modes beyond it are shown but not recommended, as are those that would
    claim more task slots than the cluster has (servers beside the workers). With ``show``, the table is printed.
    Returns the :class:`~sparkdl.planner.planner.Plan` (``plan.recommended.fit_arguments``).

    Example:
        >>> chosen = sparkdl.plan(df, model, num_workers=4, batch_size=32)
        >>> sparkdl.fit(df, model, epochs=10, **chosen.recommended.fit_arguments)
    """
    _check(model, num_workers, batch_size, worker_memory, modes)
    rows = df.count()
    measured = cluster_probe.measure(
        df,
        model,
        num_workers=num_workers,
        batch_sizes=(batch_size, 4 * batch_size),
        fit_settings={"features_col": features_col, "label_col": label_col},
        timeout=timeout,
    )
    counts = sorted({*(2**i for i in range(num_workers.bit_length()) if 2**i <= num_workers), num_workers})
    result = weigh(
        measured,
        rows=rows,
        worker_counts=counts,
        batch_sizes=(batch_size, 2 * batch_size, 4 * batch_size),
        optimizer_slots=_slots(model),
        largest_layers_bytes=_largest_layers(model),
        trainable_variables=len(model.trainable_variables),
        worker_memory=worker_memory,
        cluster_slots=session.task_slots(df.sparkSession),
        modes=tuple(modes) if modes is not None else None,
    )
    if show:
        print(result)
    return result


def _check(model, num_workers, batch_size, worker_memory, modes) -> None:
    for name, value in (("num_workers", num_workers), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Expected `{name}` to be a positive integer. Received: {name}={value!r}")
    if worker_memory is not None and (isinstance(worker_memory, bool) or not isinstance(worker_memory, int)):
        raise ValueError(f"Expected `worker_memory` to be a number of bytes. Received: worker_memory={worker_memory!r}")
    unknown = [m for m in modes or () if m not in PLANNED]
    if unknown:
        raise ValueError(f"Expected `modes` among {list(PLANNED)}. Received: {unknown}")
    if getattr(model, "optimizer", None) is None:
        raise ValueError("Expected a compiled model: the probe trains it for a few steps.")


def _slots(model) -> int:
    """How many arrays the size of a weight the model's optimizer keeps per weight (Adam: 2), found by building a
    copy of it over one stand-in variable of one element."""
    import keras

    optimizer = type(model.optimizer).from_config(model.optimizer.get_config())
    before = len(optimizer.variables)
    optimizer.build([keras.Variable(np.zeros(1, np.float32))])
    return len(optimizer.variables) - before


def _largest_layers(model) -> int:
    """The bytes of the two largest layers' trainable weights: what a fully sharded worker holds whole at once."""
    sizes = sorted(
        (4 * sum(int(np.prod(v.shape)) for v in layer.trainable_variables) for layer in model.layers), reverse=True
    )
    return sum(sizes[:2])
