"""Pipeline parallelism without Spark: a chain model cut into stages, and GPipe steps of stages as threads over real
sockets giving the weights of one process training the whole model."""

import itertools
import pickle
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from collective_ranks import run_ranks
from custom_layer import Scale

from sparkdl.collective import CollectiveError
from sparkdl.modes.pipeline.cut import assemble, balanced_starts, build_stage, plan_stages, stage_weights
from sparkdl.modes.pipeline.engine import PipelineStage
from sparkdl.modes.pipeline.schedules import BACKWARD, FORWARD, SCHEDULES
from sparkdl.modes.pipeline.timeline import EVENTS, StageTimeline

# -- cutting ---------------------------------------------------------------------------------------------------------


def _sized_model():
    """Dense layers of 144, 544, 1056 and 132 parameters, then a parameterless softmax."""
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="a"),
            keras.layers.Dense(32, name="b"),
            keras.layers.Dense(32, name="c"),
            keras.layers.Dense(4, name="d"),
            keras.layers.Softmax(name="e"),
        ]
    )


@pytest.mark.parametrize(
    "num_stages, names, parameters",
    [
        (1, [("a", "b", "c", "d", "e")], (1876,)),
        (2, [("a", "b"), ("c", "d", "e")], (688, 1188)),  # the other cuts leave 1732 or 1744 on one stage
        (3, [("a", "b"), ("c",), ("d", "e")], (688, 1056, 132)),  # 1056 alone is the least largest stage
        (5, [("a",), ("b",), ("c",), ("d",), ("e",)], (144, 544, 1056, 132, 0)),
    ],
)
def test_a_balanced_cut_gives_the_least_largest_stage(num_stages, names, parameters):
    plan = plan_stages(_sized_model(), num_stages)
    assert [stage.names for stage in plan.stages] == names
    assert plan.parameters == parameters


def test_balanced_starts_match_an_exhaustive_search():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = [int(v) for v in rng.integers(0, 50, size=rng.integers(1, 8))]
        for stages in range(1, len(sizes) + 1):
            starts = balanced_starts(sizes, stages)
            assert len(starts) == stages and starts[0] == 0 and starts == sorted(set(starts))
            best = min(_largest(sizes, [0, *cuts]) for cuts in itertools.combinations(range(1, len(sizes)), stages - 1))
            assert _largest(sizes, starts) == best, (sizes, stages, starts)


def _largest(sizes, starts):
    bounds = [*starts, len(sizes)]
    return max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_cut_points_start_the_stages_they_name():
    plan = plan_stages(_sized_model(), 3, cut_points=["b", "d"])
    assert [stage.names for stage in plan.stages] == [("a",), ("b", "c"), ("d", "e")]
    assert plan.parameters == (144, 1600, 132)
    assert [stage.input_shape for stage in plan.stages] == [(8,), (16,), (32,)]


def _branching_model():
    inputs = keras.Input((4,))
    trunk = keras.layers.Dense(3, name="trunk")(inputs)
    left, right = keras.layers.Dense(3, name="left")(trunk), keras.layers.Dense(3, name="right")(trunk)
    return keras.Model(inputs, keras.layers.Add(name="join")([left, right]))


def _two_input_model():
    a, b = keras.Input((2,)), keras.Input((2,))
    return keras.Model([a, b], keras.layers.Concatenate()([a, b]))


def _integer_boundary_model():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, name="dense"),
            keras.layers.Discretization(bin_boundaries=[0.0], name="bins"),
            keras.layers.Embedding(2, 4, name="embed"),
        ]
    )


