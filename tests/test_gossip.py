"""mode="gossip" (D-PSGD): the peer schedule every rank computes alike, rounds over real sockets giving each rank its
neighbourhood's average, Keras steps that are exactly D-PSGD's, the replicas' average as the result, and fits on
digits that converge, report the spread per epoch, checkpoint and resume, and refuse bad options before any job."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from collective_ranks import run_ranks
from models import make_mlp
from process_groups import run_in_own_group
from spark_jobs import no_spark_job

import sparkdl
from sparkdl.keras.optimizer_hooks import intercept_apply
from sparkdl.modes.gossip import peers, replicas
from sparkdl.modes.gossip.exchange import Gossip
from sparkdl.modes.gossip.hook import GossipHook
from sparkdl.modes.registry import check_mode_options

ROOT = Path(__file__).resolve().parent.parent

# -- the schedule ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", range(1, 10))
def test_a_random_round_is_a_matching_and_its_mixing_matrix_keeps_the_mean(size):
    for round in range(40):
        partner = peers.matching(size, seed=3, round=round)
        left_out = [rank for rank, p in enumerate(partner) if p is None]
        assert len(left_out) == size % 2  # a perfect matching, but for one rank when the ranks are odd
        for rank, p in enumerate(partner):
            assert p is None or (p != rank and partner[p] == rank)
        for kind in peers.PEERS:
            matrix = peers.mixing_matrix(kind, size, seed=3, round=round)
            np.testing.assert_allclose(matrix, matrix.T)  # symmetric ...
            np.testing.assert_allclose(matrix.sum(axis=0), 1.0)  # ... and doubly stochastic: the mean is kept
            assert (matrix >= 0).all()
    pairings = {tuple(peers.matching(size, seed=3, round=r)) for r in range(40)}
    assert size < 4 or len(pairings) > 1  # the pairs change from round to round


def test_the_schedule_is_the_same_in_every_process_and_fixed_across_versions():
    """A pure function of (seed, round, rank): another interpreter (another hash seed) computes the same pairs, and
    the pairs of a few rounds are pinned, so that a resumed fit pairs the ranks as the uninterrupted one did."""
    script = (
        "from sparkdl.modes.gossip.peers import matching; print([matching(7, seed=11, round=r) for r in range(20)])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert other.stdout.strip().splitlines()[-1] == str([peers.matching(7, seed=11, round=r) for r in range(20)])
    assert peers.matching(4, seed=0, round=0) == [1, 0, 3, 2]
    assert peers.matching(5, seed=7, round=3) == [None, 3, 4, 1, 2]
    assert peers.permutation(6, seed=1, round=2) == [3, 2, 4, 0, 1, 5]


@pytest.mark.parametrize("size", range(1, 12))
def test_ring_neighbours_weigh_a_third_and_no_rank_has_two_edges_of_one_colour(size):
    for rank in range(size):
        mine = peers.ring(rank, size)
        assert {n.rank for n in mine} == ({(rank - 1) % size, (rank + 1) % size} - {rank})
        assert [n.weight for n in mine] == ([1 / 3, 1 / 3] if size > 2 else [0.5] if size == 2 else [])
        assert len({n.colour for n in mine}) == len(mine)  # each edge of a rank on streams of its own
        assert all(0 <= n.colour < peers.colours("ring", size) for n in mine)
        for n in mine:  # both ends give an edge the same colour
            assert any(m.rank == rank and m.colour == n.colour for m in peers.ring(n.rank, size))


# -- rounds over sockets ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, kind", [(2, "ring"), (3, "ring"), (4, "ring"), (5, "ring"), (4, "random"), (5, "random")]
)
def test_each_round_gives_every_rank_its_neighbourhoods_weighted_average(size, kind):
    """Three rounds, each started before the previous result is used: after each, rank i holds sum_j W_ij x_j."""
    rng = np.random.default_rng(size)
    start = rng.standard_normal((size, 1000)).astype(np.float32)

    def body(comm):
        gossip = Gossip(comm, kind, seed=5, timeout=20)
        x = start[comm.rank].copy()
        for number in range(3):
            gossip.start(x.copy(), number)
            x = x + gossip.finish()
        gossip.close()
        return x, gossip.rounds, gossip.bytes_sent

    results = run_ranks(size, body, timeout=20)
    expected = start.astype(np.float64)
    for number in range(3):
        expected = peers.mixing_matrix(kind, size, seed=5, round=number) @ expected
    for rank, (x, rounds, sent) in enumerate(results):
        np.testing.assert_allclose(x, expected[rank], rtol=1e-5, atol=1e-5)
        assert rounds == 3
        neighbours = sum(len(peers.neighbours(kind, rank, size, seed=5, round=n)) for n in range(3))
        assert sent == neighbours * 1000 * 4  # raw float32 weights, nothing else
    np.testing.assert_allclose(np.mean([x for x, _, _ in results], axis=0), start.mean(axis=0), atol=1e-5)


def test_a_neighbour_that_never_sends_is_a_timeout_naming_the_round_and_the_rank():
    def body(comm):
        gossip = Gossip(comm, "ring", seed=0, timeout=0.5)
        if comm.rank == 1:
            time.sleep(1.5)
            return None
        gossip.start(np.zeros(10, np.float32), 0)
        with pytest.raises(
            sparkdl.collective.CollectiveTimeout, match=r"gossip round 0: waited 0.5s to receive the weights of rank 1"
        ):
            gossip.finish()
        return "timed out"

    assert run_ranks(2, body, timeout=5, capture=True)[0] == "timed out"


# -- the Keras steps -------------------------------------------------------------------------------------------------


def _linear_model(rank, lr):
    keras.utils.set_random_seed(rank)  # a different start per rank: the first round averages them
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    return model


def _rank_data(rank, steps, batch):
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal((steps * batch, 4)).astype(np.float32), rng.standard_normal((steps * batch, 1)).astype(
        np.float32
    )


def _dpsgd_reference(size, kind, every, steps, batch, lr, run):
    """``run`` steps of D-PSGD by hand (on the data of ``steps``): each rank's gradient at its own weights; on an
    exchange step, the neighbourhood's average of the weights that step started from, plus the rank's own update."""
    models = [_linear_model(rank, lr) for rank in range(size)]
    data = [_rank_data(rank, steps, batch) for rank in range(size)]
    weights = [[v.numpy().astype(np.float64) for v in m.trainable_weights] for m in models]
    for step in range(run):
        updates = []
        for rank, model in enumerate(models):
            for variable, value in zip(model.trainable_weights, weights[rank]):
                variable.assign(value.astype(np.float32))
            x, y = (a[step * batch : (step + 1) * batch] for a in data[rank])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_weights)
            updates.append([-lr * g.numpy().astype(np.float64) for g in grads])
        if (step + 1) % every == 0:
            matrix = peers.mixing_matrix(kind, size, seed=9, round=(step + 1) // every - 1)
            mixed = [
                [sum(matrix[i, j] * weights[j][v] for j in range(size)) for v in range(len(weights[i]))]
                for i in range(size)
            ]
        else:
            mixed = weights
        weights = [[w + u for w, u in zip(mixed[i], updates[i])] for i in range(size)]
    return weights


#: (ranks, peers, gossip_every, steps Keras runs per call of its train function, the step after which a callback
#: stops training, as EarlyStopping would: the round started for the next step is drained, not applied)
DPSGD_CASES = [
    (3, "ring", 1, 1, None),
    (4, "random", 2, 3, None),
    (2, "ring", 3, 1, None),
    (4, "ring", 1, 4, None),
    (3, "random", 1, 1, 4),
]


class _StopAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.steps:
            self.model.stop_training = True


def check_dpsgd_on_threads(size, kind, every, steps_per_call, stop):
    """Keras's own fit, its optimizer hooked, on ranks as threads over real sockets: every rank ends with the weights
    of D-PSGD computed by hand."""
    steps, batch, lr = 7, 8, 0.05
    expected = _dpsgd_reference(size, kind, every, steps, batch, lr, run=stop or steps)
    models = [_linear_model(rank, lr) for rank in range(size)]

    def body(comm):
        model = models[comm.rank]
        model.jit_compile = False
        model.steps_per_execution = steps_per_call
        gossip = Gossip(comm, kind, seed=9, timeout=30)
        hook = GossipHook(gossip, every=every, first_step=0, stop_step=steps)
        hook.begin(model.trainable_weights)
        with intercept_apply(model.optimizer, hook):
            x, y = _rank_data(comm.rank, steps, batch)
            stopping = [_StopAfter(stop)] if stop else []
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=stopping)
        hook.end()
        gossip.close()
        assert not gossip.in_flight
        return [v.numpy() for v in model.trainable_weights], gossip.rounds

    for rank, (got, rounds) in enumerate(run_ranks(size, body, timeout=30)):
        assert rounds == (steps // every if stop is None else stop + 1)  # with stop: a started round, drained
        for value, want in zip(got, expected[rank]):
            np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-5, err_msg=f"rank {rank} of {size} {kind}")


def test_keras_fit_with_the_hook_takes_exactly_the_dpsgd_steps(tmp_path):
    """Rounds started a step ahead and finished after the optimizer's update give exactly D-PSGD's weights, also when
    Keras runs several steps per call of its train function (``DPSGD_CASES``).

    In a child process: ranks as threads of one process share TensorFlow's inter-op threads, and a rank waiting for
    its neighbours inside its train step holds one, so with fewer threads than ranks (the default is one per core)
    the ranks it waits for could not run. In a fit each rank is a process of its own.
    """
    script = (
        "import tensorflow as tf; tf.config.threading.set_inter_op_parallelism_threads(16)\n"
        "import test_gossip\n"
        "for case in test_gossip.DPSGD_CASES: test_gossip.check_dpsgd_on_threads(*case)\n"
        "print('all cases checked')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "dpsgd.log"
    status = run_in_own_group([sys.executable, "-c", script], cwd=ROOT, env=env, log=log, timeout=240)
    output = log.read_text()
    assert status == 0 and "all cases checked" in output, output[-6000:]


# -- the replicas together -------------------------------------------------------------------------------------------


def test_the_average_holds_the_mean_of_every_float_variable_and_the_spread_is_the_largest_relative_distance():
    size = 3
    models = []
    for rank in range(size):
        model = make_mlp(width=8, hidden=(6,), classes=3, seed=rank, optimizer=keras.optimizers.Adam(0.01))
        rng = np.random.default_rng(rank)
        model.fit(rng.random((16, 8)), rng.integers(0, 3, 16), batch_size=8, epochs=1, verbose=0)  # slots differ too
        models.append(model)
    weights = [[v.numpy() for v in replicas.model_variables(m)] for m in models]
    slots = [[v.numpy() for v in replicas.optimizer_variables(m)] for m in models]
    iterations = models[0].optimizer.iterations.numpy()

    def body(comm):
        model = models[comm.rank]
        own = replicas.flat(replicas.model_variables(model))
        mean = comm.allreduce(own, sparkdl.collective.ReduceOp.MEAN)
        largest, by_rank = replicas.spread(comm, replicas.trainable_size(model), own, mean)
        with replicas.averaged(model, comm) as on_rank_0:
            inside = (
                [v.numpy() for v in replicas.model_variables(model)],
                [v.numpy() for v in replicas.optimizer_variables(model)],
            )
        after = [v.numpy() for v in replicas.model_variables(model)]
        return on_rank_0, inside, after, largest, by_rank

    results = run_ranks(size, body, timeout=30)
    assert [on_rank_0 for on_rank_0, *_ in results] == [True, False, False]
    (inside_weights, inside_slots), after = results[0][1], results[0][2]
    for i, value in enumerate(inside_weights):
        np.testing.assert_allclose(value, np.mean([w[i] for w in weights], axis=0), rtol=1e-6, atol=1e-7)
    for i, value in enumerate(inside_slots):
        np.testing.assert_allclose(value, np.mean([s[i] for s in slots], axis=0), rtol=1e-6, atol=1e-7)
    assert models[0].optimizer.iterations.numpy() == iterations  # an integer: rank 0's
    for value, own in zip(after, weights[0]):  # rank 0 holds its own replica again after the block
        np.testing.assert_array_equal(value, own)
    trainable = replicas.trainable_size(models[0])
    flats = np.array([np.concatenate([w.reshape(-1) for w in ws])[:trainable] for ws in weights], np.float64)
    center = flats.mean(axis=0)
    relative = np.linalg.norm(flats - center, axis=1) / np.linalg.norm(center)
    for _, _, _, largest, by_rank in results:
        np.testing.assert_allclose(by_rank, relative, rtol=1e-9)
        assert largest == max(by_rank)


# -- through sparkdl.fit ---------------------------------------------------------------------------------------------


class RecordReplica(keras.callbacks.Callback):
    """A user callback in the workers: at the end of training, each rank saves its own replica's weights and
    optimizer state and where it ran (process id, partition) to ``<directory>/rank<partition>.npz``."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_train_end(self, logs=None):
        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        weights = [v.numpy() for v in replicas.model_variables(self.model)]
        slots = [v.numpy() for v in replicas.optimizer_variables(self.model)]
        arrays = {f"w{i}": w for i, w in enumerate(weights)} | {f"s{i}": s for i, s in enumerate(slots)}
        np.savez(os.path.join(self.directory, f"rank{partition}.npz"), pid=os.getpid(), **arrays)


