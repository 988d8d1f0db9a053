"""The random state of a model's layers (Dropout's and the like: Keras ``SeedGenerator`` s), which Keras's saving
leaves out: set from the fit's seed on every rank, and carried in checkpoints as each generator's count of draws, so
that a fit resumed from a checkpoint draws what the run without the fault would have drawn.

Each rank's generators get their own seeds (``seed``, the rank and the generator's place in the model, mixed), as
dropout masks should differ between replicas; their counts of draws are the same on every rank (every rank runs the
same steps), so the writer's counts, saved beside its checkpoint (``DRAWS``), hold for all.
"""

from __future__ import annotations

import numpy as np

from sparkdl import schedule

DRAWS = "keras/seed_draws"  # a checkpoint's array: each generator's draws so far, in the model's order


def is_generator(variable) -> bool:
    """Whether ``variable`` is a seed generator's state (``[seed, draws so far]``)."""
    return getattr(variable, "path", "").rsplit("/", 1)[-1] == "seed_generator_state"


def generators(model) -> list:
    """The state variables of the model's seed generators, in the model's order (none under tf.keras 2, the Horovod
    stack's, whose layers draw from TensorFlow's op seeds and keep no state: nothing to carry there)."""
    return [v for v in model.variables if is_generator(v)]


def draws(model) -> np.ndarray:
    """Each generator's draws so far."""
    return draws_of([state.numpy() for state in generators(model)])


def draws_of(states) -> np.ndarray:
    """Each generator's draws so far, from its state's value (``[seed, draws]``)."""
    return np.array([int(np.asarray(state)[1]) for state in states], np.int64)


def start(
    model, *, seed: int, rank: int, saved: np.ndarray | None = None, first: int = 0, total: int | None = None
) -> None:
    """Seeds the model's generators for ``rank`` from ``seed``, at ``saved`` draws (a checkpoint's; None: none).
    ``first``, ``total``: the model is a part of one (a pipeline's stage) whose ``total`` generators its own are, in
    order, from number ``first`` on."""
    states = generators(model)
    total = len(states) if total is None else total
    values = starting_states(total, seed=seed, rank=rank, saved=saved)[first : first + len(states)]
    for state, value in zip(states, values, strict=True):
        state.assign(value.astype(state.dtype))


def starting_states(count: int, *, seed: int, rank: int, saved: np.ndarray | None = None) -> list[np.ndarray]:
    """The states (``[seed, draws]``) of ``count`` generators, in the model's order, for ``rank`` from ``seed``, at
    ``saved`` draws (a checkpoint's; None: none); for loops that hold the states as values (``stateless_call``)."""
    if saved is not None and len(saved) != count:
        raise ValueError(
            f"Expected a count of draws for each of the model's {count} seed generators. Received: {len(saved)}"
        )
    keys = np.array([(rank << 20) + index for index in range(count)], np.int64)
    words = schedule.sort_values(keys, seed=seed, epoch=0, shuffle=True) >> np.uint64(33)  # 31 bits: any seed dtype
    return [np.array([int(words[index]), int(saved[index]) if saved is not None else 0]) for index in range(count)]
