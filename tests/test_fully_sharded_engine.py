"""Fully sharded data parallelism (ZeRO-3) without Spark: ranks as threads over real sockets hold 1/N of the weights
between uses, their units run on gathered weights only, and they train the weights of one process."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from collective_ranks import run_ranks

from sparkdl.keras import deferred
from sparkdl.modes.fully_sharded import state, units
from sparkdl.modes.fully_sharded.engine import FullyShardedReplica
from sparkdl.modes.pipeline.cut import build_stage
from sparkdl.schedule import StepScales

STEPS = 3


def _model(optimizer=None):
    """Units: [Dense a + relu], [BatchNorm], [Dense c (L2) + Activation]; 6 inputs, 3 outputs, odd sizes."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(7, activation="relu", name="a"),
            keras.layers.BatchNormalization(name="b"),
            keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.01), name="c"),
            keras.layers.Activation("tanh", name="d"),
        ]
    )
    model.compile(optimizer or keras.optimizers.Adam(0.05), "mse")
    return model


def _batch(rank, step, rows=8):
    rng = np.random.default_rng(100 * step + rank)
    return rng.standard_normal((rows, 6)).astype(np.float32), rng.standard_normal((rows, 3)).astype(np.float32)


def _replica(model, comm, **options):
    plan = units.plan_units(model)
    layout = units.shard_layout(model, plan, comm.size)
    part = state.read_part(state.rank_part(model, plan, layout, comm.rank))
    return FullyShardedReplica.from_part(plan, layout, comm, part, model.get_compile_config(), timeout=30, **options)


def _reference(model, ranks, scales=None):
    """One process: each step, the mean over ranks of each rank's gradient (scaled), applied by the model's Adam."""
    for step in range(STEPS):
        gradients = []
        for rank in range(ranks):
            x, y = _batch(rank, step)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y)) + tf.add_n(model.losses)
            scale = 1.0 if scales is None else scales[rank][step]
            gradients.append([g * scale for g in tape.gradient(loss, model.trainable_variables)])
        mean = [tf.add_n(list(parts)) / ranks for parts in zip(*gradients)]
        model.optimizer.apply(mean, model.trainable_variables)
    return model


def test_units_start_at_the_layers_with_trainable_weights():
    plan = units.plan_units(_model())
    assert [stage.names for stage in plan.stages] == [("a",), ("b",), ("c", "d")]
    layout = units.shard_layout(_model(), plan, 4)
    assert layout.buckets == ((0, 1), (2, 3), (4, 5)) and layout.sizes == (42, 7, 7, 7, 21, 3)
    assert [layout.part(u) for u in range(3)] == [13, 4, 6]  # 49, 14 and 24 values over 4 ranks, padded


def test_a_unit_built_deferred_holds_no_memory_and_runs_on_weights_passed_in():
    plan = units.plan_units(_model())
    unit = deferred.build(lambda: build_stage(plan, 0))
    assert unit.weights and all(deferred.is_deferred(v) for v in unit.weights)
    kernel, bias = np.ones((6, 7), np.float32), np.arange(7, dtype=np.float32)
    outputs, _ = unit.stateless_call([kernel, bias], [], np.ones((2, 6), np.float32))
    np.testing.assert_allclose(outputs, np.maximum(6.0 + np.arange(7), 0)[None].repeat(2, 0))
    other = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])  # a later model and a later scope
    other(np.ones((1, 2), np.float32))
    assert all(deferred.is_deferred(v) for v in unit.weights)  # Keras did not initialise them behind our back


