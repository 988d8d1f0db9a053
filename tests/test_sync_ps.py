"""The synchronous parameter server, ``mode="sync_ps"``: one update per step, the mean of every worker's gradient
weighted by its rows, the same weights pulled by all; through ``sparkdl.fit`` it trains ``mode="sync"``'s weights.

The first tests drive the server (``sparkdl.ps``) with real sockets and numpy shards, no Spark; the others fit real
Keras models on the shared local[2,2] session.
"""

from __future__ import annotations

import functools
import time

import keras
import ml_dtypes
import numpy as np
import ps_servers
import pytest
from attackers import ps_request, ps_response, recv_exactly
from frames import digits_frame
from models import CrashOnFirstAttempt, make_mlp
from partitions import partitions_as_fit_sees_them
from ps_servers import SECRET, client, in_thread
from shards import LR, SGDShard, make_shards
from weights import assert_same_weights

import sparkdl
from sparkdl import data
from sparkdl.checkpoint import Checkpointer
from sparkdl.net.auth import connect_authenticated
from sparkdl.net.errors import CollectiveError, CollectiveTimeout
from sparkdl.ps import protocol
from sparkdl.ps.rules import Immediate, SyncRounds

server = functools.partial(ps_servers.server, rule=SyncRounds())  # unless a test says another rule


def gradients(sizes, value):
    return [np.full(n, value, np.float32) for n in sizes]


# -- the server, no Spark ------------------------------------------------------------------------------------------


def test_a_round_applies_the_row_weighted_mean_once_and_every_worker_pulls_its_result():
    sizes = [5, 3]
    shards = make_shards(sizes)
    start = [s.w.copy() for s in shards]
    with server(shards, num_workers=3) as ps:
        clients = [client(ps, w, sizes) for w in range(3)]
        try:
            joins = [in_thread(lambda c=c, rows=rows: c.join(rows, 3)) for c, rows in zip(clients, (10, 30, 20))]
            for thread, _ in joins:
                thread.join(5)
            assert [out for _, out in joins] == [[[10, 30, 20]]] * 3  # every worker learns every worker's rows
            for c in clients:
                c.pull()
            clients[0].push(gradients(sizes, 1.0), step=0, rows=2)
            clients[1].push(gradients(sizes, 4.0), step=0, rows=6)
            waiter, pulled = in_thread(clients[0].pull)
            time.sleep(0.3)
            assert waiter.is_alive(), "a pull returned before every worker had pushed the step"
            assert ps.stats()["versions"] == [0, 0]
            clients[2].push(gradients(sizes, 0.0), step=0, rows=0)  # a filler step: weighs nothing
            waiter.join(5)
            after = [c.pull() for c in clients[1:]]
        finally:
            for c in clients:
                c.close()
        stats = ps.stats()
    mean = (2 * 1.0 + 6 * 4.0) / 8
    for got in [pulled[0], *after]:
        for part, init in zip(got, start):
            np.testing.assert_allclose(part, init - LR * mean, rtol=1e-6)
    assert stats["versions"] == [1, 1] and stats["rounds"] == [1, 1]  # one update per shard for the step
    assert stats["pushes"] == 3 and stats["replayed_pushes"] == [0, 0]


def test_the_result_does_not_depend_on_the_order_the_pushes_arrive_in():
    sizes = [1000]
    rng = np.random.default_rng(3)
    pushed = [
        rng.standard_normal(1000).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 3, 1000).astype(np.float32)
        for _ in range(3)
    ]
    results = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        with server(make_shards(sizes), num_workers=3) as ps:
            clients = [client(ps, w, sizes) for w in range(3)]
            try:
                for w in order:
                    clients[w].push([pushed[w]], step=0, rows=w + 1)
                results.append(clients[0].pull()[0])
            finally:
                for c in clients:
                    c.close()
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def test_half_width_pushes_are_widened_and_weighted_as_float32_ones():
    sizes = [64]
    rng = np.random.default_rng(1)
    pushed = [rng.standard_normal(64).astype(np.float32) for _ in range(2)]
    shards = make_shards(sizes)
    start = shards[0].w.copy()
    with server(shards, compression="bf16") as ps:
        clients = [client(ps, w, sizes, compression="bf16") for w in range(2)]
        try:
            for w, c in enumerate(clients):
                c.push([pushed[w]], step=0, rows=3 * w + 1)  # narrowed to bfloat16 by the client
            got = clients[1].pull()[0]
        finally:
            for c in clients:
                c.close()
    rounded = [p.astype(ml_dtypes.bfloat16).astype(np.float32) for p in pushed]
    np.testing.assert_allclose(got, start - LR * (rounded[0] * 1 + rounded[1] * 4) / 5, rtol=1e-6, atol=1e-7)


