"""mode="sharded" (ZeRO stage 1): the weights and optimizer state of sync mode, 1/N of the state per rank."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from collective_ranks import run_ranks
from frames import digits_frame
from models import make_mlp

import sparkdl
from sparkdl.modes.sync.sharded import ShardLayout, sharded_optimizer


def test_a_shard_layout_cuts_every_bucket_evenly_and_rebuilds_every_variable():
    sizes = (7, 5, 11, 1)  # buckets of 12 and 12 elements over 5 ranks: padded to 15, parts of 3
    layout = ShardLayout(buckets=((3, 2), (1, 0)), sizes=sizes, ranks=5)
    values = [np.arange(n, dtype=np.float32) + 100 * i for i, n in enumerate(sizes)]
    shards = np.stack([layout.shard_of(values, rank) for rank in range(5)])
    assert shards.shape == (5, layout.shard_size) == (5, 6)
    assert shards[0].tolist() == [300.0, 200.0, 201.0, 100.0, 101.0, 102.0]  # rank 0: the head of each bucket
    rebuilt = list(layout.variables_of(shards))
    assert [i for i, _ in rebuilt] == layout.order == [3, 2, 1, 0]
    for i, part in rebuilt:
        np.testing.assert_array_equal(part, values[i])


def _weights():
    rng = np.random.default_rng(3)
    return [rng.standard_normal(shape).astype(np.float32) for shape in ((6, 5), (5,), (5, 3), (3,))]


def _model(weights):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5), keras.layers.Dense(3)])
    model.set_weights(weights)
    model.compile(keras.optimizers.Adam(0.05), "mse")
    return model


def _batch(rank, step):
    rng = np.random.default_rng(100 * step + rank)
    return rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)


def _gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    return tape.gradient(loss, model.trainable_variables)


def test_ranks_update_their_shards_into_the_weights_and_optimizer_state_of_one_adam():
    """Two ranks (buckets of a few floats, odd lengths: padded), three steps: each rank's weights equal one
    process's Adam on the mean gradient, and the gathered optimizer equals that process's; re-sharded onto
    three ranks, its state comes back whole. (Ranks are threads here: three of them would block TensorFlow's
    two inter-op threads with their collectives.)"""
    initial = _model(_weights()).get_weights()

    def body(comm):
        model = _model(initial)
        with sharded_optimizer(model, comm, timeout=30, bucket_bytes=64) as state:
            step = tf.function(lambda x, y: model.optimizer.apply(_gradients(model, x, y), model.trainable_variables))
            for s in range(3):
                step(*_batch(comm.rank, s))
            assert state.state_bytes() < 0.6 * state.replicated_bytes()
            state.finish()
        return model.get_weights(), [v.numpy() for v in model.optimizer.variables], len(state.optimizer.variables)

    results = run_ranks(2, body)
    single = _model(initial)
    for s in range(3):
        grads = [np.mean(g, axis=0) for g in zip(*[_gradients(single, *_batch(r, s)) for r in range(2)])]
        single.optimizer.apply(grads, single.trainable_variables)
    for weights, _, _ in results:
        for got, want in zip(weights, single.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    gathered = results[0][1]
    for got, want in zip(gathered, single.optimizer.variables, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-7)

    def reshard(comm):
        model = _model(initial)
        model.optimizer.build(model.trainable_variables)
        for variable, value in zip(model.optimizer.variables, gathered):
            variable.assign(value)
        with sharded_optimizer(model, comm, timeout=30, bucket_bytes=64) as state:
            state.finish()
        return [v.numpy() for v in model.optimizer.variables]

    for got, want in zip(run_ranks(3, reshard)[0], gathered, strict=True):
        np.testing.assert_array_equal(got, want)


def test_sharded_fit_gives_sync_modes_weights_and_optimizer_with_half_the_state_per_rank(digits_df):
    results = {
        mode: sparkdl.fit(digits_df, make_mlp(), mode=mode, num_workers=2, epochs=3, batch_size=16, seed=0)
        for mode in ("sync", "sharded")
    }
    sync, sharded = results["sync"], results["sharded"]
    assert "sharded" not in sync.stats
    np.testing.assert_allclose(sharded.history["loss"], sync.history["loss"], rtol=1e-6)
    for got, want in zip(sharded.model.get_weights(), sync.model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    for got, want in zip(sharded.model.optimizer.variables, sync.model.optimizer.variables, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)
    # what each rank's process held of optimizer variables, whichever object held them: measured in the ranks
    held, replicated = (
        sharded.stats["sharded"]["optimizer_state_bytes"],
        sharded.stats["sharded"]["replicated_optimizer_state_bytes"],
    )
    assert len(held) == 2 and all(0.45 * replicated < h < 0.55 * replicated for h in held), (held, replicated)


def test_checkpoints_hold_the_whole_optimizer_and_resume_re_shards_it_onto_another_worker_count(
    spark, digits, tmp_path
):
    """2 epochs on 2 workers with checkpoints: the checkpoint's optimizer equals sync mode's; resumed onto
    1 worker for 2 more, sharded ends where sync resumed from the same checkpoint ends (Adam's moments
    carried, not restarted)."""
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:320], y_train[:320])
    settings = dict(batch_size=16, seed=5)
    directory, sync_directory = tmp_path / "sharded", tmp_path / "sync"
    for mode, where in (("sharded", directory), ("sync", sync_directory)):
        sparkdl.fit(df, make_mlp(seed=1), mode=mode, num_workers=2, epochs=2, checkpoint_dir=str(where), **settings)
    saved = keras.models.load_model(directory / "epoch-000002.keras")
    reference = keras.models.load_model(sync_directory / "epoch-000002.keras")
    assert len(reference.optimizer.variables) > 2
    for got, want in zip(saved.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)

    resumed = {
        mode: sparkdl.fit(
            df, make_mlp(seed=1), mode=mode, num_workers=1, epochs=4, checkpoint_dir=str(where), **settings
        )
        for mode, where in (("sharded", directory), ("sync", directory))
    }
    assert resumed["sharded"].initial_epoch == 2
    for got, want in zip(resumed["sharded"].model.get_weights(), resumed["sync"].model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert max(n for n in os.listdir(directory) if n.endswith(".json")) == "epoch-000004.json"


class _OwnAdam(keras.optimizers.Adam):
    pass


@pytest.mark.parametrize(
    "optimizer, options, message",
    [
        (lambda: keras.optimizers.Lamb(), {}, "Received: Lamb"),
        (lambda: _OwnAdam(), {}, "Received: _OwnAdam"),
        (lambda: keras.optimizers.Adam(clipnorm=1.0), {}, "clipnorm=1.0"),
        (lambda: keras.optimizers.SGD(global_clipnorm=2.0), {}, "global_clipnorm=2.0"),
        (lambda: keras.optimizers.Adam(use_ema=True), {}, "use_ema=True"),
        (lambda: keras.optimizers.Adam(), {"backend": "horovod"}, "`backend` applies to mode='sync' only"),
    ],
)
def test_sharded_refuses_what_it_cannot_split_on_the_driver(digits_df, optimizer, options, message):
    model = make_mlp(optimizer=optimizer())
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        sparkdl.fit(digits_df, model, mode="sharded", num_workers=2, epochs=1, **options)
