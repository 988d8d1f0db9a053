"""Tuning KerasEstimator the way Spark users tune: optimizer settings as Params, tuning models saved and loaded,
candidates trained in parallel, and fits that find too few free task slots waiting their turn."""

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import keras
import numpy as np
import pytest
from models import RecordEpochs, make_mlp
from process_groups import own_spark_environment
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.tuning import CrossValidator, CrossValidatorModel, ParamGridBuilder, TrainValidationSplit
from pyspark.util import inheritable_thread_target
from spark_jobs import no_spark_job

import sparkdl
from sparkdl.launch import claim_slots, session, slots
from sparkdl.ml import KerasEstimator, KerasModel

TESTS = Path(__file__).resolve().parent
SPARK_SUBMIT = os.path.join(os.path.dirname(sys.executable), "spark-submit")


@pytest.fixture(scope="module")
def small_df(digits_df):
    return digits_df.limit(400).repartition(2).cache()


def learning_rate(model: KerasModel) -> float:
    return float(model.keras_model.optimizer.learning_rate)


def _logged(caplog, text: str) -> list[str]:
    """Waits (up to a minute) until a captured log line holds ``text``; returns every one that does."""
    deadline = time.monotonic() + 60
    while not (found := [r.getMessage() for r in caplog.records if text in r.getMessage()]):
        assert time.monotonic() < deadline, f"no log line {text!r}: {caplog.text}"
        time.sleep(0.05)
    return found


@pytest.fixture
def slots_log(caplog):
    """The slot claims' log lines (INFO, ``sparkdl.launch.slots``), from every thread."""
    caplog.set_level(logging.INFO, logger=slots.__name__)
    return caplog


# Optimizer settings as Params ---------------------------------------------------------------------


def test_a_grid_over_learning_rate_trains_each_candidate_with_its_value(small_df):
    """Two candidates at once (parallelism=2, one worker each, on the two slots): each sub-model's optimizer
    has its grid value and the fixed optimizerOptions; the chosen model's has the winner's; the model given
    to the estimator keeps its own optimizer."""
    base = make_mlp(hidden=(16,), optimizer=keras.optimizers.Adam(1e-3))
    estimator = KerasEstimator(
        model=base, numWorkers=1, epochs=2, batchSize=32, seed=0, progress=False, optimizerOptions={"beta_1": 0.8}
    )
    rates = [0.02, 0.0005]
    tuning = TrainValidationSplit(
        estimator=estimator,
        estimatorParamMaps=ParamGridBuilder().addGrid(estimator.learningRate, rates).build(),
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
        parallelism=2,
        collectSubModels=True,
        seed=0,
    )
    fitted = tuning.fit(small_df)
    assert [learning_rate(sub) for sub in fitted.subModels] == pytest.approx(rates)
    assert all(sub.keras_model.optimizer.get_config()["beta_1"] == pytest.approx(0.8) for sub in fitted.subModels)
    best = int(np.argmax(fitted.validationMetrics))
    assert learning_rate(fitted.bestModel) == pytest.approx(rates[best])
    assert float(base.optimizer.learning_rate) == pytest.approx(1e-3) and base.optimizer.iterations.numpy() == 0


def test_optimizer_params_save_with_the_estimator_and_bad_ones_fail_before_any_job(spark, small_df, tmp_path):
    estimator = KerasEstimator(model=make_mlp(hidden=(8,)), learningRate=0.05, optimizerOptions={"amsgrad": True})
    estimator.save(str(tmp_path / "estimator"))
    loaded = KerasEstimator.load(str(tmp_path / "estimator"))
    assert (loaded.getLearningRate(), loaded.getOptimizerOptions()) == (0.05, {"amsgrad": True})

    bad = KerasEstimator(model=make_mlp(hidden=(8,)), numWorkers=1, optimizerOptions={"beta_3": 0.5})
    with no_spark_job(spark), pytest.raises(ValueError) as refused:
        bad.fit(small_df)
    assert "optimizerOptions" in str(refused.value) and "'beta_3'" in str(refused.value)
    assert "beta_1, beta_2" in str(refused.value)  # the optimizer's valid keys
    both = KerasEstimator(model=make_mlp(hidden=(8,)), learningRate=0.1, optimizerOptions={"learning_rate": 0.2})
    with no_spark_job(spark), pytest.raises(ValueError, match="learningRate=0.1 and optimizerOptions"):
        both.fit(small_df)
    with pytest.raises(TypeError, match="optimizerOptions"):
        KerasEstimator(optimizerOptions={"beta_1": object()})