@pytest.mark.parametrize(
    "model, num_stages, cut_points, message",
    [
        (_sized_model, 0, None, "Expected `num_stages` to be a positive integer. Received: num_stages=0"),
        (
            _sized_model,
            6,
            None,
            "at most the model's 5 layers (every stage holds at least one). Received: num_stages=6",
        ),
        (_sized_model, 3, ["b"], "`cut_points` to be a list of 2 layer names (num_stages=3"),
        (_sized_model, 2, "b", "Received: a string: cut_points='b'"),
        (_sized_model, 2, ["nope"], "to name layers of the model (a, b, c, d, e). Received: ['nope']"),
        (_sized_model, 3, ["d", "b"], "Expected `cut_points` in the model's layer order, each once"),
        (_sized_model, 3, ["b", "b"], "Received: cut_points=['b', 'b']"),
        (_sized_model, 2, ["a"], "stage 0 would be empty. Received: 'a', the model's first layer"),
        (_branching_model, 2, None, "Received: layer 'join' merges 2 tensors (from 'left', 'right')"),
        (_two_input_model, 1, None, "one input and one output to cut into `num_stages`. Received: 2 inputs"),
        (lambda: keras.Sequential([keras.layers.Dense(2)]), 1, None, "Expected a built model"),
        (_integer_boundary_model, 2, ["embed"], "entering stage 1 (the output of layer 'bins') to be floating"),
    ],
)
def test_what_cannot_be_cut_is_refused(model, num_stages, cut_points, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_stages(model(), num_stages, cut_points)


def test_a_functional_chain_with_a_custom_layer_cuts_pickles_rebuilds_and_assembles():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    x = keras.layers.Dense(4, activation="relu", name="first")(inputs)
    x = Scale(0.5, name="scale")(x)
    x = keras.layers.Dense(3, name="second")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="third")(x))
    plan = pickle.loads(pickle.dumps(plan_stages(model, 2, cut_points=["scale"])))
    stages = [build_stage(plan, s, stage_weights(model, plan, s)) for s in range(2)]
    assert isinstance(stages[1].get_layer("scale"), Scale) and stages[1].get_layer("scale").factor == 0.5
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    np.testing.assert_allclose(stages[1](stages[0](x)), model(x), rtol=1e-6)

    other = keras.models.clone_model(model)  # fresh weights, then the stages' put back
    assert not np.array_equal(other.get_weights()[0], model.get_weights()[0])
    assemble(other, plan, [stage.get_weights() for stage in stages])
    for got, want in zip(other.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=re.escape("Expected 4 weight arrays for the layers of stage 1. Received: 3")):
        assemble(other, plan, [stages[0].get_weights(), stages[1].get_weights()[:3]])


# -- training ----------------------------------------------------------------------------------------------------------


def _mlp(regularizer=None):
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="h1", kernel_regularizer=regularizer),
            keras.layers.Dense(8, activation="relu", name="h2"),
            keras.layers.Dense(6, activation="tanh", name="h3", kernel_regularizer=regularizer),
            keras.layers.Dense(3, name="logits"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _batches(rows=8, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((rows, 6)).astype(np.float32), rng.integers(0, 3, size=rows).astype(np.int64))
        for _ in range(steps)
    ]


def _one_process(model, batches):
    """The whole model trained by Keras itself: its weights and losses after each batch."""
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(keras.optimizers.SGD(0.2), model.loss)
    losses = [float(reference.train_on_batch(x, y)) for x, y in batches]
    return reference.get_weights(), losses


