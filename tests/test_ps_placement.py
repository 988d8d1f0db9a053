"""``server_placement="executors"``: the parameter server's shards as Spark tasks beside the workers.

The first tests drive servers that run apart (one shard each, as server tasks do) and the driver's
controller connection with real sockets, no Spark; the next fit real models on the shared local[2,2]
session, one worker and one server task (its two slots); the last start a local[4] Spark of their own
for two workers and two server tasks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import keras
import numpy as np
import ps_servers
import pytest
from attackers import OTHER_HOST, Hog, ps_request, ps_response, recv_exactly
from frames import digits_frame
from models import CrashOnFirstAttempt, make_mlp
from ps_servers import SECRET, client, in_thread
from shards import LR, SGDShard, make_shards
from weights import assert_same_weights

import sparkdl
from sparkdl.checkpoint import CheckpointStore
from sparkdl.keras import serialization
from sparkdl.modes.parameter_server import executor_servers
from sparkdl.net.auth import connect_authenticated
from sparkdl.net.errors import CollectiveError, CollectiveTimeout
from sparkdl.ps import protocol
from sparkdl.ps.client import fetch_state
from sparkdl.ps.positions import WorkerPositions
from sparkdl.ps.rules import BoundedStaleness, SyncRounds
from sparkdl.ps.server_model import ServerModel


class StateShard(SGDShard):
    """Plain SGD whose state (its weights) the controller may read."""

    @property
    def state_nbytes(self):
        return self.w.nbytes

    def state(self):
        return [self.w.copy()]


def apart(shards, rule=ps_servers.ASYNC, num_workers=2, **kwargs):
    """One server per shard, as server tasks run them: shard k in a server of its own, under its index k."""
    return [
        ps_servers.server([shard], rule=rule, num_workers=num_workers, first_shard=k, **kwargs).__enter__()
        for k, shard in enumerate(shards)
    ]


def stop(servers):
    for server in servers:
        server.stop()


# -- servers that run apart, no Spark ------------------------------------------------------------------------------


def test_servers_apart_each_bound_staleness_and_wait_for_every_workers_done():
    """ssp over two servers of one shard each: each keeps its own clocks (every push reaches every shard), so each
    holds a fast worker's pull within max_staleness of the slow one; each ends once every worker said DONE."""
    sizes = [10, 3]
    servers = apart(make_shards(sizes), rule=BoundedStaleness(1), num_workers=3)
    finished = [in_thread(server.wait_finished) for server in servers]
    try:

        def train(worker):
            with client(servers, worker, sizes) as c:
                for _ in range(6):
                    c.pull()
                    if worker == 2:
                        time.sleep(0.12)
                    c.push([np.ones(n, np.float32) for n in sizes])
                c.done()

        threads = [in_thread(lambda w=w: train(w)) for w in range(3)]
        for thread, out in threads:
            thread.join(30)
            assert out == [None]
        for thread, out in finished:
            thread.join(5)
            assert out == [True]
        stats = [server.stats() for server in servers]
    finally:
        stop(servers)
    assert [s["clocks"] for s in stats] == [[6, 6, 6]] * 2  # each server counted every worker's pushes itself
    assert all(s["max_staleness"] <= 1 for s in stats)
    assert [s["versions"] for s in stats] == [[18], [18]]


