"""How sync mode's gradients travel: buckets that overlap backprop, compression, and the step profile."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from collective_ranks import run_ranks
from models import make_mlp

import sparkdl
from sparkdl.collective import compression
from sparkdl.keras import compiled_update
from sparkdl.modes.sync.mode import SyncMode
from sparkdl.modes.sync.reducer import GradientReducer
from sparkdl.modes.sync.step_profile import PHASES


def _averaged(comm, gradients, **reducer_options):
    """Rank ``comm.rank``'s ``gradients`` averaged over the ranks by a GradientReducer inside a tf.function."""
    reducer = GradientReducer(comm, timeout=30, **reducer_options)
    variables = [tf.Variable(tf.zeros_like(g)) for g in gradients]

    @tf.function
    def step(grads):
        return reducer(lambda averaged, _: averaged, list(grads), variables)

    return [t.numpy() for t in step([tf.constant(g) for g in gradients])], reducer


def _gradients(rank, sizes=((300, 40), (40,), (40, 7), (7,))):
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(shape).astype(np.float32) for shape in sizes]


@pytest.mark.parametrize("overlap", [True, False])
def test_buckets_average_every_gradient_exactly_last_layers_first(overlap):
    def body(comm):
        return _averaged(comm, _gradients(comm.rank), overlap=overlap, bucket_bytes=1000)

    (first, reducer), (second, _) = run_ranks(2, body)
    expected = [(a + b) / 2 for a, b in zip(_gradients(0), _gradients(1))]
    for got in (first, second):
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)  # a sum of two float32 halved: exact
    # buckets of about 1000 bytes, from the last variable to the first (the order backprop produces them)
    assert reducer.buckets == ([[3, 2], [1, 0]] if overlap else [[0, 1, 2, 3]])


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_compressed_gradients_cross_at_half_the_bytes_and_come_back_as_float32(name):
    sizes = ((1000, 100), (100,))

    def body(comm, compressed):
        before = sum(sent for sent, _ in comm.traffic().values())
        averaged, _ = _averaged(comm, _gradients(comm.rank, sizes), compression=compressed)
        return averaged, sum(sent for sent, _ in comm.traffic().values()) - before

    full = run_ranks(2, lambda comm: body(comm, None))
    half = run_ranks(2, lambda comm: body(comm, name))
    wire = compression.wire_dtype(name)
    for rank in range(2):
        averaged, sent = half[rank]
        assert 0.49 < sent / full[rank][1] < 0.51, (sent, full[rank][1])
        for got, a, b in zip(averaged, _gradients(0, sizes), _gradients(1, sizes)):
            assert got.dtype == np.float32
            # each rank's gradient narrowed once, added in float32 and rounded once for the wire, widened, halved
            expected = (a.astype(wire).astype(np.float32) + b.astype(wire).astype(np.float32)).astype(wire)
            np.testing.assert_array_equal(got, expected.astype(np.float32) / 2)
            np.testing.assert_allclose(got, (a + b) / 2, atol=0.05, rtol=0.02)


def test_fp16_refuses_a_gradient_beyond_its_range():
    def body(comm):
        gradients = _gradients(comm.rank)
        gradients[0][0, 0] = 1e6 if comm.rank == 0 else 0.0
        try:
            _averaged(comm, gradients, compression="fp16")
        except Exception as error:  # raised inside the compiled step: TensorFlow wraps it
            return str(error)
        return None

    errors = run_ranks(2, body, timeout=3, capture=True)
    assert "Expected gradients within float16's range" in str(errors[0]) and "compression='bf16'" in str(errors[0])
    assert errors[1] is not None  # its peer never came: it fails too, rather than wait for ever