def _stage_body(model, plan, batches_by_replica, micro_batches, stages, schedule="gpipe"):
    """A rank's work: stage ``rank % stages`` of replica ``rank // stages``, the replicas of a stage averaging; its
    weights, loss shares, and summary with the events its timeline recorded (``"events"``)."""
    weights = [stage_weights(model, plan, s) for s in range(stages)]

    def body(world):
        replica, stage = divmod(world.rank, stages)
        pipelines = [world.split(range(r * stages, (r + 1) * stages)) for r in range(world.size // stages)]
        replica_groups = [world.split(range(s, world.size, stages)) for s in range(stages)]
        replicas = replica_groups[stage] if world.size > stages else None
        stage_model = build_stage(plan, stage, weights[stage])
        events = StageTimeline()
        engine = PipelineStage(
            stage_model,
            pipelines[replica],
            micro_batches,
            model.loss,
            keras.optimizers.SGD(0.2),
            schedule=schedule,
            replicas=replicas,
            timeline=events,
        )
        first, last = stage == 0, stage == stages - 1
        shares = [
            engine.train_step(x if first else None, y if last else None, rows=len(x))
            for x, y in batches_by_replica[replica]
        ]
        engine.close()
        return stage_model.get_weights(), shares, {**engine.summary(), "events": events.array()}

    return body


def _pipeline(model, stages, micro_batches, batches_by_replica, schedule="gpipe"):
    plan = plan_stages(model, stages)
    body = _stage_body(model, plan, batches_by_replica, micro_batches, stages, schedule)
    results = run_ranks(stages * len(batches_by_replica), body)
    trained = keras.models.clone_model(model)
    assemble(trained, plan, [weights for weights, _, _ in results[:stages]])
    return trained.get_weights(), results


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_schedule_runs_each_pass_once_holds_what_it_promises_and_the_stages_never_wait_on_each_other(schedule):
    """Every micro-batch's forward pass once, before its backward pass once; at most M (GPipe) or S - s (1F1B)
    micro-batches held between the two on stage s; and the stages' orders together finish: played out pass by
    pass, a forward needs stage s-1's forward of the micro-batch, a backward stage s+1's backward."""
    for stages, micro_batches in itertools.product(range(1, 5), range(1, 9)):
        orders = [SCHEDULES[schedule](s, stages, micro_batches) for s in range(stages)]
        for stage, order in enumerate(orders):
            assert sorted(order) == sorted((kind, m) for kind in (FORWARD, BACKWARD) for m in range(micro_batches))
            assert all(order.index((FORWARD, m)) < order.index((BACKWARD, m)) for m in range(micro_batches))
            held = np.cumsum([1 if kind == FORWARD else -1 for kind, _ in order]).max()
            assert held == (micro_batches if schedule == "gpipe" else min(stages - stage, micro_batches))
        done, position = set(), [0] * stages
        while any(p < len(o) for p, o in zip(position, orders)):
            moved = False
            for s, order in enumerate(orders):
                if position[s] == len(order):
                    continue
                kind, m = order[position[s]]
                needs = (FORWARD, m, s - 1) if kind == FORWARD else (BACKWARD, m, s + 1)
                if needs[2] in (-1, stages) or needs in done:
                    done.add((kind, m, s))
                    position[s], moved = position[s] + 1, True
            assert moved, (schedule, stages, micro_batches, position)


@pytest.mark.parametrize(
    "stages, micro_batches, schedule",
    [(2, 1, "gpipe"), (3, 4, "gpipe"), (2, 3, "gpipe"), (3, 4, "1f1b"), (2, 3, "1f1b"), (3, 2, "1f1b")],
)
def test_a_pipeline_trains_the_weights_of_one_process_running_its_schedules_passes_in_order(
    stages, micro_batches, schedule
):
    """(2, 1): the whole batch at once; (3, 4): a middle stage, micro-batches of 2 rows; (2, 3): 8 rows in
    micro-batches of 3, 3 and 2, weighed by their rows; (3, 2) in 1F1B: fewer micro-batches than its warm-up
    wants. Each stage's passes ran in its schedule's order (the events each recorded inside its compiled step)."""
    model, batches = _mlp(), _batches()
    want_weights, want_losses = _one_process(model, batches)
    got_weights, results = _pipeline(model, stages, micro_batches, [batches], schedule)
    for got, want in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(np.sum([shares for _, shares, _ in results], axis=0), want_losses, rtol=1e-5)
    assert all(share == 0.0 for _, shares, _ in results[:-1] for share in shares)  # no regularizer: all in the loss
    for stage, (_, _, summary) in enumerate(results):
        assert summary["stage"] == stage and summary["steps"] == len(batches)
        assert summary["gpipe_bound"] == pytest.approx((stages - 1) / (micro_batches + stages - 1))
        assert 0.0 <= summary["idle_fraction"] <= 1.0 and summary["compute_seconds"] > 0
        assert summary["allreduce_seconds"] == 0.0
        passes = SCHEDULES[schedule](stage, stages, micro_batches)
        expected = [(f"{kind}_{edge}", m) for kind, m in passes for edge in ("start", "end")] * len(batches)
        assert [(EVENTS[int(event)], int(m)) for _, _, m, event in summary["events"]] == expected


def test_regularization_penalties_are_counted_once_and_shared_out_by_stage():
    model, batches = _mlp(regularizer=keras.regularizers.L2(0.05)), _batches()
    want_weights, want_losses = _one_process(model, batches)
    got_weights, results = _pipeline(model, 2, 3, [batches])
    for got, want in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, want, atol=1e-5)
    first_shares = [shares for _, shares, _ in results][0]
    assert all(share > 0 for share in first_shares)  # h1's penalty, on stage 0
    np.testing.assert_allclose(np.sum([shares for _, shares, _ in results], axis=0), want_losses, rtol=1e-5)


def test_two_replicas_of_two_stages_train_as_one_process_on_both_batches():
    model = _mlp()
    halves = [_batches(seed=1), _batches(seed=2)]
    joined = [(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])) for a, b in zip(*halves)]
    want_weights, want_losses = _one_process(model, joined)
    got_weights, results = _pipeline(model, 2, 2, halves)
    for got, want in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for replica in range(2):
        stage_weights_of = [results[replica * 2 + s][0] for s in range(2)]
        for got, want in zip(stage_weights_of, [results[s][0] for s in range(2)]):
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)  # the replicas of a stage stay identical
        np.testing.assert_allclose(results[replica * 2 + 1][1], want_losses, rtol=1e-5)
    assert all(summary["allreduce_seconds"] > 0 for _, _, summary in results)