def test_a_worker_that_never_pushes_fails_the_others_with_a_timeout_naming_it():
    sizes = [4]
    with server(make_shards(sizes), num_workers=3, timeout=1.0) as ps:
        # worker 0's socket waits an hour: only the server's wait, giving up after its timeout=1.0, can end the pull
        with client(ps, 0, sizes, timeout=3600.0) as c0, client(ps, 1, sizes) as c1:
            for c in (c0, c1):
                c.pull()
                c.push(gradients(sizes, 1.0), step=7, rows=4)
            with pytest.raises(CollectiveTimeout) as info:
                c0.pull()
    message = str(info.value)
    # the server's message: the step, the worker that never pushed, and that its wait timed out
    assert "mode='sync_ps'" in message and "worker 0" in message and ps.addresses[0] in message
    assert "step 7" in message and "worker(s) [2]" in message and "pushed: [0, 1]" in message
    assert "timeout" in message


def test_a_join_waits_for_every_worker_and_names_those_that_never_come():
    sizes = [4]
    with server(make_shards(sizes), num_workers=3, timeout=1.0) as ps:
        with client(ps, 1, sizes) as c1:
            with pytest.raises(CollectiveTimeout, match=r"worker\(s\) \[0, 2\] never joined"):
                c1.join(5, 3)
        with client(ps, 1, sizes) as again:  # its retry: the same rows are fine, other rows are not
            with pytest.raises(CollectiveError, match="joined with 6 training rows, but an earlier attempt"):
                again.join(6, 3)


def test_a_client_waits_beyond_its_timeout_for_the_servers_answer_with_wait_grace():
    sizes = [4]
    with server(make_shards(sizes), num_workers=2, timeout=1.5) as ps:
        with client(ps, 0, sizes, timeout=1.0, wait_grace=5.0) as c:
            c.push(gradients(sizes, 1.0), step=0, rows=1)
            with pytest.raises(CollectiveTimeout, match=r"lacks the push\(es\) of worker\(s\) \[1\]"):
                c.pull()


def test_a_retried_worker_replays_its_steps_and_the_result_is_the_uninterrupted_one():
    sizes = [6, 2]

    def run(crash: bool):
        shards = make_shards(sizes)
        with server(shards, num_workers=2) as ps:
            steady = client(ps, 1, sizes)

            def train_steady():
                for step in range(4):
                    steady.pull()
                    steady.push(gradients(sizes, 1.0 + step), step=step, rows=3)
                return steady.pull()

            thread, out = in_thread(train_steady)
            first = client(ps, 0, sizes)
            for step in range(2 if crash else 4):
                first.pull()
                first.push(gradients(sizes, -2.0 * step), step=step, rows=5)
            if crash:  # the task dies after pushing step 1; Spark's retry starts from the first step again
                first.close()
                first = client(ps, 0, sizes)
                for step in range(4):
                    first.pull()
                    first.push(gradients(sizes, -2.0 * step), step=step, rows=5)
            final = first.pull()
            thread.join(10)
            first.close()
            steady.close()
            return final, out[0], ps.stats()

    straight, straight_other, straight_stats = run(crash=False)
    replayed, replayed_other, replayed_stats = run(crash=True)
    for a, b, c in zip(straight, replayed, replayed_other):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    for a, b in zip(straight, straight_other):
        np.testing.assert_array_equal(a, b)
    assert straight_stats["rounds"] == replayed_stats["rounds"] == [4, 4]
    # steps 0 and 1 of the retry were applied already (dropped); the retry's step 2 waited for nobody
    assert replayed_stats["replayed_pushes"] == [2, 2] and straight_stats["replayed_pushes"] == [0, 0]


def test_with_checkpoints_an_epochs_first_round_waits_until_the_epoch_before_is_saved():
    sizes = [3]
    steps_seen = []

    def epoch_steps(rows):
        steps_seen.append(list(rows))
        return 2  # two steps per epoch

    shards = make_shards(sizes)
    with server(shards, num_workers=2, epoch_steps=epoch_steps, timeout=10.0) as ps:
        clients = [client(ps, w, sizes) for w in range(2)]
        try:
            threads = [in_thread(lambda c=c: c.join(7, 2)) for c in clients]
            for thread, _ in threads:
                thread.join(5)
            assert steps_seen == [[7, 7]]
            for step in (2, 3):  # a fit resumed at epoch 1 (two steps per epoch): its first epoch runs freely
                for c in clients:
                    c.push(gradients(sizes, 1.0), step=step, rows=7)
                for c in clients:
                    c.pull()
            for c in clients:
                c.push(gradients(sizes, 1.0), step=4, rows=7)  # the first step of epoch 2
            waiter, _ = in_thread(clients[0].pull)
            time.sleep(0.3)
            assert waiter.is_alive() and ps.stats()["rounds"] == [2]
            state = shards[0].w.copy()  # what the driver would save: after epoch 1's last step, nothing more
            ps.epoch_saved(1)
            waiter.join(5)
            assert not waiter.is_alive() and ps.stats()["rounds"] == [3]
        finally:
            for c in clients:
                c.close()
    np.testing.assert_allclose(state, make_shards(sizes)[0].w - 2 * LR, rtol=1e-6)