def test_compression_names_round_trip_and_bad_names_are_refused():
    values = np.array([1.0, -2.5, 3e-3, 1e30], np.float32)
    np.testing.assert_allclose(compression.widen(compression.narrow(values, "bf16")), values, rtol=1e-2)
    np.testing.assert_allclose(compression.widen(compression.narrow(values[:3], "fp16")), values[:3], rtol=1e-3)
    with pytest.raises(ValueError, match="float16's range"):
        compression.narrow(values, "fp16")
    with pytest.raises(ValueError, match=r"`compression`.*'bf16' or 'fp16'.*compression='int8'"):
        compression.check("int8")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"compression": "int8"}, r"Expected `compression` to be None"),
        ({"overlap": "yes"}, r"Expected `overlap` to be True or False"),
        ({"profile": 1}, r"Expected `profile` to be True or False"),
        ({"mode": "average", "compression": "bf16"}, r"`compression` applies to mode="),
        ({"mode": "average", "overlap": False}, r"`overlap` applies to mode='sync' or 'sharded' only"),
    ],
)
def test_exchange_settings_are_checked_on_the_driver(digits_df, options, message):
    with pytest.raises(ValueError, match=message):
        sparkdl.fit(digits_df, make_mlp(), num_workers=2, epochs=1, **options)


def test_horovod_averages_uncompressed():
    # configured directly: where Horovod is not installed, fit stops earlier, at the backend's own check
    with pytest.raises(ValueError, match=r"Expected compression=None with backend='horovod'"):
        SyncMode().configure("sync", None, {"backend": "horovod", "compression": "bf16"})