def test_sync_ps_servers_apart_train_what_one_server_of_both_shards_trains():
    """sync_ps: a worker joins every server (each its own roster) and every shard applies the row-weighted mean of
    the step, so two servers apart end where one server of both shards does."""
    sizes = [5, 3]
    pushed = [[np.full(n, 1.0 + w, np.float32) for n in sizes] for w in range(2)]

    def train(clients):
        joins = [in_thread(lambda c=c: c.join(10 * (c.worker + 1), 2)) for c in clients]
        for thread, out in joins:
            thread.join(5)
            assert out == [[10, 20]]
        for step in range(3):
            for c in clients:
                c.push(pushed[c.worker], step=step, rows=10 * (c.worker + 1))
            pulls = [c.pull() for c in clients]
        return pulls[0]

    rng = np.random.default_rng(1)
    start = [rng.standard_normal(n) for n in sizes]
    servers = apart([SGDShard(w) for w in start], rule=SyncRounds())
    try:
        clients = [client(servers, w, sizes) for w in range(2)]
        got = train(clients)
        for c in clients:
            c.done()
            c.close()
        rounds = [server.stats()["rounds"] for server in servers]
    finally:
        stop(servers)
    with ps_servers.server([SGDShard(w) for w in start], rule=SyncRounds()) as together:
        clients = [client(together, w, sizes) for w in range(2)]
        want = train(clients)
        for c in clients:
            c.close()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    mean = (10 * 1.0 + 20 * 2.0) / 30
    np.testing.assert_allclose(got[0], start[0] - 3 * LR * mean, rtol=1e-6)
    assert rounds == [[3], [3]]


def test_the_controller_reads_an_epochs_state_and_opens_the_next_epochs_rounds():
    """sync_ps with checkpoints: the first round of an epoch waits until the controller (the driver) has read the
    state after the epoch before; what it read is exactly that state."""
    sizes = [3]
    shard = StateShard(np.zeros(3))
    (server,) = apart([shard], rule=SyncRounds(), epoch_steps=lambda rows: 2, controller=True, timeout=10.0)
    try:
        clients = [client([server], w, sizes) for w in range(2)]
        joins = [in_thread(lambda c=c: c.join(4, 2)) for c in clients]
        for thread, _ in joins:
            thread.join(5)
        for step in (0, 1):  # epoch 0: two steps
            for c in clients:
                c.push([np.ones(3, np.float32)], step=step, rows=4)
            for c in clients:
                c.pull()
        for c in clients:
            c.push([np.ones(3, np.float32)], step=2, rows=4)  # epoch 1's first step: held
        waiter, _ = in_thread(clients[0].pull)
        time.sleep(0.3)
        assert waiter.is_alive() and server.stats()["rounds"] == [2]
        state = fetch_state(server.addresses[0], shard=0, controller=2, secret=SECRET, nbytes=12, epochs=1, timeout=5)
        waiter.join(5)
        assert not waiter.is_alive() and server.stats()["rounds"] == [3]
        for c in clients:
            c.close()
    finally:
        server.stop()
    np.testing.assert_allclose(np.frombuffer(state, np.float32), np.full(3, -2 * LR), rtol=1e-6)


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def test_the_driver_assembles_the_shards_of_server_tasks_from_their_exact_state():
    """Two servers of one Keras shard each (as two server tasks build them) train a push; the driver's own copy of
    the model, set from each shard's state over the controller's connection, holds their weights and Adam's
    state, and checkpoints them in the driver placement's format."""
    driver = ServerModel(_model(), 2, compiled=False)
    hosted = [ServerModel(_model(), 2, compiled=True, hosted=[k]) for k in range(2)]
    servers = [
        ps_servers.server(m.shards, num_workers=1, first_shard=k, controller=True).__enter__()
        for k, m in enumerate(hosted)
    ]
    try:
        with client(servers, 0, driver.spans.shard_sizes) as c:
            c.pull()
            c.push([np.full(n, 0.5, np.float32) for n in driver.spans.shard_sizes])
            pulled = c.pull()
            c.done()
        for k, shard in enumerate(driver.shards):
            shard.load_state(
                fetch_state(
                    servers[k].addresses[0], shard=k, controller=1, secret=SECRET, nbytes=shard.state_nbytes, timeout=5
                )
            )
    finally:
        stop(servers)
    mine = {name: array for m in hosted for name, array in m.optimizer_arrays().items()}
    theirs = driver.optimizer_arrays()
    assert sorted(theirs) == sorted(mine) and any(name.startswith("shard1/") for name in theirs)
    for name, array in mine.items():
        np.testing.assert_array_equal(theirs[name], array)
    for k, part in enumerate(pulled):
        variables = [driver.model.trainable_variables[i] for i in driver.spans.shards[k]]
        np.testing.assert_array_equal(np.concatenate([v.numpy().ravel() for v in variables]), part)
    for k in (0, 1):  # and a checkpoint of them resumes either server task's shard
        assert ServerModel(_model(), 2, compiled=False, hosted=[k]).restore_optimizers(theirs)