def test_a_push_ahead_of_the_round_is_refused_and_only_sync_ps_servers_take_a_join():
    sizes = [4]
    with server(make_shards(sizes), num_workers=2) as ps:
        with client(ps, 0, sizes) as c:
            c.push(gradients(sizes, 1.0), step=3, rows=1)
            with client(ps, 1, sizes) as ahead:
                with pytest.raises(CollectiveError, match="pushed step 5, but shard 0 collects step 3"):
                    ahead.push(gradients(sizes, 1.0), step=5, rows=1)
    shard = SGDShard(np.zeros(4))
    with server([shard], rule=Immediate(), num_workers=1) as ps:
        sock = connect_authenticated(ps.addresses[0], 0, 0, SECRET, 5.0)
        sock.settimeout(5.0)
        sock.sendall(ps_request(protocol.Msg.JOIN, 1, 8) + np.array([5], np.int64).tobytes())
        response = ps_response(sock)
        assert response.status == protocol.Status.BAD_REQUEST
        assert "only shard 0 of a mode='sync_ps' server" in recv_exactly(sock, response.nbytes).decode()
        sock.close()


# -- through sparkdl.fit -------------------------------------------------------------------------------------------


def _uneven_digits(spark, digits, rows=101):
    """``rows`` digits, one per input partition: Spark's round-robin repartition then splits them unevenly."""
    x_train, _, y_train, _ = digits
    return spark.createDataFrame(
        [(r.tolist(), int(label)) for r, label in zip(x_train[:rows], y_train[:rows])],
        "features array<float>, label long",
    ).repartition(rows)


def test_plain_sgd_on_uneven_partitions_trains_sync_modes_weights_with_one_update_per_step(spark, digits):
    """The core equivalence: the same rows, in the same order per step, weighed by rows, one update per step."""
    df = _uneven_digits(spark, digits).cache()
    make = lambda: make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(0.1), seed=5)  # noqa: E731
    parts = partitions_as_fit_sees_them(data.prepare(df, make(), "features", "label", 2), 2)
    assert len(parts[0][0]) != len(parts[1][0])  # uneven: unequal batches at some steps, fillers never needed
    epochs, b, seed = 2, 8, 4
    common = dict(num_workers=2, epochs=epochs, batch_size=b, seed=seed, progress=False)

    sync = sparkdl.fit(df, make(), mode="sync", **common)
    sync_ps = sparkdl.fit(df, make(), mode="sync_ps", **common)

    steps = -(-max(len(p[0]) for p in parts) // b)  # the largest partition's steps, for both workers
    assert sync_ps.steps_per_epoch == sync.steps_per_epoch == steps
    assert_same_weights(sync_ps.model, sync.model)
    assert not np.allclose(sync_ps.model.get_weights()[0], make().get_weights()[0], atol=1e-3)
    np.testing.assert_allclose(sync_ps.history["loss"], sync.history["loss"], rtol=1e-4)
    stats = sync_ps.stats
    assert stats["rounds"] == stats["versions"] == [epochs * steps]  # exactly one update per step
    assert stats["pushes"] == 2 * epochs * steps and stats["pulls"] == stats["pushes"] + 2
    assert stats["replayed_pushes"] == [0] and stats["samples"] == epochs * 101
    df.unpersist()


def test_adam_on_two_server_shards_trains_sync_modes_weights(digits_df):
    """Adam's state lives in the server shards' own optimizers, one update per step each: with two shards it is
    still sync mode's Adam."""
    make = lambda: make_mlp(hidden=(32,), optimizer=keras.optimizers.Adam(0.003), seed=1)  # noqa: E731
    common = dict(num_workers=2, epochs=2, batch_size=32, seed=2, progress=False)

    sync = sparkdl.fit(digits_df, make(), mode="sync", **common)
    sync_ps = sparkdl.fit(digits_df, make(), mode="sync_ps", num_servers=2, **common)

    assert_same_weights(sync_ps.model, sync.model, rtol=1e-4, atol=1e-5)
    steps = sync_ps.steps_per_epoch
    assert sync_ps.stats["rounds"] == sync_ps.stats["versions"] == [2 * steps, 2 * steps]


def test_a_fit_resumed_from_a_mid_run_checkpoint_trains_the_uninterrupted_weights(spark, digits, tmp_path, monkeypatch):
    """The driver saves the server's state exactly at each epoch's end (the next epoch's first update waits for the
    save, and the shards' Adam state is saved with it): resumed from the checkpoint after epoch 1 of 3, a fit trains
    the weights of the run that wrote it."""
    record = Checkpointer.record

    def slow_record(self, logs):  # a slow driver: the workers would be steps into the next epoch by the save
        time.sleep(0.5)
        record(self, logs)

    monkeypatch.setattr(Checkpointer, "record", slow_record)
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:256], y_train[:256]).cache()
    make = lambda: make_mlp(hidden=(16,), optimizer=keras.optimizers.Adam(0.01), seed=3)  # noqa: E731
    common = dict(mode="sync_ps", num_workers=2, epochs=3, batch_size=32, seed=6, checkpoint_dir=str(tmp_path))

    whole = sparkdl.fit(df, make(), progress=False, **common)
    for later in tmp_path.glob("epoch-00000[23].*"):  # the checkpoints saved while the fit went on, then its last
        later.unlink()
    resumed = sparkdl.fit(df, make(), progress=False, **common)

    assert resumed.initial_epoch == 1 and len(resumed.history["loss"]) == 3
    assert resumed.history["loss"][0] == whole.history["loss"][0]
    assert_same_weights(resumed.model, whole.model)
    np.testing.assert_allclose(resumed.history["loss"], whole.history["loss"], rtol=1e-5)
    assert resumed.stats["rounds"] == [2 * whole.steps_per_epoch]  # the resumed fit's two epochs
    df.unpersist()


