"""A worker's side of the step (sparkdl.modes.parameter_server.push_pull) against a real server, without Spark."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from shards import LR, SGDShard

from sparkdl.keras import adopted
from sparkdl.keras.optimizer_hooks import intercept_apply
from sparkdl.modes.parameter_server.push_pull import PushPull, StepHook
from sparkdl.ps.client import ParameterClient
from sparkdl.ps.rules import Immediate
from sparkdl.ps.server import ParameterServer
from sparkdl.ps.sharding import ShardSpans, assign_shards

SECRET = b"ps-exchange-secret"


def make_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    model.jit_compile = False
    return model


def serve(model, num_servers, compression=None):
    """A server holding ``model``'s weights in plain-SGD shards (``w -= LR * g``), and the layout of its shards."""
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    layout = ShardSpans(shapes, assign_shards([int(np.prod(s)) for s in shapes], num_servers))
    weights = model.get_weights()
    shards = [SGDShard(np.concatenate([weights[i].ravel() for i in shard])) for shard in layout.shards]
    server = ParameterServer(
        shards, host="127.0.0.1", secret=SECRET, rule=Immediate(), num_workers=1, compression=compression
    )
    return server, layout


def connect(server, layout, compression=None):
    return ParameterClient(
        server.addresses, worker=0, secret=SECRET, shard_sizes=layout.shard_sizes, compression=compression
    )


def gradient(model, weights, x, y):
    """The loss's gradient at ``weights`` on the batch, in model order."""
    model.set_weights(weights)
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


@pytest.mark.parametrize("num_servers", [1, 2])
def test_a_pull_never_writes_a_buffer_something_still_holds(num_servers):
    """TensorFlow adopts a pulled buffer as the variables' memory and holds a reference to it while anything uses
    it: a pull writes only a buffer nobody else references, and reuses such a one rather than a fresh one."""
    model = make_model()
    server, layout = serve(model, num_servers)
    with server, connect(server, layout) as client:
        exchange = PushPull(client, layout, None)
        first = exchange.pull()
        kept = first.copy()
        second = exchange.push(np.ones(layout.size, np.float32), np.float32(1.0))  # ``first`` still held
        assert second is not first and adopted.is_aligned(second)
        np.testing.assert_array_equal(first, kept)
        np.testing.assert_allclose(second, kept - LR, rtol=1e-6)
        released = id(first)
        del first  # let go of: the next pull reuses it
        third = exchange.push(np.ones(layout.size, np.float32), np.float32(1.0))
        assert id(third) == released
        np.testing.assert_allclose(third, kept - 2 * LR, rtol=1e-6)
        np.testing.assert_allclose(second, kept - LR, rtol=1e-6)
    assert (exchange.pushes, exchange.pulls) == (2, 3)


@pytest.mark.parametrize("num_servers", [1, 2])
def test_push_every_sums_in_the_graph_and_pushes_the_mean_then_the_remainder(num_servers):
    """Five steps with push_every=2: the means of steps 1-2 and 3-4 (each pair taken at the same pulled weights),
    then step 5's gradient when training ends; the model takes the server's weights after each push."""
    model, reference = make_model(), make_model()
    rng = np.random.default_rng(0)
    batches = [(rng.random((8, 4), np.float32), rng.random((8, 2), np.float32)) for _ in range(5)]
    server, layout = serve(model, num_servers)
    with server, connect(server, layout) as client:
        exchange = PushPull(client, layout, None)
        hook = StepHook(model, layout, exchange, 2, None)
        hook.assign(model.trainable_variables, exchange.pull())
        with intercept_apply(model.optimizer, hook):
            for x, y in batches:
                model.train_on_batch(x, y)
        hook.flush()
        got = np.concatenate(client.pull())
    weights = reference.get_weights()
    for group in ([0, 1], [2, 3], [4]):
        mean = [np.mean(parts, axis=0) for parts in zip(*(gradient(reference, weights, *batches[i]) for i in group))]
        weights = [w - LR * g for w, g in zip(weights, mean)]
    want = np.concatenate([np.concatenate([weights[i].ravel() for i in shard]) for shard in layout.shards])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert exchange.pushes == 3


def test_a_gradient_beyond_float16s_range_is_refused_by_the_worker():
    model = make_model()
    server, layout = serve(model, 1, compression="fp16")
    with server, connect(server, layout, "fp16") as client:
        exchange = PushPull(client, layout, "fp16")
        with pytest.raises(ValueError, match=r"float16's range .*compression='fp16'"):
            exchange.push(np.zeros(layout.size, np.float16), np.float32(70000.0))
        assert server.stats()["versions"] == [0]