def test_only_the_controller_asks_for_a_state_and_it_asks_for_nothing_else(caplog):
    """A worker's STATE, the controller's PULL, a controller where the server takes none, a state of another size:
    each refused, and the server goes on serving."""
    shard = StateShard(np.arange(4, dtype=np.float32))
    with ps_servers.server([shard], first_shard=3, controller=True) as served:
        address = served.addresses[0]
        for rank, msg, why in (
            (0, protocol.Msg.STATE, "a state request from worker 0: only the controller"),
            (2, protocol.Msg.PULL, "a pull request from the controller, which asks for the state only"),
            (2, protocol.Msg.PUSH, "a push request from the controller"),
        ):
            sock = connect_authenticated(address, rank, 3, SECRET, 5.0)
            sock.settimeout(5.0)
            nbytes = 16 if msg == protocol.Msg.PUSH else 0
            sock.sendall(ps_request(msg, 1, nbytes) + bytes(nbytes))
            response = ps_response(sock)
            assert response.status == protocol.Status.BAD_REQUEST
            assert why in recv_exactly(sock, response.nbytes).decode()
            sock.close()
        with pytest.raises(CollectiveError, match="another model or optimizer"):
            fetch_state(address, shard=3, controller=2, secret=SECRET, nbytes=12, timeout=5)
        with pytest.raises(CollectiveTimeout):  # the proof names shard 3: another shard's index is refused
            fetch_state(address, shard=0, controller=2, secret=SECRET, nbytes=16, timeout=1)
        state = fetch_state(address, shard=3, controller=2, secret=SECRET, nbytes=16, timeout=5)
        np.testing.assert_array_equal(np.frombuffer(state, np.float32), np.arange(4))
        sock = connect_authenticated(address, 1, 3, SECRET, 5.0)  # a worker is still served
        sock.settimeout(5.0)
        sock.sendall(ps_request(protocol.Msg.PULL, 1, 0))
        response = ps_response(sock)
        assert response.status == protocol.Status.OK
        np.testing.assert_array_equal(np.frombuffer(recv_exactly(sock, response.nbytes), np.float32), np.arange(4))
        sock.close()
    with ps_servers.server([shard]) as plain:
        with pytest.raises(CollectiveTimeout, match="could not connect and authenticate"):
            fetch_state(plain.addresses[0], shard=0, controller=2, secret=SECRET, nbytes=16, timeout=1)
        assert plain.stats()["refused_connections"] >= 1


# -- through sparkdl.fit, one worker and one server task --------------------------------------------------------


def _sgd_mlp():
    return make_mlp(hidden=(32,), optimizer=keras.optimizers.SGD(0.05, momentum=0.9), seed=3)


