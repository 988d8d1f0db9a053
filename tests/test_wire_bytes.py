"""The bytes each barrier mode puts on the wire, read from the communicator's own counters in real fits.

Every rank of a sync or sharded fit reports what it sent (``FitResult.stats["wire_bytes"]``: by transport, operation
and dtype, counted where the frames leave its links and where it writes into its host's shared-memory segment).
Here: compressed gradients travel at half the bytes; a sharded step moves a reduce-scatter and an all-gather, the
cost model's ZeRO figures for the model's size and the steps run; on one host (local[2]) a sync, ZeRO-1 or ZeRO-3
step goes through shared memory alone. The model's two layers
are of one size, so that ZeRO-3's units are as ``mode_costs.zero3`` counts them.
"""

import pytest
from frames import digits_frame
from models import make_mlp

import sparkdl
from sparkdl.collective import cost
from sparkdl.planner import mode_costs

WORKERS = 2
FEATURES = 10  # = each layer's width and the classes: Dense(10, 10) twice, two units of 110 weights
STEP_OPERATIONS = ("allreduce", "reduce_scatter", "allgather")  # what carries the gradients and the weights
FITS = {
    "sync": dict(mode="sync"),
    "sync bf16": dict(mode="sync", compression="bf16"),
    "sharded": dict(mode="sharded"),
    "sharded bf16": dict(mode="sharded", compression="bf16"),
    "fully sharded": dict(mode="sharded", shard_weights=True, reshard_after_forward=True),  # mode_costs.zero3's
}


def _model():
    return make_mlp(width=FEATURES, hidden=(FEATURES,), classes=10, seed=1)


@pytest.fixture(scope="module")
def fits(spark, digits):
    """Each fit of :data:`FITS` once, on the same 200 rows, 1 epoch on 2 workers: its result, run on first use."""
    x_train, _, y_train, _ = digits
    frame = digits_frame(spark, x_train[:200, 20 : 20 + FEATURES], y_train[:200]).cache()
    results = {}

    def fit(name):
        if name not in results:
            results[name] = sparkdl.fit(
                frame, _model(), num_workers=WORKERS, epochs=1, batch_size=16, seed=3, progress=False, **FITS[name]
            )
        return results[name]

    yield fit
    frame.unpersist()


def _sent(result, transport, operation, dtype):
    """Every rank's bytes of ``operation`` on ``dtype`` arrays sent over ``transport``, as its counters say."""
    ranks = result.stats["wire_bytes"]
    assert len(ranks) == WORKERS
    return [rank[transport].get(operation, {}).get(dtype, 0) for rank in ranks]


def _step_operations_over_tcp(result):
    """The step operations (gradients, weights: any dtype) each rank sent bytes of over TCP."""
    return [sorted(op for op in rank["tcp"] if op in STEP_OPERATIONS) for rank in result.stats["wire_bytes"]]


def _weight_bytes(result):
    """K: the bytes of the model's float32 weights, and so of its gradients."""
    return sum(w.numpy().nbytes for w in result.model.trainable_weights)


def test_sync_steps_allreduce_the_gradients_through_shared_memory_at_the_rings_bytes(fits):
    """Each step, each rank delivers the ring allreduce's 2(N-1)/N K of float32 gradients through its host's
    segment, and over TCP what the hierarchical allreduce puts on the hosts' links: nothing, on one host."""
    result = fits("sync")
    steps, k = result.steps_per_epoch, _weight_bytes(result)
    assert (
        _sent(result, "shm", "allreduce", "float32")
        == [steps * mode_costs.cost("sync", WORKERS, k).rank_sent] * WORKERS
    )
    over_links = steps * mode_costs.cost("sync", WORKERS, k, local=WORKERS).rank_sent  # hosts' links: none here
    assert _sent(result, "tcp", "allreduce", "float32") == [over_links] * WORKERS
    assert _step_operations_over_tcp(result) == [[]] * WORKERS