def test_two_workers_converge_on_digits_with_a_bounded_spread_and_return_the_replicas_average(
    spark, digits, digits_df, tmp_path
):
    _, x_test, _, y_test = digits
    result = sparkdl.fit(
        digits_df,
        make_mlp(optimizer=keras.optimizers.Adam(2e-3)),
        mode="gossip",
        num_workers=2,
        epochs=10,
        batch_size=16,
        seed=0,
        callbacks=[RecordReplica(str(tmp_path))],
        progress=False,
    )
    accuracy = float((result.model.predict(x_test, verbose=0).argmax(axis=1) == y_test).mean())
    assert accuracy >= 0.95, accuracy

    stats = result.stats["gossip"]
    steps = -(-digits_df.count() // 32)  # an epoch's steps, had the two partitions the same rows (at most one more)
    assert stats["peers"] == "ring" and stats["gossip_every"] == 1 and 10 * steps <= stats["rounds"] <= 10 * (steps + 1)
    assert stats["epochs"] == list(range(10)) and len(stats["spread"]) == 10 == len(result.history["loss"])
    assert all(0 < spread < 0.01 for spread in stats["spread"]), stats["spread"]  # two replicas a step apart at most
    assert all(len(d) == 2 and max(d) == s for d, s in zip(stats["distances"], stats["spread"]))
    parameters = result.model.count_params()
    assert stats["bytes_per_exchange"] == [4 * parameters] * 2  # each rank's weights to its one neighbour, float32

    saved = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    assert os.getpid() not in {int(s["pid"]) for s in saved}  # trained in the executors' Python workers
    assert int(saved[0]["pid"]) != int(saved[1]["pid"])  # one replica each
    assert not np.array_equal(saved[0]["w0"], saved[1]["w0"])  # replicas of their own ...
    for i, value in enumerate(v.numpy() for v in replicas.model_variables(result.model)):
        np.testing.assert_allclose(value, (saved[0][f"w{i}"] + saved[1][f"w{i}"]) / 2, rtol=1e-6, atol=1e-7)
    for i, value in enumerate(v.numpy() for v in replicas.optimizer_variables(result.model)):
        np.testing.assert_allclose(value, (saved[0][f"s{i}"] + saved[1][f"s{i}"]) / 2, rtol=1e-6, atol=1e-7)


def test_random_peers_checkpoint_the_average_each_epoch_and_a_second_fit_resumes(spark, digits_df, tmp_path):
    common = dict(mode="gossip", peers="random", gossip_every=3, num_workers=2, batch_size=32, seed=1, progress=False)
    directory = tmp_path / "ckpt"
    first = sparkdl.fit(digits_df, make_mlp(), epochs=2, validation_split=0.1, checkpoint_dir=str(directory), **common)
    saved = keras.models.load_model(directory / "epoch-000002.keras")
    for got, want in zip(saved.get_weights(), first.model.get_weights()):
        np.testing.assert_array_equal(got, want)  # the checkpoint is the average the fit returned
    meta = json.loads((directory / "epoch-000002.json").read_text())
    assert meta["mode"] == "gossip" and meta["history"]["val_accuracy"] == first.history["val_accuracy"]
    assert first.stats["gossip"]["peers"] == "random" and len(first.stats["gossip"]["spread"]) == 2

    resumed = sparkdl.fit(
        digits_df, make_mlp(), epochs=3, validation_split=0.1, checkpoint_dir=str(directory), **common
    )
    assert resumed.initial_epoch == 2 and len(resumed.history["loss"]) == 3
    assert resumed.history["loss"][:2] == first.history["loss"]
    assert resumed.stats["gossip"]["epochs"] == [2]
    assert resumed.history["loss"][2] < first.history["loss"][0]


def test_one_worker_has_no_one_to_average_with_and_trains_alone(spark, digits_df):
    result = sparkdl.fit(digits_df, make_mlp(), mode="gossip", num_workers=1, epochs=1, batch_size=64, progress=False)
    stats = result.stats["gossip"]
    assert stats["rounds"] == 0 and stats["bytes_sent"] == [0] and stats["spread"] == [0.0]
    assert result.history["accuracy"][0] > 0.3


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(gossip_every=0), r"Expected `gossip_every` to be a positive integer. Received: gossip_every=0"),
        (dict(gossip_every=1.5), r"Expected `gossip_every` to be a positive integer"),
        (dict(peers="star"), r"Expected `peers` to be 'ring' or 'random'. Received: peers='star'"),
        (dict(overlap=False), r"`overlap` applies to mode='sync'"),
        (dict(sync_every=3), r"`sync_every` applies to mode='average' only"),
    ],
)
def test_bad_options_are_refused_on_the_driver_before_any_job(spark, digits_df, settings, message):
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        sparkdl.fit(digits_df, make_mlp(), mode="gossip", num_workers=2, progress=False, **settings)


def test_gossip_options_belong_to_gossip_only():
    assert check_mode_options("gossip") == {"gossip_every": 1, "peers": "ring"}
    assert check_mode_options("gossip", gossip_every=4, peers="random") == {"gossip_every": 4, "peers": "random"}
    with pytest.raises(ValueError, match=r"`gossip_every` applies to mode='gossip' only"):
        check_mode_options("sync", gossip_every=2)
    with pytest.raises(ValueError, match=r"--peers applies to --mode gossip only"):
        check_mode_options("async", {"mode": "--mode", "peers": "--peers"}, peers="ring")