def test_a_fit_resumed_from_an_executor_servers_checkpoint_trains_the_uninterrupted_weights(spark, digits, tmp_path):
    """sync_ps: 2 epochs with the shard in a server task, saved by the driver through the controller each epoch;
    a fit of 4 resumes from them (the shard's SGD momentum too) and ends where 4 uninterrupted epochs of Keras's own
    fit do: one worker's sync_ps steps are Keras's, step for step, on rows in order (shuffle=False; resuming a
    shuffled epoch order is tests/test_checkpoints.py's). 4 steps an epoch suffice: a momentum lost at the resume
    would move every step after it."""
    x_train, _, y_train, _ = digits
    x, y = x_train[:128], y_train[:128]
    df = digits_frame(spark, x, y)
    common = dict(
        mode="sync_ps",
        num_workers=1,
        batch_size=32,
        seed=2,
        shuffle=False,
        progress=False,
        timeout=120,
        checkpoint_dir=str(tmp_path / "ckpt"),
        server_placement="executors",
    )
    first = sparkdl.fit(df, _sgd_mlp(), epochs=2, **common)
    assert [CheckpointStore(common["checkpoint_dir"]).read((e, 0)).epoch for e in (1, 2)] == [1, 2]
    (server,) = first.stats["servers"]
    assert server["pid"] != os.getpid() and first.stats["rounds"] == [2 * first.steps_per_epoch]
    resumed = sparkdl.fit(df, _sgd_mlp(), epochs=4, **common)
    straight = _sgd_mlp()  # uninterrupted, in this process
    history = straight.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0).history
    assert resumed.initial_epoch == 2 and len(resumed.history["loss"]) == 4
    assert resumed.history["loss"][:2] == pytest.approx(first.history["loss"])
    assert_same_weights(resumed.model, straight)
    np.testing.assert_allclose(resumed.history["loss"], history["loss"], rtol=1e-4)
    final = CheckpointStore(common["checkpoint_dir"]).read((4, 0))
    assert int(final.arrays["shard0/0"]) == 4 * len(x) // 32  # the shard's optimizer ran on from epoch 2


