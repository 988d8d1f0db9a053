"""The rules every mode shares: one registry, one metrics rule, one batch schedule, one rows-per-worker rule."""

import math

import numpy as np
import pytest

from sparkdl import api, schedule
from sparkdl.metrics import combine_logs
from sparkdl.modes.base import Mode
from sparkdl.modes.registry import MODES, check_mode_options


def test_every_mode_name_has_one_mode_object_and_fit_accepts_exactly_those():
    assert api.MODES == tuple(MODES) == ("sync", "async", "hogwild", "ssp", "average")
    assert all(isinstance(mode, Mode) and name in mode.names for name, mode in MODES.items())
    assert MODES["async"] is MODES["ssp"] is MODES["hogwild"]  # one mode, three variants
    assert [name for name, mode in MODES.items() if not mode.runs_callbacks] == ["average"]


def test_options_are_checked_against_the_mode_that_takes_them():
    assert check_mode_options("ssp", max_staleness=0, push_every=None) == {
        "push_every": None,
        "num_servers": None,
        "max_staleness": 0,
    }
    with pytest.raises(ValueError, match=r"`max_staleness` applies to mode='ssp' only"):
        check_mode_options("async", max_staleness=1)
    with pytest.raises(ValueError, match=r"--sync-every applies to --mode average only"):
        check_mode_options("sync", {"mode": "--mode", "sync_every": "--sync-every"}, sync_every=3)


def test_metrics_are_weighted_by_the_samples_behind_them_and_weightless_values_never_leak_in():
    logs = [{"loss": 1.0, "val_loss": float("nan")}, {"loss": 4.0, "val_loss": 2.0}]
    combined = combine_logs(logs, samples=[300, 100], validation_rows=[0, 7])
    assert combined == {"loss": 1.75, "val_loss": 2.0}
    assert math.isnan(combine_logs([{"loss": 1.0}], samples=[0], validation_rows=[0])["loss"])


def test_any_range_of_steps_gets_the_batches_of_the_uninterrupted_schedule():
    x = np.arange(10, dtype=np.float32).reshape(-1, 1)
    y = np.arange(10, dtype=np.float32)
    settings = dict(batch_size=3, steps=4, seed=5, rank=1, shuffle=True)
    whole = [b for _, b in schedule.batches(x, y, start=0, stop=12, **settings)]
    pieces = [
        b
        for start, stop in ((0, 5), (5, 8), (8, 12))
        for _, b in schedule.batches(x, y, start=start, stop=stop, **settings)
    ]
    assert len(whole) == 12 and all(len(b) == 3 for b in whole)
    for a, b in zip(whole, pieces, strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(np.concatenate(whole[:4]).tolist()) == set(range(10))


def test_a_worker_without_training_rows_is_an_error_naming_it():
    schedule.require_rows({0: 5, 1: 1})
    with pytest.raises(ValueError, match=r"no rows on worker\(s\) \[1\] \(worker 0: 5, worker 1: 0\)"):
        schedule.require_rows({0: 5, 1: 0})
