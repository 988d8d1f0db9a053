"""A mode and an allreduce algorithm registered from test modules, as another package would register them, with no
edit inside ``sparkdl/``: the mode (``step_average_mode.py``: a plan's ``train`` in sparkdl's barrier frame) trains
on Spark, averaging its replicas with the algorithm (``recursive_doubling.py``); both are in ``help(sparkdl.fit)``,
in ``sparkdl.plan``'s table and in the cost model while registered, and gone from them after."""

import inspect

import keras
import numpy as np
import pytest
from models import make_mlp
from recursive_doubling import NAME as DOUBLING
from recursive_doubling import RecursiveDoubling
from step_average_mode import NAME as STEP_AVERAGE
from step_average_mode import StepAverageMode

import sparkdl
from sparkdl.collective import cost, register_algorithm, unregister_algorithm
from sparkdl.modes import registry
from sparkdl.planner.planned import PLANNED, register_planned, unregister_planned


def _step_cost(n: int, nbytes: float) -> cost.Cost:
    """A step of step_average with recursive doubling: one allreduce of the weights (a plain-SGD model's state)."""
    return cost.collective("allreduce", DOUBLING, n, nbytes)


@pytest.fixture
def registered():
    register_algorithm(RecursiveDoubling())
    mode = registry.register(StepAverageMode())
    register_planned(STEP_AVERAGE, {"mode": STEP_AVERAGE, "average_with": DOUBLING}, _step_cost)
    yield
    unregister_planned(STEP_AVERAGE)
    registry.unregister(mode)
    unregister_algorithm(DOUBLING)


def _model():
    return make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(0.1), seed=2)


def test_a_mode_and_an_algorithm_registered_outside_sparkdl_train_and_appear_in_the_docs_the_plan_and_the_costs(
    registered, spark, digits_df, capsys
):
    documented = " ".join(sparkdl.fit.__doc__.split())
    assert "average_with" in inspect.signature(sparkdl.fit).parameters
    assert f'``"{STEP_AVERAGE}"``: Parameter averaging' in documented
    assert "average_with (a string): step_average: the allreduce algorithm" in documented
    assert ("allreduce", DOUBLING) in cost.priced()

    df = digits_df.limit(256).repartition(2).cache()
    epochs, fits = 2, {}
    for algorithm in (DOUBLING, None):
        fits[algorithm] = sparkdl.fit(
            df, _model(), mode=STEP_AVERAGE, average_with=algorithm, epochs=epochs, batch_size=32, progress=False
        )
    trained = fits[DOUBLING]
    assert len(trained.history["loss"]) == epochs and trained.history["loss"][-1] < trained.history["loss"][0]
    # The algorithm ran where it was asked for: every rank's TCP links carried exactly the allreduce bytes its cost
    # says for each averaged variable, every step. Left to the communicator, the same averaging went through the
    # host's shared memory (local[2]: one host), and no allreduce byte crossed TCP.
    averaged = [v for v in [*_model().trainable_variables, *_model().optimizer.variables] if "float" in v.dtype]
    per_step = sum(_step_cost(2, np.asarray(v).nbytes).rank_sent for v in averaged)
    steps = trained.steps_per_epoch * epochs
    assert [rank["tcp"]["allreduce"]["float32"] for rank in trained.stats["wire_bytes"]] == [steps * per_step] * 2
    assert [rank["tcp"].get("allreduce", {}) for rank in fits[None].stats["wire_bytes"]] == [{}, {}]
    assert all(rank["shm"]["allreduce"]["float32"] > 0 for rank in fits[None].stats["wire_bytes"])
    with pytest.raises(ValueError, match=r"Expected `average_with` among \['ring', 'tree', 'naive', 'hierarchical', "):
        sparkdl.fit(df, _model(), mode=STEP_AVERAGE, average_with="no_such_algorithm")

    plan = sparkdl.plan(df, _model(), num_workers=2, batch_size=16, modes=["sync", STEP_AVERAGE])
    assert STEP_AVERAGE in capsys.readouterr().out
    priced = {choice.mode for choice in plan.choices}
    assert priced == {"sync", STEP_AVERAGE}
    assert PLANNED[STEP_AVERAGE].fit_keywords(2) == {"mode": STEP_AVERAGE, "average_with": DOUBLING}


def test_once_unregistered_they_are_gone_from_the_docs_the_registries_and_the_costs(registered):
    assert STEP_AVERAGE in registry.MODES
    unregister_planned(STEP_AVERAGE)
    registry.unregister(registry.MODES[STEP_AVERAGE])
    unregister_algorithm(DOUBLING)
    try:
        assert STEP_AVERAGE not in sparkdl.fit.__doc__ and "average_with" not in sparkdl.fit.__doc__
        assert STEP_AVERAGE not in registry.MODES and STEP_AVERAGE not in PLANNED
        assert ("allreduce", DOUBLING) not in cost.priced()
    finally:  # the fixture removes them again
        register_algorithm(RecursiveDoubling())
        registry.register(StepAverageMode())
        register_planned(STEP_AVERAGE, {"mode": STEP_AVERAGE, "average_with": DOUBLING}, _step_cost)