# Tuning models saved and loaded -------------------------------------------------------------------


def _cross_validate(estimator, grid, df, parallelism: int) -> CrossValidatorModel:
    return CrossValidator(
        estimator=estimator,
        estimatorParamMaps=grid,
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
        numFolds=2,
        parallelism=parallelism,
        collectSubModels=True,
        seed=0,
    ).fit(df)


@pytest.fixture(scope="module")
def cross_validated(small_df):
    """A CrossValidator (two folds, parallelism=1) over two candidates of two workers each, run once for the two
    tests below: the estimator, its grid (two maps that differ in both Params it sets, the model and the learning
    rate) and the CrossValidatorModel."""
    models = [make_mlp(hidden=(16,), seed=1), make_mlp(hidden=(32,), seed=2)]
    estimator = KerasEstimator(model=models[0], numWorkers=2, epochs=1, batchSize=32, seed=0, progress=False)
    crossed = ParamGridBuilder().addGrid(estimator.model, models).addGrid(estimator.learningRate, [0.01, 0.002]).build()
    grid = [crossed[0], crossed[-1]]  # differing in both Params: half the candidates to train
    return estimator, grid, _cross_validate(estimator, grid, small_df, parallelism=1)


def test_cross_validator_over_models_and_learning_rates_saves_and_loads(spark, cross_validated, digits, tmp_path):
    estimator, grid, fitted = cross_validated
    path = str(tmp_path / "cv")
    fitted.save(path)
    loaded = CrossValidatorModel.load(path)

    _, x_test, _, _ = digits
    test = spark.createDataFrame([(row.tolist(),) for row in x_test], "features array<float>")
    want = [r.probability.toArray() for r in fitted.transform(test).collect()]
    got = [r.probability.toArray() for r in loaded.transform(test).collect()]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert loaded.avgMetrics == fitted.avgMetrics
    # The grid came back: each map's model is the candidate's model (usable as the estimator's), its rate the same.
    for original, saved in zip(grid, loaded.getEstimatorParamMaps()):
        by_name = {param.name: value for param, value in saved.items()}
        assert by_name["learningRate"] == original[estimator.learningRate]
        model = loaded.getEstimator().copy(saved).getModel()
        assert isinstance(model, keras.Model)
        for a, b in zip(model.get_weights(), original[estimator.model].keras_model.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_cross_validator_with_parallelism_2_waits_its_turn_and_gives_the_models_of_parallelism_1(
    cross_validated, small_df, slots_log
):
    """Two-worker candidates on local[2]'s two slots: with parallelism=2 one fit of each pair waits for the other's
    slots (and says so) instead of failing, and every model, its weights and the average metrics are those of
    parallelism=1 (seeded training)."""
    estimator, grid, one = cross_validated
    slots_log.clear()
    two = _cross_validate(estimator, grid, small_df, parallelism=2)
    waits = [
        r.getMessage() for r in slots_log.records if "waiting up to 600s for 2 free task slot(s)" in r.getMessage()
    ]
    # One candidate of each fold waited for the other's slots (and any fit may have waited a moment for the tasks
    # of an evaluation job that had just ended: the status tracker hears of them a little later).
    assert sum("2 claimed by 1 other sparkdl fit(s)" in w for w in waits) >= 2, waits
    assert len(_logged(slots_log, "got 2 task slot(s) after waiting")) == len(waits)
    assert two.avgMetrics == one.avgMetrics
    pairs = [(a, b) for fold_a, fold_b in zip(one.subModels, two.subModels) for a, b in zip(fold_a, fold_b)]
    for a, b in [*pairs, (one.bestModel, two.bestModel)]:
        for x, y in zip(a.keras_model.get_weights(), b.keras_model.get_weights(), strict=True):
            np.testing.assert_array_equal(x, y)


# Free task slots ----------------------------------------------------------------------------------


def test_claims_at_the_same_moment_take_the_free_slots_and_the_third_waits_its_turn(spark, slots_log):
    """Three claims of one slot each, at once, on two slots: two hold theirs, the third waits (and says so),
    never a third slot held at once; it gets the slot the first to end releases. All are released."""
    start, lock = threading.Barrier(3), threading.Lock()
    release = [threading.Event() for _ in range(3)]
    holding: set[int] = set()
    held: list[set[int]] = []  # who held a slot, each time one more did

    def claim(who: int) -> None:
        start.wait(timeout=30)
        with claim_slots(spark, 1, timeout=120):
            with lock:
                holding.add(who)
                held.append(set(holding))
            release[who].wait(timeout=120)
            with lock:
                holding.discard(who)

    threads = [threading.Thread(target=claim, args=(who,)) for who in range(3)]
    for thread in threads:
        thread.start()
    try:
        _logged(slots_log, "waiting up to 120s for 1 free task slot(s): 0 of the cluster's 2 are free (2 claimed")
        deadline = time.monotonic() + 60
        while len(held) < 2:  # the two claims that hold their slots go on into their blocks
            assert time.monotonic() < deadline, held
            time.sleep(0.05)
        with lock:
            first, waiter = sorted(holding), ({0, 1, 2} - holding).pop()
        assert len(first) == 2, held
        release[first[0]].set()
        while waiter not in holding:
            assert time.monotonic() < deadline, held
            time.sleep(0.05)
        _logged(slots_log, "got 1 task slot(s) after waiting")
    finally:
        for event in release:
            event.set()
        for thread in threads:
            thread.join(timeout=60)
    assert len(held) == 3 and max(len(h) for h in held) == 2, held
    with claim_slots(spark, 2, timeout=1):  # all released
        pass
    with pytest.raises(RuntimeError), claim_slots(spark, 2, timeout=1):  # released however the block ends
        raise RuntimeError("the fit failed")
    with claim_slots(spark, 2, timeout=1):
        pass


def test_a_fit_waiting_for_many_slots_is_not_overtaken_by_later_ones(spark, slots_log):
    """One slot of two is claimed. A claim of two waits; a later claim of one finds the free slot but waits
    behind it (first come, first served), and gets its slot once the claim of two has had, and ended, its turn."""
    release = {name: threading.Event() for name in ("holder", "two", "one")}
    order: list[str] = []

    def claim(name: str, workers: int) -> None:
        with claim_slots(spark, workers, timeout=120):
            order.append(name)
            release[name].wait(timeout=120)

    threads = {"holder": threading.Thread(target=claim, args=("holder", 1))}
    threads["holder"].start()
    try:
        while order != ["holder"]:
            assert threads["holder"].is_alive()
            time.sleep(0.05)
        threads["two"] = threading.Thread(target=claim, args=("two", 2))
        threads["two"].start()
        _logged(slots_log, "for 2 free task slot(s)")
        threads["one"] = threading.Thread(target=claim, args=("one", 1))
        threads["one"].start()
        (behind,) = _logged(slots_log, "1 fit(s) waiting before this one")
        assert "for 1 free task slot(s): 1 of the cluster's 2 are free" in behind, behind
        assert order == ["holder"], order
        release["holder"].set()
        _logged(slots_log, "got 2 task slot(s)")
        release["two"].set()
    finally:
        for event in release.values():
            event.set()
        for thread in threads.values():
            thread.join(timeout=60)
    assert order == ["holder", "two", "one"], order


def _hold_both_slots(spark, go_on: str, *, as_probe: bool) -> threading.Thread:
    """A job whose two tasks wait (in the executors' Python) until ``go_on`` exists, a worker probe's or another's;
    returned once Spark's status tracker shows both running.

    The tracker writes a stage's running tasks at most every 100 ms (spark.ui.liveUpdate.period), and otherwise at
    the next executor heartbeat, up to 10 s later: two tasks started at once would show as one until then. So a
    one-task job holds the second slot until the stage has been written, and its second task starts a write later."""
    group, gate, open_gate = f"hold-both-slots-{time.monotonic_ns()}", go_on + ".gate", go_on + ".open"
    sc, tracker = spark.sparkContext, spark.sparkContext.statusTracker()

    def wait_for(path):  # in a task or here
        deadline = time.monotonic() + 120
        while not os.path.exists(path):
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.05)

    def hold_one_slot(_):
        open(gate, "w").close()
        wait_for(open_gate)

    def run():
        sc.setJobGroup(group, "holds both task slots")
        tag = session.JobTag(spark, "sparkdl-probe")
        with tag, slots.probing(tag.name) if as_probe else contextlib.nullcontext():
            sc.parallelize(range(2), 2).foreach(lambda _: wait_for(go_on))

    def running() -> list[int]:
        stages = [s for job in tracker.getJobIdsForGroup(group) for s in tracker.getJobInfo(job).stageIds]
        return [info.numActiveTasks for info in map(tracker.getStageInfo, stages) if info is not None]

    gate_keeper = threading.Thread(target=lambda: sc.parallelize([0], 1).foreach(hold_one_slot))
    gate_keeper.start()
    wait_for(gate)
    holder = threading.Thread(target=run)
    holder.start()
    deadline = time.monotonic() + 60
    while not running():  # the stage was submitted, and written, with its first task
        assert time.monotonic() < deadline, "the holding job's stage did not start"
        time.sleep(0.05)
    time.sleep(0.2)  # more than the tracker's update period since that write
    open(open_gate, "w").close()
    gate_keeper.join(timeout=60)
    while sum(running()) < 2:
        assert time.monotonic() < deadline, "the holding job's tasks did not start"
        time.sleep(0.05)
    return holder


