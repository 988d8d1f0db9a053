"""A diverging worker's NaN/inf gradients are refused by the parameter server, through sparkdl.fit on real Spark."""

import keras
import pytest
from frames import digits_frame
from models import make_mlp

import sparkdl


def test_async_fit_with_a_diverging_worker_fails_naming_the_worker_and_its_push(spark, digits):
    """With a learning rate of 1e30 the first applied push blows the weights up to ~1e30; the forward pass after the
    next pull overflows and the gradients are NaN: the server refuses that push and the fit fails saying so."""
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:64], y_train[:64])
    model = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(1e30), seed=1)

    with pytest.raises(
        sparkdl.WorkerError, match=r"(?s)worker 0: push #\d+ .*NaN or infinite gradients.*lower the learning rate"
    ):
        sparkdl.fit(df, model, num_workers=1, mode="async", push_every=1, epochs=2, batch_size=16, seed=1)