@pytest.mark.parametrize("kept_gathered", [1, 2, 3])
def test_two_ranks_train_the_weights_and_optimizer_state_of_one_process(kept_gathered):
    """Adam, an L2 penalty and BatchNorm, 3 steps on each rank's own batches: every rank's gathered weights and
    optimizer state equal one process applying the mean gradient; each rank held about half the weights between
    steps, and during one two units' gathered weights at most, or, kept from the forward pass, all of them."""
    initial = _model().get_weights()

    def body(comm):
        model = _model()
        model.set_weights(initial)
        replica = _replica(model, comm, kept_gathered=kept_gathered)
        losses = [replica.train_step(*_batch(comm.rank, step)) for step in range(STEPS)]
        gathered_bytes = comm.bytes_sent()["tcp"]["allgather"]["float32"]
        assert all(deferred.is_deferred(v) for unit in replica.units for v in unit.model.weights)
        held = replica.held_bytes()
        replica.average_statistics()
        gathered = replica.gather_state()
        replica.close()
        return losses, held, gathered, [np.asarray(v) for u in replica.statistics for v in u], gathered_bytes

    results = run_ranks(2, body, timeout=30)
    reference = _model()
    reference.set_weights(initial)
    _reference(reference, 2)
    weights, optimizer, statistics = results[0][2]
    assert results[1][2] is None  # only rank 0 gets the whole
    whole = _model()
    whole.set_weights(initial)
    state.assemble(whole, units.plan_units(whole), weights, optimizer, statistics)
    for got, want in zip(whole.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    assert int(whole.optimizer.iterations.numpy()) == STEPS
    for got, want in zip(whole.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    floats = [(got, want) for got, want in zip(results[0][3], results[1][3]) if got.dtype.kind == "f"]
    assert len(floats) == 2  # BatchNorm's moving mean and variance (the seed states stay each rank's)
    for got, want in floats:  # averaged over the ranks
        np.testing.assert_array_equal(got, want)
    held = results[0][1]
    assert held["whole_weight_bytes"] == 4 * (42 + 7 + 7 + 7 + 21 + 3)
    assert held["weight_bytes"] == 4 * (25 + 7 + 12) < 0.5 * held["whole_weight_bytes"] + 4 * 3  # padding only
    assert held["optimizer_bytes"] < 0.6 * 2 * held["whole_weight_bytes"]  # Adam: two slots over half the weights
    # each rank sent its shard of a kept unit once a step, of every other unit twice (25, 7 and 12 values)
    parts = [4 * 25, 4 * 7, 4 * 12]
    for rank in range(2):
        assert results[rank][4] == STEPS * (sum(parts) + sum(parts[: 3 - kept_gathered]))
    if kept_gathered == 1:
        # gathered weights alive at once, counted until let go: the largest unit's (50 values padded), at most twice
        # (its gathered rows and the tensors made of them), never every unit's
        assert 4 * 50 <= held["gathered_peak_bytes"] <= 2 * 4 * 50, held
    elif kept_gathered == 3:  # every unit's, from its forward pass to its backward pass (50, 14 and 24 values, padded)
        assert held["gathered_peak_bytes"] >= 4 * (50 + 14 + 24), held
    assert all(np.isfinite(results[r][0]).all() for r in range(2))


def test_compressed_unoverlapped_and_scaled_steps_train_as_one_process():
    """bfloat16 gradients on the wire (to bfloat16's precision), every collective waited for where it starts, and
    unequal row weights per rank: still one process's training."""
    initial = _model(keras.optimizers.SGD(0.1)).get_weights()
    scales = np.array([[0.5, 1.5, 1.0], [1.5, 0.5, 1.0]], np.float32)

    def body(comm):
        model = _model(keras.optimizers.SGD(0.1))
        model.set_weights(initial)
        replica = _replica(model, comm, compression="bf16", overlap=False, scales=StepScales.of(scales[comm.rank]))
        for step in range(STEPS):
            replica.train_step(*_batch(comm.rank, step))
        gathered = replica.gather_state()
        replica.close()
        return gathered

    weights = run_ranks(2, body, timeout=30)[0][0]
    reference = _model(keras.optimizers.SGD(0.1))
    reference.set_weights(initial)
    _reference(reference, 2, scales)
    for got, want in zip(weights, reference.trainable_variables):
        np.testing.assert_allclose(got.reshape(want.shape), want.numpy(), rtol=2e-2, atol=2e-3)


def test_a_rank_that_never_sends_its_shard_times_out_with_a_message_naming_the_unit():
    def body(comm):
        model = _model()
        replica = _replica(model, comm)
        replica.timeout = 1.0
        if comm.rank == 0:
            replica.train_step(*_batch(0, 0))
        return None

    results = run_ranks(2, body, timeout=5, capture=True)
    assert "gathering unit 0's weights" in str(results[0])


@pytest.mark.parametrize("layers, message", [([], "has none"), (["branch"], "to gather its weights layer by layer")])
def test_models_that_cannot_be_cut_into_units_are_refused(layers, message):
    inputs = keras.Input((4,))
    if layers:
        left, right = keras.layers.Dense(2)(inputs), keras.layers.Dense(2)(inputs)
        outputs = keras.layers.Add()([left, right])
    else:
        outputs = keras.layers.Activation("relu")(inputs)
    with pytest.raises(ValueError, match=message):
        units.plan_units(keras.Model(inputs, outputs))
