"""mode="sharded", shard_weights=True (ZeRO stage 3) through sparkdl.fit: sync mode's training with every rank holding
1/N of the weights between uses, checkpoints of the whole model, and what it cannot run refused on the driver."""

import os

import keras
import numpy as np
import pytest
from frames import digits_frame
from models import make_mlp
from spark_jobs import no_spark_job

import sparkdl
from sparkdl.modes.fully_sharded import driver as fully_sharded_driver
from sparkdl.modes.fully_sharded import units


@pytest.fixture(scope="module")
def small_df(spark, digits):
    x_train, _, y_train, _ = digits
    return digits_frame(spark, x_train[:480], y_train[:480]).cache()


def _fit(df, mode, **settings):
    options = {"shard_weights": True} if mode == "fully sharded" else {}
    mode = "sharded" if mode == "fully sharded" else mode
    return sparkdl.fit(df, make_mlp(seed=1), mode=mode, batch_size=16, seed=3, progress=False, **options, **settings)


def test_fully_sharded_fit_trains_sync_modes_weights_with_half_the_weights_per_rank(small_df):
    """2 workers, Adam, held-out rows: the weights, Adam's moments, the loss and the metrics of sync mode; each
    rank's task measured that it held about half the weights and half of Adam's state between steps."""
    common = dict(num_workers=2, epochs=2, validation_split=0.2)
    sharded, sync = _fit(small_df, "fully sharded", **common), _fit(small_df, "sync", **common)

    for got, want in zip(sharded.model.get_weights(), sync.model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(sharded.model.optimizer.iterations.numpy()) == int(sync.model.optimizer.iterations.numpy()) > 0
    for got, want in zip(sharded.model.optimizer.variables, sync.model.optimizer.variables, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    assert sorted(sharded.history) == sorted(sync.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for name, values in sync.history.items():
        np.testing.assert_allclose(sharded.history[name], values, rtol=1e-4)

    stats = sharded.stats["fully_sharded"]
    whole = sum(w.numpy().nbytes for w in sharded.model.trainable_weights)
    assert stats["units"] == 3 and len(stats["ranks"]) == 2
    for rank in stats["ranks"]:  # measured in each rank's own task
        assert rank["whole_weight_bytes"] == whole
        assert 0.5 * whole <= rank["weight_bytes"] < 0.5 * whole + 4 * 2 * stats["units"]  # padding only
        # every optimizer variable the rank's process held: Adam's two slots over half the weights
        assert rank["optimizer_bytes"] < 0.5 * 2 * whole + 64
        # the gathered weights alive at once, counted until let go: every unit's, kept from its forward pass to its
        # backward pass, since this model's fit the budget for them (``KEPT_GATHERED_BYTES``)
        assert whole <= rank["gathered_peak_bytes"] < 2 * whole
    assert stats["steps"] == sharded.steps_per_epoch * 2 and stats["gather_seconds"] > 0


def test_checkpoints_hold_the_whole_model_and_resume_onto_another_worker_count(small_df, tmp_path):
    """2 epochs on 2 workers with checkpoints, then 2 more resumed on 1 worker: the checkpoint is a whole model with
    Adam's state; the resumed fit ends where sync mode resumed from the same checkpoint ends."""
    directory = tmp_path / "fully"
    _fit(small_df, "fully sharded", num_workers=2, epochs=2, checkpoint_dir=str(directory))
    saved = keras.models.load_model(directory / "epoch-000002.keras")
    assert len(saved.optimizer.variables) > 2 and int(saved.optimizer.iterations.numpy()) > 0

    resumed = {
        mode: _fit(small_df, mode, num_workers=1, epochs=4, checkpoint_dir=str(directory))
        for mode in ("fully sharded", "sync")
    }
    assert resumed["fully sharded"].initial_epoch == 2
    for got, want in zip(
        resumed["fully sharded"].model.get_weights(), resumed["sync"].model.get_weights(), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert sorted(os.listdir(directory))[-1] == "epoch-000004.keras"


def _allgathered_floats(stats: dict, rank: int) -> int:
    """The float32 bytes rank ``rank`` sent in allgathers (weights), over sockets and shared memory alike."""
    sent = stats["wire_bytes"][rank]
    return sum(sent[transport].get("allgather", {}).get("float32", 0) for transport in ("tcp", "shm"))


def _unit_bytes(model) -> list[int]:
    """Each unit's whole trainable weights, in bytes."""
    plan = units.plan_units(model)
    return [
        sum(int(v.numpy().nbytes) for v in units.trainables(units.unit_layers(model, plan, u)))
        for u in range(plan.num_stages)
    ]


def test_the_units_kept_gathered_are_the_last_ones_that_fit_the_budget():
    model = make_mlp(seed=1)
    sizes = _unit_bytes(model)
    plan = units.plan_units(model)
    assert len(sizes) == 3
    assert units.kept_gathered(model, plan, 0) == 1  # the last unit's, whatever its size
    assert units.kept_gathered(model, plan, sizes[2] + sizes[1] - 1) == 1
    assert units.kept_gathered(model, plan, sizes[2] + sizes[1]) == 2
    assert units.kept_gathered(model, plan, sum(sizes)) == 3


@pytest.mark.parametrize(
    "reshard_after_forward", [True, False, "left out", "left out, two units' budget"], ids=lambda v: str(v)
)
def test_weights_kept_from_the_forward_pass_train_the_same_model_gathering_those_layers_once_a_step(
    small_df, reshard_after_forward, monkeypatch, resharded_fit
):
    """The units whose gathered weights are kept from their forward pass, every one with reshard_after_forward=False,
    only the last with True, left out the last ones within the budget (this small model's every one, or two of three
    with a smaller budget): the same weights and loss as resharding; each rank measured that it sent a kept unit's
    shard once a step and every other unit's twice, and held the kept units' weights gathered at once (some units'
    only, never the whole weights, where only the last's are kept; 1/N between steps)."""
    model = make_mlp(seed=1)
    sizes = _unit_bytes(model)
    settings = {"reshard_after_forward": reshard_after_forward} if isinstance(reshard_after_forward, bool) else {}
    kept = {True: 1, False: 3, "left out": 3, "left out, two units' budget": 2}[reshard_after_forward]
    if reshard_after_forward == "left out, two units' budget":
        monkeypatch.setattr(fully_sharded_driver, "KEPT_GATHERED_BYTES", sizes[1] + sizes[2])
    fit = _fit(small_df, "fully sharded", num_workers=2, epochs=1, **settings)
    for got, want in zip(fit.model.get_weights(), resharded_fit.model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fit.history["loss"], resharded_fit.history["loss"], rtol=1e-5)

    layout = units.shard_layout(model, units.plan_units(model), 2)
    parts = [4 * layout.part(u) for u in range(3)]  # the bytes of one rank's shard of each unit
    stats = fit.stats["fully_sharded"]
    steps = stats["steps"]
    assert steps == fit.steps_per_epoch > 0 and stats["kept_gathered"] == kept
    for rank in range(2):
        per_step = sum(parts) + sum(parts[: 3 - kept])  # the units not kept are gathered again
        assert _allgathered_floats(fit.stats, rank) == steps * per_step
        held = stats["ranks"][rank]["gathered_peak_bytes"]
        assert held >= sum(sizes[3 - kept :])  # the kept units' at once
        if kept == 1:
            assert held < sum(sizes)  # some units' at a time, never the whole model's


@pytest.fixture(scope="module")
def resharded_fit(small_df):
    """One epoch with every unit but the last gathered again for its backward pass: what the others must equal."""
    return _fit(small_df, "fully sharded", num_workers=2, epochs=1, reshard_after_forward=True)


class _Record(keras.callbacks.Callback):
    pass


def _branching():
    inputs = keras.Input((64,))
    left, right = keras.layers.Dense(8)(inputs), keras.layers.Dense(8)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(keras.layers.Add()([left, right])))
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize(
    "model, settings, message",
    [
        (make_mlp, {"callbacks": [_Record()]}, "shard_weights=True does not use"),
        (make_mlp, {"sample_weight_col": "label"}, "takes no `sample_weight_col`"),
        (make_mlp, {"profile": True}, "Expected profile=False with shard_weights=True"),
        (_branching, {}, "layer by layer"),
        (lambda: make_mlp(optimizer=keras.optimizers.Lamb()), {}, "Received: Lamb"),
    ],
)
def test_what_a_fully_sharded_fit_cannot_run_is_refused_before_any_spark_job(small_df, model, settings, message):
    with no_spark_job(small_df.sparkSession), pytest.raises(ValueError, match=message):
        sparkdl.fit(small_df, model(), mode="sharded", shard_weights=True, num_workers=2, epochs=1, **settings)


def test_shard_weights_is_an_option_of_mode_sharded_only(small_df):
    with pytest.raises(ValueError, match="shard_weights"):
        sparkdl.fit(small_df, make_mlp(), mode="sync", shard_weights=True, num_workers=2, epochs=1)
    for reshard in (False, True):
        with no_spark_job(small_df.sparkSession), pytest.raises(ValueError, match=f"reshard_after_forward={reshard}"):
            sparkdl.fit(small_df, make_mlp(), mode="sharded", reshard_after_forward=reshard, num_workers=2, epochs=1)