@pytest.mark.slow  # a retried task starts a Python worker and TensorFlow anew
def test_a_worker_killed_mid_epoch_is_retried_alone_and_the_weights_are_the_uninterrupted_ones(spark, digits):
    """Partition 0's Python worker dies hard at its 12th step; Spark retries that task alone while the other waits at
    the step it missed. The retry asks the server where it stands and resumes at that step, after the 11 the server
    applied, which applies each step once: the weights of a run without the fault."""
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:256], y_train[:256]).cache()

    def make(at_call):
        keras.utils.set_random_seed(2)
        model = keras.Sequential(
            [
                keras.Input((64,)),
                CrashOnFirstAttempt(partition=0, at_call=at_call),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        return model

    common = dict(mode="sync_ps", num_workers=2, epochs=2, batch_size=16, seed=1, progress=False)
    common["custom_objects"] = {"CrashOnFirstAttempt": CrashOnFirstAttempt}

    steady = sparkdl.fit(df, make(at_call=10**9), **common)
    crashed = sparkdl.fit(df, make(at_call=12), **common)

    assert_same_weights(crashed.model, steady.model)
    steps = 2 * steady.steps_per_epoch
    assert steady.stats["rounds"] == crashed.stats["rounds"] == [steps]
    assert steady.stats["replayed_pushes"] == crashed.stats["replayed_pushes"] == [0]
    assert crashed.stats["resumed_at"]["workers"] == [11, 0]  # the retry's first step
    assert crashed.stats["pushes"] == 2 * steps - 11  # the successful attempts' counters
    df.unpersist()


def test_a_hold_keeps_the_rounds_after_its_step_until_the_step_is_saved():
    """A worker asking for a step checkpoint after step 1 holds every shard's later rounds: round 2 is complete but
    not applied until the driver says the state after step 1 is saved; every shard's state until then is that
    state, and a pull waiting for round 2 is answered after it."""
    sizes = [3, 2]
    shards = make_shards(sizes)
    with ps_servers.server(shards, rule=SyncRounds()) as ps:
        clients = [client(ps, w, sizes) for w in range(2)]
        for step in range(2):
            if step == 1:
                clients[0].hold(1)
            for c in clients:
                c.push(gradients(sizes, 1.0), step=step, rows=1)
        after_one = [shard.w.copy() for shard in shards]
        for c in clients:
            c.pull()
            c.push(gradients(sizes, 1.0), step=2, rows=1)
        waiting, out = in_thread(clients[0].pull)
        time.sleep(0.3)
        assert waiting.is_alive() and ps.stats()["rounds"] == [2, 2]
        with ps.holding_updates():  # the driver reads the state after step 1
            _, _, next_steps = ps.positions()
            assert next_steps == [[2, 2], [2, 2]]
            for shard, held in zip(shards, after_one):
                np.testing.assert_array_equal(shard.w, held)
        ps.step_saved()
        waiting.join(5)
        assert not waiting.is_alive() and ps.stats()["rounds"] == [3, 3]
        for c in clients:
            c.close()