def test_a_killed_worker_restarts_the_stage_from_the_last_checkpoint(spark, digits, tmp_path):
    """async, its shard in a server task: the worker's Python dies hard in its third epoch. Spark retries the barrier
    stage, whose server task starts from the newest checkpoint, epoch 2's (the driver saved it from the server task's
    state: the weights, Adam's state and whatever the worker had pushed of epoch 3 by then, with the worker's next
    step), and whose worker trains the rest of epoch 3 and epoch 4 from there. One worker's async steps are Keras's, step for step, on rows in order (shuffle=False),
    so Keras in this process checks both attempts: epochs 1 and 2 from the start, epochs 3 and 4 from that checkpoint.

    tests/test_every_mode.py kills a worker in every mode, sync_ps with its server on executors too (a stage resumed
    from the checkpoint before the kill ends with the weights of a fit without it); here the server task of async,
    whose checkpoint need not be an epoch's end, restarts from the newer of two."""
    x_train, _, y_train, _ = digits
    x, y = x_train[:256], y_train[:256]
    steps = len(x) // 32  # one worker's steps an epoch
    marker = str(tmp_path / "crashed")
    directory = tmp_path / "ckpt"

    def model(at_call, marker):
        keras.utils.set_random_seed(0)
        m = keras.Sequential(
            [
                keras.Input((64,)),
                CrashOnFirstAttempt(partition=0, at_call=at_call, marker=marker),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        m.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return m

    faulty = sparkdl.fit(
        digits_frame(spark, x, y),
        model(2 * steps + steps // 2, marker),
        mode="async",
        num_workers=1,
        epochs=4,
        batch_size=32,
        shuffle=False,
        seed=0,
        timeout=120,
        progress=False,
        custom_objects={"CrashOnFirstAttempt": CrashOnFirstAttempt},
        checkpoint_dir=str(directory),
        server_placement="executors",
    )
    assert os.path.exists(marker)  # the worker really died once
    assert faulty.initial_epoch == 2, "the retried stage should resume after epoch 2, not start over"
    assert len(faulty.history["loss"]) == 4
    store = CheckpointStore(str(directory))
    assert store.read((4, 0)).epoch == 4
    # Epochs 1 and 2, the first attempt's: Keras's from the start.
    start = model(-1, None).fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(faulty.history["loss"][:2], start["loss"], rtol=1e-5)
    # Epochs 3 and 4, the retried stage's: Keras's from the checkpoint of epoch 2, its server's Adam state included,
    # from the step after the last one that state holds (the worker pushed on while the driver read it).
    saved = store.read((2, 0))
    at = WorkerPositions.from_vector(saved.arrays[WorkerPositions.ARRAY]).resumed(0)
    assert 2 * steps <= at < 2 * steps + steps // 2
    resumed = serialization.model_from_bytes(saved.model_bytes)
    resumed.optimizer.build(resumed.trainable_variables)
    assert len([name for name in saved.arrays if name.startswith("shard0/")]) == len(resumed.optimizer.variables)
    for j, variable in enumerate(resumed.optimizer.variables):
        variable.assign(saved.arrays[f"shard0/{j}"])
    rest = slice((at - 2 * steps) * 32, None)  # epoch 3's rows after those steps
    third = resumed.fit(x[rest], y[rest], batch_size=32, epochs=1, shuffle=False, verbose=0).history
    fourth = resumed.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history
    np.testing.assert_allclose(faulty.history["loss"][2:], third["loss"] + fourth["loss"], rtol=1e-5)
    assert_same_weights(faulty.model, resumed)


def test_an_executor_hosted_shard_keeps_its_flood_protection(spark, digits, monkeypatch):
    """While 72 idle and 8 garbage connections from another host hog the server task's listener from the moment it
    says where it serves, the fit trains exactly plain SGD's weights (one worker, one batch of all rows a step), and
    the server task's refused connections show the hog at work."""
    hogs: list[Hog] = []
    started = executor_servers.Controller.server_started

    def hog_it(controller, shard, address, task):
        hogs.extend([Hog(address, 72, source=OTHER_HOST), Hog(address, 8, source=OTHER_HOST, garbage=True)])
        started(controller, shard, address, task)

    monkeypatch.setattr(executor_servers.Controller, "server_started", hog_it)
    x_train, _, y_train, _ = digits
    x, y = x_train[:64], y_train[:64]
    model = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(0.5), seed=4)
    reference = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(0.5), seed=4)
    try:
        result = sparkdl.fit(
            digits_frame(spark, x, y),
            model,
            num_workers=1,
            mode="async",
            epochs=3,
            batch_size=64,
            timeout=120,
            progress=False,
            server_placement="executors",
        )
        assert hogs and all(hog.running() for hog in hogs)  # still hogging when the fit returned
    finally:
        for hog in hogs:
            hog.close()
    reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    assert_same_weights(result.model, reference, rtol=1e-4, atol=1e-5)
    assert result.stats["pushes"] == 3
    assert result.stats["refused_connections"] > 8


def test_a_worker_that_raises_fails_the_fit_with_its_error_and_the_server_task_ends(spark, digits):
    """A diverging worker's NaN push, refused by the server task: the fit fails with the worker's error at once, not
    after a timeout (an hour: no test outlives it), and the session's next job gets both slots at once (the server
    task did not outlive its stage): a barrier stage of two tasks, which Spark starts only when both are free."""
    x_train, _, y_train, _ = digits
    with pytest.raises(sparkdl.WorkerError, match=r"(?s)worker 0: push #\d+ .*NaN or infinite gradients"):
        sparkdl.fit(
            digits_frame(spark, x_train[:64], y_train[:64]),
            make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(1e30), seed=1),
            num_workers=1,
            mode="async",
            epochs=2,
            batch_size=16,
            seed=1,
            progress=False,
            timeout=3600,
            server_placement="executors",
        )
    both_slots = spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(lambda rows: rows)
    assert both_slots.collect() == [0, 1]