def _wide_model():
    """A first layer whose weight gradient takes far longer to compute than the last layers' take to average."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((2048,)),
            keras.layers.Dense(1024, activation="relu"),  # 8 MB of gradients: a bucket of its own
            keras.layers.Dense(1024, activation="relu"),  # 4 MB: the first bucket, with the last layer
            keras.layers.Dense(4),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model


def test_buckets_overlap_a_running_backward_pass_on_the_workers(spark):
    rows, workers, batch_size, epochs = 1536, 2, 128, 2
    rng = np.random.default_rng(0)
    data = [
        (rng.standard_normal(2048).astype(np.float32).tolist(), rng.standard_normal(4).tolist()) for _ in range(rows)
    ]
    df = spark.createDataFrame(data, "features array<float>, label array<double>").cache()

    profiles = {}
    for overlap in (True, False):
        result = sparkdl.fit(
            df,
            _wide_model(),
            num_workers=workers,
            epochs=epochs,
            batch_size=batch_size,
            seed=0,
            overlap=overlap,
            profile=True,
            progress=False,
        )
        profiles[overlap] = result.stats["step_profile"]

    overlapped, blocking = profiles[True], profiles[False]
    assert overlapped["buckets"] == 2 and blocking["buckets"] == 1
    assert overlapped["compiled_update"] and blocking["compiled_update"]  # 3.2M parameters: XLA's update
    steps = epochs * rows // workers // batch_size - 3  # the first three steps trace the graph: not counted
    assert overlapped["steps"] == blocking["steps"] == steps
    # In some step, when backprop ended (the first layer's weight gradient computed), the last layers' bucket had
    # already been averaged: communication ran while backprop was still computing. Without buckets, in no step:
    # the one bucket starts after backprop. How often is a matter of the cores free for it, not of the mechanism.
    assert sum(overlapped["steps_overlapped"]) > 0, overlapped
    assert blocking["steps_overlapped"] == [0, 0] and blocking["buckets_done_early"] == [0.0, 0.0]
    for profile in profiles.values():
        assert set(PHASES) <= set(profile)
        for phase in PHASES:
            assert len(profile[phase]) == 2 and min(profile[phase]) >= 0.0, (phase, profile)
        assert min(profile["forward_backward"]) > 0.0
    assert overlapped["wait_for_peers"] == [0.0, 0.0]  # with buckets in flight no rank waits for the others first
    assert min(blocking["wait_for_peers"]) > 0.0 and min(blocking["collective"]) > 0.0  # a barrier, then the exchange


def test_the_compiled_update_applies_what_keras_applies_op_by_op():
    sizes = ((1100, 1000), (1000,))  # 1.1M parameters: enough for the update to be compiled
    initial = [np.random.default_rng(7).standard_normal(shape).astype(np.float32) for shape in sizes]

    def body(comm, compile_update):
        reducer = GradientReducer(comm, timeout=30, compile_update=compile_update)
        weights = [keras.Variable(w) for w in initial]
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(weights)
        assert compiled_update.pays(optimizer, weights)

        @tf.function
        def step(grads):
            reducer(optimizer.apply, list(grads), weights)

        for _ in range(3):
            step([tf.constant(g) for g in _gradients(comm.rank, sizes)])
        return [w.numpy() for w in weights]

    op_by_op = run_ranks(2, lambda comm: body(comm, False))[0]
    compiled = run_ranks(2, lambda comm: body(comm, True))[0]
    for before, keras_own, xla in zip(initial, op_by_op, compiled):
        assert np.abs(keras_own - before).min() > 1e-3  # every weight moved (Adam: about 0.01 a step)
        np.testing.assert_allclose(xla, keras_own, rtol=1e-5, atol=1e-6)


class _HostCallingSGD(keras.optimizers.SGD):
    """An update that calls back into Python, which XLA cannot compile."""

    def update_step(self, gradient, variable, learning_rate):
        rate = tf.numpy_function(lambda r: r, [tf.cast(learning_rate, tf.float32)], tf.float32)
        variable.assign_sub(gradient * rate)


def test_an_update_xla_cannot_compile_runs_op_by_op_with_a_warning(caplog):
    large = [keras.Variable(np.zeros((1100, 1000), np.float32))]
    small = [keras.Variable(np.zeros((100, 10), np.float32))]
    assert compiled_update.pays(keras.optimizers.SGD(), large)
    with caplog.at_level("WARNING", logger="sparkdl.keras.compiled_update"):
        assert not compiled_update.pays(keras.optimizers.SGD(), small)  # too small to pay: no trial, no warning
        assert not caplog.records
        assert not compiled_update.pays(_HostCallingSGD(), large)
    assert "XLA cannot compile the update of _HostCallingSGD" in caplog.text
    assert large[0].numpy().max() == 0  # the trial touched stand-ins only


def test_the_trial_compile_runs_once_per_optimizer_kind_in_a_process(caplog, monkeypatch):
    monkeypatch.setattr(compiled_update, "_verdicts", compiled_update._verdicts.__class__())
    monkeypatch.setattr(compiled_update, "_KEPT_VERDICTS", 2)
    large = [keras.Variable(np.zeros((1100, 1000), np.float32))]
    with caplog.at_level("WARNING", logger="sparkdl.keras.compiled_update"):
        assert not compiled_update.pays(_HostCallingSGD(0.5), large)
        assert not compiled_update.pays(_HostCallingSGD(0.5), large)  # a later fit's optimizer, named anew by Keras
    assert caplog.text.count("XLA cannot compile") == 1  # the verdict was kept: no second trial
    caplog.clear()

    class _HostCallingSGD2(_HostCallingSGD):  # another class: tried anew, whatever it is called
        pass

    with caplog.at_level("WARNING", logger="sparkdl.keras.compiled_update"):
        assert not compiled_update.pays(_HostCallingSGD2(0.5), large)
        assert not compiled_update.pays(_HostCallingSGD(0.25), large)  # another configuration: tried anew
    assert caplog.text.count("XLA cannot compile") == 2
    caplog.clear()

    with caplog.at_level("WARNING", logger="sparkdl.keras.compiled_update"):  # two verdicts kept, the oldest dropped
        assert not compiled_update.pays(_HostCallingSGD(0.25), large)
        assert not compiled_update.pays(_HostCallingSGD(0.5), large)
    assert caplog.text.count("XLA cannot compile") == 1, "the first optimizer's verdict should have been dropped"


def test_bf16_compression_trains_digits_as_well_as_float32(digits_df, digits):
    _, x_test, _, y_test = digits
    accuracy = {}
    for name in (None, "bf16"):
        result = sparkdl.fit(
            digits_df, make_mlp(), num_workers=2, epochs=12, batch_size=16, seed=0, compression=name, progress=False
        )
        accuracy[name] = float(np.mean(result.model.predict(x_test, verbose=0).argmax(axis=1) == y_test))
    assert accuracy[None] >= 0.95, accuracy
    assert abs(accuracy["bf16"] - accuracy[None]) <= 0.01, accuracy