@pytest.mark.parametrize(("mode", "operation"), [("sync", "allreduce"), ("sharded", "reduce_scatter")])
def test_compressed_gradients_put_half_the_bytes_on_the_wire(fits, mode, operation):
    """compression="bf16": the same model, rows and steps send half the gradient bytes, as bfloat16 (no float32
    gradient left on the wire); a sharded fit's all-gather of the float32 weights stays as it was."""
    plain, compressed = fits(mode), fits(f"{mode} bf16")
    assert compressed.steps_per_epoch == plain.steps_per_epoch
    full = _sent(plain, "shm", operation, "float32")
    assert min(full) > 0
    assert _sent(compressed, "shm", operation, "bfloat16") == [b // 2 for b in full]
    assert _sent(compressed, "shm", operation, "float32") == [0] * WORKERS
    assert _sent(compressed, "tcp", operation, "bfloat16") == [0] * WORKERS
    if mode == "sharded":
        assert _sent(compressed, "shm", "allgather", "float32") == _sent(plain, "shm", "allgather", "float32")


def test_a_sharded_step_reduce_scatters_and_all_gathers_zero1s_bytes_through_shared_memory(fits):
    """mode="sharded": per step a reduce-scatter of the float32 gradients and an all-gather of the float32 weights,
    (N-1)/N K each, mode_costs.zero1's bytes in all; no gradient allreduce; nothing of it over TCP."""
    result = fits("sharded")
    steps, k = result.steps_per_epoch, _weight_bytes(result)
    scattered = _sent(result, "shm", "reduce_scatter", "float32")
    gathered = _sent(result, "shm", "allgather", "float32")
    assert scattered == [steps * cost.collective("reduce_scatter", "ring", WORKERS, k).rank_sent] * WORKERS
    assert gathered == [steps * cost.collective("allgather", "ring", WORKERS, k).rank_sent] * WORKERS
    assert [s + g for s, g in zip(scattered, gathered)] == [
        steps * mode_costs.cost("zero1", WORKERS, k).rank_sent
    ] * WORKERS
    assert _sent(result, "shm", "allreduce", "float32") == [0] * WORKERS
    assert _step_operations_over_tcp(result) == [[]] * WORKERS


def _over_both(result, operation):
    """Every rank's float32 bytes of ``operation``, over TCP and through shared memory together."""
    return [t + s for t, s in zip(*(_sent(result, transport, operation, "float32") for transport in ("tcp", "shm")))]


def test_a_fully_sharded_step_moves_zero3s_gathers_and_reduce_scatters(fits):
    """shard_weights=True, reshard_after_forward=True on two units of K/2: per step 2U-1 = 3 all-gathers of a unit's weights (each unit before
    its forward, the first again before its backward) and U = 2 reduce-scatters of its gradient, mode_costs.zero3's bytes
    in all, wherever they went."""
    result = fits("fully sharded")
    steps, k, units = result.steps_per_epoch, _weight_bytes(result), 2
    assert result.stats["fully_sharded"]["units"] == units
    gathered, scattered = _over_both(result, "allgather"), _over_both(result, "reduce_scatter")
    unit = k / units
    assert (
        gathered == [steps * (2 * units - 1) * cost.collective("allgather", "ring", WORKERS, unit).rank_sent] * WORKERS
    )
    assert scattered == [steps * units * cost.collective("reduce_scatter", "ring", WORKERS, unit).rank_sent] * WORKERS
    expected = steps * mode_costs.cost("zero3", WORKERS, k, units=units).rank_sent
    assert [g + s for g, s in zip(gathered, scattered)] == [expected] * WORKERS


def test_a_fully_sharded_step_on_one_host_sends_nothing_over_tcp(fits):
    """The engine's gathers and reduce-scatters run on two split communicators (streams of their own): on one host
    each has a segment of its own, so none of a step's operations goes over TCP."""
    assert _step_operations_over_tcp(fits("fully sharded")) == [[]] * WORKERS
