"""Hooks into a Keras optimizer's ``apply`` so that Keras's own ``fit`` drives distributed training.

Like Horovod's ``DistributedOptimizer``: the compiled train step, metrics and
callbacks stay Keras's; only what happens to a step's gradients changes
(averaged over a ring or by Horovod, or exchanged with a parameter server).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from sparkdl import _compat


@contextlib.contextmanager
def intercept_apply(optimizer, intercept: Callable) -> Iterator[None]:
    """While the block runs, applying gradients calls ``intercept(apply, grads, variables)`` instead.

    ``apply(grads, variables)`` is the optimizer's own application (Keras 3's
    ``apply``, Keras 2's ``apply_gradients``; see ``_compat``).

    Why the instance's class is swapped rather than the optimizer wrapped, as Keras's own
    ``LossScaleOptimizer`` wraps an ``inner_optimizer``: a wrapper is a second optimizer object,
    so the model would have to be compiled again with it (its train step traced anew, which
    ``model.compile`` resets) and given back its own after ``fit``; its slots would live under the
    wrapper's path, so a checkpoint or result saved mid-fit would hold a different optimizer
    (class, config, variable paths) than the user's unless unwrapped for every save; and with
    Keras 2 (``_compat``) the wrapper would have to mirror ``apply_gradients`` too. The swap
    changes only which ``apply`` runs: the same instance keeps its variables, its tracking by
    the model and its config, and ``saved_form`` restores the class for a save in one assignment.
    """
    original = type(optimizer)
    optimizer.__class__ = _compat.hooked_optimizer_class(original, intercept)
    try:
        yield
    finally:
        optimizer.__class__ = original


#: Stand-in optimizers (by id) that a model holds while ``fit`` runs, each with the getter of the
#: optimizer a save must record instead (sharded mode's optimizer over one rank's shard).
_STAND_INS: dict[int, Callable[[], Any]] = {}


@contextlib.contextmanager
def standing_in(stand_in, saved_as: Callable[[], Any]) -> Iterator[None]:
    """While the block runs, :func:`saved_form` records ``saved_as()`` wherever a model holds ``stand_in``."""
    _STAND_INS[id(stand_in)] = saved_as
    try:
        yield
    finally:
        del _STAND_INS[id(stand_in)]


@contextlib.contextmanager
def saved_form(model) -> Iterator[None]:
    """While the block runs, the model's optimizer is the one a save should record: of the user's own
    class (Keras records the class), and the user's whole optimizer where a stand-in holds its place."""
    optimizer = model.optimizer
    saved_as = _STAND_INS.get(id(optimizer))
    if saved_as is not None:
        model.optimizer = saved_as()
        try:
            yield
        finally:
            model.optimizer = optimizer
        return
    hooked = type(optimizer)
    original = getattr(hooked, "hooked_from", None)
    if original is None:
        yield
        return
    optimizer.__class__ = original
    try:
        yield
    finally:
        optimizer.__class__ = hooked
