"""Compressed pushes on the parameter server's wire (sparkdl.ps with compression): no Spark, real sockets on 127.0.0.1.

The fits with ``compression=`` are in tests/test_ps_compression_fit.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from shards import LR, SGDShard

from sparkdl.keras import adopted
from sparkdl.net.errors import CollectiveError
from sparkdl.net.frames import HEADER
from sparkdl.ps import wire
from sparkdl.ps.client import NonFiniteGradientError, ParameterClient
from sparkdl.ps.rules import Immediate
from sparkdl.ps.server import ParameterServer

HOST = "127.0.0.1"
SECRET = b"ps-compression-secret"
SIZES = [1000, 37]
HALF = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}


def serve(compression, sizes=SIZES):
    shards = [SGDShard(np.zeros(n)) for n in sizes]
    return shards, ParameterServer(
        shards, host=HOST, secret=SECRET, rule=Immediate(), num_workers=1, compression=compression
    )


def connect(ps, compression, sizes=SIZES):
    return ParameterClient(
        ps.addresses, worker=0, secret=SECRET, shard_sizes=sizes, timeout=10, compression=compression
    )


def gradients(seed=0, sizes=SIZES):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for n in sizes]


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_a_compressed_push_carries_half_the_bytes_and_is_applied_widened(compression):
    """Counted by the server on its real sockets: each push's payload is exactly half float32's. What the shards
    apply is the narrowed gradient widened back to float32 (the worker narrows once, the server only widens)."""
    received = {}
    for setting in (None, compression):
        shards, ps = serve(setting)
        with ps, connect(ps, setting) as client:
            before = ps.stats()["bytes_in"]
            client.push(gradients())
            received[setting] = ps.stats()["bytes_in"] - before - len(SIZES) * HEADER.size
            weights = client.pull()
        narrowed = [g.astype(HALF[compression]).astype(np.float32) for g in gradients()] if setting else gradients()
        for shard, got, gradient in zip(shards, weights, narrowed):
            assert got.dtype == np.float32  # pulls stay float32
            np.testing.assert_array_equal(got, shard.w)
            np.testing.assert_allclose(shard.w, -LR * gradient, rtol=1e-6)
    assert received[None] == 4 * sum(SIZES)
    assert received[compression] == 2 * sum(SIZES) == received[None] // 2


def test_a_gradient_already_narrowed_is_sent_as_it_is():
    """The worker narrows in its train step; the client sends a gradient of the push dtype untouched."""
    shards, ps = serve("bf16")
    narrowed = [g.astype(ml_dtypes.bfloat16) for g in gradients(1)]
    with ps, connect(ps, "bf16") as client:
        client.push(narrowed)
    for shard, gradient in zip(shards, narrowed):
        np.testing.assert_array_equal(shard.w, -LR * gradient.astype(np.float32))


def test_a_float16_overflow_is_refused_before_anything_is_sent():
    shards, ps = serve("fp16")
    huge = gradients(2)
    huge[1][5] = 1e6  # beyond float16's 65504: it would travel as infinity
    with ps, connect(ps, "fp16") as client:
        with pytest.raises(ValueError, match=r"float16's range .*compression='fp16'.*magnitude 1e\+06.*'bf16'"):
            client.push(huge)
        assert ps.stats()["versions"] == [0, 0] and ps.stats()["bytes_in"] == 0
        client.push(gradients(3))  # nothing was sent: the connection is still in step
        assert ps.stats()["versions"] == [1, 1]


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_a_narrowed_push_holding_nan_or_infinity_is_refused_and_nothing_applied(compression):
    shards, ps = serve(compression, sizes=[1000])
    (bad,) = [g.astype(HALF[compression]) for g in gradients(4, sizes=[1000])]
    bad[[3, 7]] = [np.nan, -np.inf]
    with ps, connect(ps, compression, sizes=[1000]) as client:
        with pytest.raises(NonFiniteGradientError, match=r"2 of 1000 values of shard 0 are NaN or infinite"):
            client.push([bad])
        assert ps.stats()["versions"] == [0]
    assert not shards[0].w.any()


def test_a_worker_whose_compression_is_not_the_servers_is_refused_naming_it():
    _, ps = serve("bf16")
    with ps, connect(ps, None) as client:
        with pytest.raises(CollectiveError, match=r"dtype code .*float32.*carries code .*bfloat16.*compression"):
            client.push(gradients())


def test_the_finite_check_reads_each_dtype_bits():
    """NaN and infinity of each wire dtype are found by their exponent bits; the largest finite values are not."""
    for dtype, largest in [(np.float32, np.finfo(np.float32).max), (np.float16, 65504.0)] + [
        (ml_dtypes.bfloat16, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max))
    ]:
        values = adopted.aligned_empty(5, dtype)
        values[...] = np.array([0.0, -largest, largest, 1.5, -0.0], np.float32).astype(dtype)
        assert wire.all_finite(values) and wire.count_non_finite(values) == 0
        values[[1, 4]] = np.array([np.inf, np.nan], np.float32).astype(dtype)
        assert not wire.all_finite(values) and wire.count_non_finite(values) == 2
        assert values.ctypes.data % adopted.ALIGNMENT == 0