def test_bad_placements_are_refused_on_the_driver(spark, digits_df, monkeypatch):
    """A placement that is not one, a mode without a server, more tasks than slots (the servers count), and a
    barrier stage under dynamic allocation: each a ValueError naming the setting, before any training."""
    model = make_mlp(hidden=(8,))
    common = dict(epochs=1, batch_size=32, progress=False)
    with pytest.raises(ValueError, match="server_placement.*'driver' or 'executors'"):
        sparkdl.fit(digits_df, model, mode="async", server_placement="cluster", **common)
    with pytest.raises(ValueError, match="server_placement"):
        sparkdl.fit(digits_df, model, mode="sync", server_placement="executors", **common)
    with pytest.raises(ValueError, match="num_workers \\+ num_servers") as info:  # 2 + 1 tasks, 2 slots
        sparkdl.fit(digits_df, model, mode="async", num_workers=2, server_placement="executors", **common)
    assert "server_placement='executors'" in str(info.value)
    monkeypatch.setattr(executor_servers.session, "dynamic_allocation", lambda spark: True)
    with pytest.raises(ValueError, match="server_placement='driver' under spark.dynamicAllocation.enabled=true"):
        sparkdl.fit(
            digits_df, model, mode="ssp", max_staleness=1, num_workers=1, server_placement="executors", **common
        )


# -- two workers, two server tasks: a Spark of their own ------------------------------------------------------

SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
import keras, numpy as np
from pyspark.sql import SparkSession
from frames import digits_frame
from models import make_mlp
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
import sparkdl

spark = (SparkSession.builder.master("local[4]").config("spark.driver.host", "127.0.0.1")
         .config("spark.ui.enabled", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
x, y = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split((x / 16).astype(np.float32), y, test_size=0.2, random_state=0,
                                                    stratify=y)
df = digits_frame(spark, x_train, y_train).cache()
out = {{"driver_pid": os.getpid()}}

fitted = sparkdl.fit(df, make_mlp(), mode="async", num_workers=2, num_servers=2, server_placement="executors",
                     epochs=8, batch_size=16, seed=0, progress=False)
out["async"] = {{"accuracy": float(np.mean(fitted.model.predict(x_test, verbose=0).argmax(1) == y_test)),
                "servers": fitted.stats["servers"], "versions": fitted.stats["versions"],
                "pushes": fitted.stats["pushes"]}}

sgd = lambda: make_mlp(hidden=(32,), optimizer=keras.optimizers.Adam(1e-3), seed=1)
common = dict(mode="sync_ps", num_workers=2, num_servers=2, epochs=2, batch_size=16, seed=3, progress=False)
apart = sparkdl.fit(df, sgd(), server_placement="executors", **common)
driver = sparkdl.fit(df, sgd(), **common)
out["sync_ps"] = {{"largest_difference": max(float(np.abs(a - b).max()) for a, b in
                                             zip(apart.model.get_weights(), driver.model.get_weights())),
                  "rounds": [apart.stats["rounds"], driver.stats["rounds"]],
                  "losses": [apart.history["loss"], driver.history["loss"]]}}
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def two_and_two(tmp_path_factory):
    """Runs the local[4] script once for the tests below: its results, by scenario."""
    script = tmp_path_factory.mktemp("placement") / "two_and_two.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(Path(__file__).parent))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-6000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
def test_two_workers_and_two_executor_servers_train_digits_in_processes_of_their_own(two_and_two):
    """async, two workers, two server tasks: 90%+ on digits, and each shard was served by a process that is neither
    the driver nor the other shard's."""
    result = two_and_two["async"]
    assert result["accuracy"] >= 0.9, result
    pids = [server["pid"] for server in result["servers"]]
    assert [server["shard"] for server in result["servers"]] == [0, 1]
    assert len(set(pids)) == 2 and two_and_two["driver_pid"] not in pids
    assert result["versions"] == [result["pushes"]] * 2  # every push reached both server tasks


@pytest.mark.slow
def test_sync_ps_on_executor_servers_trains_the_driver_servers_weights(two_and_two):
    """sync_ps, two workers, two shards: server tasks and the driver's server apply the same updates."""
    result = two_and_two["sync_ps"]
    assert result["largest_difference"] < 1e-6, result
    assert result["rounds"][0] == result["rounds"][1]
    np.testing.assert_allclose(*result["losses"], rtol=1e-6)
