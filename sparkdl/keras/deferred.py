"""Keras models built without their weights' memory, run only on weights passed in (``stateless_call``).

A Keras 3 variable created inside a ``keras.StatelessScope(initialize_variables=False)`` is *deferred*:
it knows its shape, dtype and initializer but holds no value, and a ``stateless_call`` reads the
tensors it is given in its place. Fully sharded data parallelism builds every layer this way on a
worker, so that the only copy of a layer's weights a rank keeps between uses is its shard.

Keras remembers every deferred variable and initialises all of them when a stateless scope next
closes outside any other (``stateless_call`` opens one each call): :func:`build` takes the model's
variables off that list, where they would otherwise be allocated at the first call. That list is
Keras's own state (``keras.src.backend.common.global_state``), the one private name used here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import keras  # at run time imported where used: importing sparkdl must not load TensorFlow

_PENDING = "uninitialized_variables"  # Keras's list of deferred variables to initialise


def build(make: Callable[[], keras.Model]) -> keras.Model:
    """The model ``make`` builds, its variables deferred for good (no memory; run it with ``stateless_call``)."""
    import keras
    from keras.src.backend.common import global_state

    with keras.StatelessScope(initialize_variables=False):
        model = make()
    ours = {id(variable) for variable in model.variables}
    pending = global_state.get_global_attribute(_PENDING, [], set_to_default=True)
    global_state.set_global_attribute(_PENDING, [v for v in pending if id(v) not in ours])
    return model


def is_deferred(variable) -> bool:
    """Whether ``variable`` holds no value of its own (see :func:`build`)."""
    return variable._value is None


def initial_value(variable):
    """The value a deferred ``variable``'s initializer gives (a seed generator's state, say), as a tensor."""
    import keras

    return keras.ops.convert_to_tensor(variable._initializer(variable.shape, dtype=variable.dtype))