def test_a_stage_refuses_bad_batches_and_its_neighbour_names_the_micro_batch_it_waited_for():
    def single(comm):
        engine = PipelineStage(_mlp(), comm, 4, "sparse_categorical_crossentropy", keras.optimizers.SGD(0.1))
        x, y = _batches(rows=3)[0]
        with pytest.raises(
            ValueError, match=re.escape("`micro_batches` (4) to be at most the batch size. Received: a batch of 3")
        ):
            engine.train_step(x, y)
        with pytest.raises(
            ValueError, match=re.escape("Expected `y` on the last stage only. Received: y=None on stage 0 of 1")
        ):
            engine.train_step(x, None)
        with pytest.raises(ValueError, match="Expected `micro_batches` to be a positive integer"):
            PipelineStage(_mlp(), comm, 0, "mse", keras.optimizers.SGD(0.1))

    run_ranks(1, single)

    def to_int(comm):
        inputs = keras.Input((6,) if comm.rank == 0 else (3,))
        hidden = keras.layers.Dense(3)(inputs)
        if comm.rank == 0:
            hidden = keras.layers.Lambda(lambda t: tf.cast(t, "int32"))(hidden)
        stage = keras.Model(inputs, hidden)
        engine = PipelineStage(stage, comm, 2, "mse", keras.optimizers.SGD(0.1), timeout=30)
        x, y = _batches()[0]
        return engine.train_step(x if comm.rank == 0 else None, y if comm.rank == 1 else None)

    refused, waiting = run_ranks(2, to_int, capture=True)
    assert isinstance(refused, ValueError) and "an integer activation carries no gradient back" in str(refused)
    assert isinstance(waiting, CollectiveError)
    assert "pipeline stage 1 of 2: receiving micro-batch 0's activation from stage 0" in str(waiting)