@pytest.mark.parametrize("as_probe", [True, False], ids=["a worker probe", "another job"])
def test_a_running_worker_probe_holds_no_slots_of_a_claim_but_another_jobs_tasks_do(
    spark, small_df, tmp_path, slots_log, as_probe
):
    """A job starts its session's probe beside its own work (jobs/train.py: ``check_executors(wait=False)``) and
    the fit waits for that probe anyway: its tasks are not busy slots to the fit's claim, however long they run.
    Another job's tasks are: a fit that finds them still running after its ``timeout`` fails, naming them."""
    go_on = str(tmp_path / "go-on")
    holder = _hold_both_slots(spark, go_on, as_probe=as_probe)
    try:
        if as_probe:
            with claim_slots(spark, 2, timeout=1):
                pass
        else:
            started = time.monotonic()
            with pytest.raises(ValueError) as refused:
                sparkdl.fit(small_df, make_mlp(hidden=(8,)), num_workers=2, timeout=0.5, progress=False)
            assert time.monotonic() - started >= 0.5
            message = str(refused.value)
            assert "Expected 2 task slot(s) to be free within timeout=0.5s" in message, message
            assert "0 of the cluster's 2 are free (0 claimed by 0 other sparkdl fit(s)" in message, message
            assert "2 running the tasks of other jobs" in message and "Raise `timeout`" in message, message
            _logged(slots_log, "waiting up to 0.5s for 2 free task slot(s)")
    finally:
        Path(go_on).touch()
        holder.join(timeout=120)


