"""The rules every mode shares: one registry, one metrics rule, one batch schedule, one rows-per-worker rule."""

import dataclasses
import math

import numpy as np
import pytest
from models import make_mlp

import sparkdl
from sparkdl import api, schedule
from sparkdl.metrics import combine_logs
from sparkdl.modes.average.mode import SYNC_EVERY
from sparkdl.modes.base import Job, Mode, ModeResult, Plan
from sparkdl.modes.registry import MODES, check_mode_options


def test_every_mode_name_has_one_mode_object_and_fit_accepts_exactly_those():
    assert (
        api.MODES
        == tuple(MODES)
        == ("sync", "sharded", "async", "hogwild", "ssp", "sync_ps", "average", "pipeline", "gossip")
    )
    assert all(isinstance(mode, Mode) and name in mode.names for name, mode in MODES.items())
    assert MODES["async"] is MODES["ssp"] is MODES["hogwild"] is MODES["sync_ps"]  # one mode, four variants


def test_the_plans_whose_workers_run_a_loop_of_their_own_refuse_the_users_callbacks():
    required = {"pipeline": {"num_stages": 2}, "ssp": {"max_staleness": 1}}
    refusing = [
        name
        for name, mode in MODES.items()
        for shard_weights in ((None, True) if name == "sharded" else (None,))
        if mode.configure(
            name, make_mlp(), check_mode_options(name, shard_weights=shard_weights, **required.get(name, {}))
        ).refuses_callbacks()
    ]
    assert refusing == ["sharded", "average", "pipeline"]  # sharded with shard_weights=True only


@dataclasses.dataclass(frozen=True)
class _StubPlan(Plan):
    """A plan that trains nothing: it keeps the job ``fit`` gives it and returns its mode's result."""

    sync_every: int
    stub: "_StubMode"

    def run(self, job):
        self.stub.jobs.append(job)
        return self.stub.result


class _StubMode(Mode):
    names = ("stub",)

    def __init__(self):
        self.jobs: list[Job] = []
        self.result = ModeResult(model=object(), history={"loss": [0.25, 0.125]}, stats={"stub": 1}, initial_epoch=0)

    def options(self, name):
        return (SYNC_EVERY,)  # average's option: a mode may take another mode's option, declared the same

    def configure(self, name, model, values):
        return _StubPlan(name, values["sync_every"], self)


def test_fit_runs_a_mode_through_the_registry(digits_df, monkeypatch):
    """A mode registered under a new name is run by ``fit``: its options checked, its ``run`` given the job, and its
    result returned (a hard-coded choice among the built-in modes would refuse the name or run another mode)."""
    stub = _StubMode()
    monkeypatch.setitem(MODES, "stub", stub)

    result = sparkdl.fit(digits_df, make_mlp(), mode="stub", sync_every=3, epochs=2, batch_size=16, progress=False)

    (job,) = stub.jobs
    assert job.plan == _StubPlan("stub", 3, stub)
    assert (job.settings.epochs, job.settings.batch_size, job.settings.num_workers) == (2, 16, 2)
    assert job.training.frame.count() == digits_df.count() and job.start.epoch == 0
    assert result.model is stub.result.model
    assert result.history == stub.result.history and result.stats == stub.result.stats
    with pytest.raises(ValueError, match=r"`push_every` applies to mode='async' or 'hogwild' or 'ssp' only"):
        sparkdl.fit(digits_df, make_mlp(), mode="stub", push_every=2)  # the options are the stub's, not another's


def test_options_are_checked_against_the_mode_that_takes_them():
    assert check_mode_options("ssp", max_staleness=0, push_every=None) == {
        "push_every": 1,  # left out: the option's declared default
        "num_servers": 1,
        "compression": None,
        "server_placement": "driver",
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


def _batches(num_rows, **settings):
    """The row indices of each step of the schedule, one array per step."""
    parts = schedule.epoch_steps(num_rows, keys=np.arange(100, 100 + num_rows), **settings)
    return [part.order[start:stop] for part in parts for start, stop in part.spans]


def test_any_range_of_steps_gets_the_batches_of_the_uninterrupted_schedule():
    settings = dict(steps=4, seed=5, shuffle=True)
    whole = list(_batches(10, start=0, stop=12, **settings))
    pieces = [b for start, stop in ((0, 5), (5, 8), (8, 12)) for b in _batches(10, start=start, stop=stop, **settings)]
    assert len(whole) == 12 and [len(b) for b in whole[:4]] == [2, 3, 2, 3]
    for a, b in zip(whole, pieces, strict=True):
        np.testing.assert_array_equal(a, b)
    for epoch in range(3):  # every row exactly once per epoch
        assert sorted(np.concatenate(whole[4 * epoch : 4 * epoch + 4]).tolist()) == list(range(10))


@pytest.mark.parametrize("rows", [1, 2, 5, 31, 32, 33, 100, 1000])
@pytest.mark.parametrize("batch_size", [1, 7, 32])
def test_every_row_once_per_epoch_in_batches_of_at_most_batch_size(rows, batch_size):
    others = [rows, max(1, rows // 3), rows + 40]  # uneven partitions: the steps follow the largest
    steps = schedule.steps_per_epoch(others, batch_size)
    assert steps == max(1, -(-(rows + 40) // batch_size))
    for shuffle in (True, False):
        batches = list(_batches(rows, steps=steps, seed=3, shuffle=shuffle, start=0, stop=2 * steps))
        assert len(batches) == 2 * steps  # one per step: the ranks stay in lockstep
        for epoch in range(2):
            epoch_batches = batches[epoch * steps : (epoch + 1) * steps]
            real = [b for b in epoch_batches if len(b)]
            assert all(len(b) <= batch_size for b in epoch_batches)
            if rows >= steps:
                assert sorted(np.concatenate(real).tolist()) == list(range(rows))
        unfilled = list(_batches(rows, steps=steps, seed=3, shuffle=shuffle, start=0, stop=steps, fillers=False))
        assert sorted(np.concatenate(unfilled).tolist()) == list(range(rows))  # without fillers: exactly once


def test_fillers_run_where_a_worker_has_fewer_rows_than_steps():
    batches = list(_batches(3, steps=5, seed=0, shuffle=False, start=0, stop=5))
    assert [len(b) for b in batches] == [1, 1, 1, 1, 1]  # two filler steps of one row
    assert schedule.step_sizes(3, 5).tolist() == [0, 1, 0, 1, 1]
    scales = schedule.gradient_scales([3, 10], rank=0, steps=5)
    assert scales.tolist() == [0.0, 1 * 2 / 3, 0.0, 2 / 3, 2 / 3]  # fillers weigh nothing; k_r * N / K elsewhere
    assert schedule.gradient_scales([10, 10], rank=0, steps=5) is None


def test_a_worker_without_training_rows_is_an_error_naming_it():
    schedule.require_rows({0: 5, 1: 1})
    with pytest.raises(ValueError, match=r"no rows on worker\(s\) \[1\] \(worker 0: 5, worker 1: 0\)"):
        schedule.require_rows({0: 5, 1: 0})
