"""``sparkdl.fit(..., compression=...)`` in the parameter-server modes, on real Spark: accuracy, bytes, errors."""

import keras
import numpy as np
import pytest
from frames import digits_frame
from models import make_mlp

import sparkdl
from sparkdl.net.frames import HEADER


def test_async_with_bf16_pushes_trains_as_well_at_half_the_push_bytes(spark, digits):
    """The same fit with float32 and with bfloat16 pushes: the pushes' bytes exactly halved (counted by the server as
    it read them off its sockets), the pulls' not (weights travel as float32), and the bf16 fit trained as far as the
    float32 one: its held-out loss within 3% of it, and well below the untrained model's.

    256 rows and 3 epochs suffice: the bytes are exact whatever the number of pushes, and the held-out loss falls
    from 2.3 to 1.5, where fits of either compression (two workers' pushes interleave as they come) lie within 1.5%
    of each other; a push that carried other values than the gradient's, or none, would not train that far."""
    x_train, x_test, y_train, y_test = digits
    df = digits_frame(spark, x_train[:256], y_train[:256])
    untrained_loss = make_mlp().evaluate(x_test, y_test, verbose=0)[0]
    results, losses = {}, {}
    for compression in (None, "bf16"):
        result = sparkdl.fit(
            df,
            make_mlp(),
            num_workers=2,
            mode="async",
            epochs=3,
            batch_size=16,
            seed=0,
            compression=compression,
            progress=False,
        )
        results[compression] = result
        losses[compression] = result.model.evaluate(x_test, y_test, verbose=0)[0]
    assert losses["bf16"] < 0.75 * untrained_loss, (losses, untrained_loss)
    assert abs(losses["bf16"] - losses[None]) <= 0.03 * losses[None], losses
    plain, narrowed = results[None].stats, results["bf16"].stats
    assert plain["pushes"] == narrowed["pushes"] and plain["pulls"] == narrowed["pulls"]
    parameters = sum(int(np.prod(w.shape)) for w in results[None].model.trainable_weights)
    # Every request is a 40-byte header (sparkdl.net.frames.HEADER): the pushes, the pulls, each worker's "done" and
    # its "resume" (with its rows and their keys' sum: 16 bytes).
    headers = HEADER.size * (plain["pushes"] + plain["pulls"] + 2 + 2) + 16 * 2
    assert plain["bytes_in"] - headers == 4 * parameters * plain["pushes"]
    assert narrowed["bytes_in"] - headers == 2 * parameters * narrowed["pushes"]
    assert narrowed["bytes_out"] == plain["bytes_out"]  # every pull's float32 weights
    assert narrowed["bytes"] == (2 * narrowed["pushes"] + 4 * narrowed["pulls"]) * parameters  # what the workers count


@pytest.mark.parametrize(
    "mode, options", [("ssp", {"max_staleness": 1, "num_servers": 2}), ("hogwild", {"push_every": 2})]
)
def test_every_parameter_server_mode_takes_compression(spark, digits, mode, options):
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:256], y_train[:256])
    result = sparkdl.fit(
        df, make_mlp(), num_workers=2, mode=mode, epochs=3, batch_size=16, seed=0, compression="fp16", **options
    )
    assert result.history["loss"][-1] < result.history["loss"][0]
    if mode == "ssp":
        assert result.stats["max_staleness"] <= 1


def test_a_gradient_beyond_float16s_range_fails_the_fit_naming_the_setting(spark):
    """A regression towards targets of 1e6: the first gradient is far beyond 65504. It is refused by the worker
    before it is sent, never sent as infinity."""
    rows = np.random.default_rng(0).random((64, 4)).astype(np.float32)
    df = spark.createDataFrame([(r.tolist(), 1e6) for r in rows], "features array<float>, label float")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(sparkdl.WorkerError, match=r"(?s)float16's range.*compression='fp16'.*compression='bf16'"):
        sparkdl.fit(df, model, num_workers=1, mode="async", epochs=1, batch_size=16, compression="fp16", timeout=60)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"mode": "async", "compression": "int8"},
            r"Expected `compression` to be None \(float32 gradients\), 'bf16' or 'fp16'\. Received: compression='int8'",
        ),
        (
            {"mode": "average", "compression": "bf16"},
            r"`compression` applies to mode='sync' or 'sharded' or 'async' or 'hogwild' or 'ssp' or 'sync_ps' only\. "
            r"Received: compression='bf16' with mode='average'",
        ),
    ],
)
def test_bad_compression_settings_are_refused_before_any_job(digits_df, kwargs, message):
    with pytest.raises(ValueError, match=message):
        sparkdl.fit(digits_df, make_mlp(), epochs=1, **kwargs)