def test_a_fit_waits_for_the_slots_another_fit_holds_up_to_its_timeout(spark, small_df, tmp_path, slots_log):
    """A one-worker fit trains (held in its second epoch until the test lets it go). A two-worker fit finds one
    of the two slots free: with timeout=1 it waits, starts no Spark job, and fails after its timeout naming the
    slots; with the default timeout it waits, again without a job, and trains once the first fit has ended."""
    go_on = tmp_path / "go-on"
    holding = dict(num_workers=1, epochs=2, batch_size=32, seed=0, progress=False)
    callbacks = [RecordEpochs(str(tmp_path), wait_for=str(go_on), wait_before_epoch=1)]
    first: dict = {}
    second: dict = {}

    def train(into: dict, **settings) -> None:
        try:
            into["result"] = sparkdl.fit(small_df, make_mlp(hidden=(8,)), **settings)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            into["error"] = exc

    threads = [threading.Thread(target=train, args=(first,), kwargs=dict(callbacks=callbacks, **holding))]
    threads[0].start()
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "rank0-epoch0.json").exists():  # the first fit's task is training
            assert threads[0].is_alive() and time.monotonic() < deadline, first
            time.sleep(0.1)
        with no_spark_job(spark):
            started = time.monotonic()
            with pytest.raises(ValueError) as refused:
                sparkdl.fit(small_df, make_mlp(hidden=(8,)), num_workers=2, epochs=1, timeout=1.0, progress=False)
            assert time.monotonic() - started >= 1.0
            message = str(refused.value)
            assert "Expected 2 task slot(s) to be free within timeout=1s" in message, message
            assert "1 of the cluster's 2 are free (1 claimed by 1 other sparkdl fit(s)" in message, message
            assert "parallelism" in message and "Raise `timeout`" in message, message

            threads.append(threading.Thread(target=train, args=(second,), kwargs=dict(num_workers=2, progress=False)))
            threads[1].start()
            (waiting,) = _logged(slots_log, "waiting up to 600s for 2 free task slot(s)")
            assert "1 claimed by 1 other sparkdl fit(s)" in waiting, waiting
            time.sleep(1.0)  # still waiting, still without a job
            assert threads[1].is_alive() and "got 2 task slot(s)" not in slots_log.text
    finally:
        go_on.touch()
        for thread in threads:
            thread.join(timeout=300)
    assert "error" not in first and "error" not in second, (first, second)
    assert len(first["result"].history["loss"]) == 2 and len(second["result"].history["loss"]) == 1
    _logged(slots_log, "got 2 task slot(s) after waiting")


def test_a_job_tag_marks_only_its_own_threads_jobs_among_tuning_threads(spark):
    """CrossValidator's threads share one copy of their parent's local properties (PySpark's
    inheritable_thread_target): a fit's job tag, added in one of them, must not mark the jobs of another
    (its cancel would stop them, and the slot claims would count them as its own)."""
    sc, tag = spark.sparkContext, session.JobTag(spark)
    wrap = inheritable_thread_target(spark)  # as CrossValidator wraps its tasks: one copy for all of them
    tagged, done = threading.Event(), threading.Event()
    group = f"untagged-{time.monotonic_ns()}"

    def with_tag():
        with tag:
            sc.parallelize([1], 1).count()
            tagged.set()
            done.wait(timeout=60)

    def without_tag():
        tagged.wait(timeout=60)
        sc.setJobGroup(group, "a job of another tuning thread")
        sc.parallelize([1], 1).count()
        done.set()

    threads = [threading.Thread(target=wrap(f)) for f in (with_tag, without_tag)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    tracker, jvm_tracker = sc.statusTracker(), sc._jsc.sc().statusTracker()
    deadline = time.monotonic() + 30  # the status store hears of jobs from Spark's listener bus
    while not (tracker.getJobIdsForGroup(group) and list(jvm_tracker.getJobIdsForTag(tag.name))):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (other,) = tracker.getJobIdsForGroup(group)
    ours = list(jvm_tracker.getJobIdsForTag(tag.name))
    assert len(ours) == 1 and other not in ours, (ours, other)


# Parallel candidates on separate executors --------------------------------------------------------


TUNERS = ("TrainValidationSplit", "CrossValidator")


@pytest.fixture(scope="module")
def tuned_on_a_local_cluster(tmp_path_factory):
    """One spark-submit on local-cluster[2,1,1024] (executors in processes of their own) runs tests/tuning_job.py's
    tuners one after the other: each tuner's result (tests/tuning_job.py), and Spark's event log of them all."""
    directory = tmp_path_factory.mktemp("tuning")
    events = directory / "events"
    events.mkdir()
    command = [
        SPARK_SUBMIT,
        "--master",
        "local-cluster[2,1,1024]",
        *("--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.ui.enabled=false"),
        *("--conf", "spark.eventLog.enabled=true", "--conf", f"spark.eventLog.dir={events.as_uri()}"),
        *("--conf", "spark.eventLog.compress=false", "--conf", "spark.eventLog.rolling.enabled=false"),
        str(TESTS / "tuning_job.py"),
        str(directory / "out"),
        *TUNERS,
    ]
    env = own_spark_environment(virtualenv_on_path=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    (log,) = events.iterdir()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    results = {tuner: json.loads((directory / "out" / tuner / "result.json").read_text()) for tuner in TUNERS}
    return results, records


@pytest.mark.slow
@pytest.mark.parametrize("tuner", TUNERS)
def test_parallel_candidates_train_at_once_on_a_local_cluster(tuned_on_a_local_cluster, tuner):
    """The tuner with parallelism=2 trains its two one-worker candidates at the same time (CrossValidator: those of
    each of its two folds). Spark's own record (its event log) shows the tuner's first two training (barrier)
    stages overlapping; the candidates' tasks met while training."""
    results, records = tuned_on_a_local_cluster
    result = results[tuner]
    assert result["learning_rates"] == pytest.approx([0.01, 0.002])
    assert "SparkListenerStageCompleted" in {e["Event"] for e in records}
    barrier = [
        e["Stage Info"]
        for e in records
        if e["Event"] == "SparkListenerStageCompleted"
        and any(r.get("Barrier") for r in e["Stage Info"]["RDD Info"])
        and result["started_ms"] <= e["Stage Info"]["Submission Time"] <= result["ended_ms"]  # this tuner's
    ]
    # Two candidates (a pair per fold), then the chosen one again on all the rows; the first pair at once.
    assert len(barrier) == {"TrainValidationSplit": 3, "CrossValidator": 5}[tuner], [s["Stage ID"] for s in barrier]
    first, second = sorted(barrier, key=lambda s: s["Submission Time"])[:2]
    assert second["Submission Time"] < first["Completion Time"], (first, second)
