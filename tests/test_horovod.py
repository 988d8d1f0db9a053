"""The Horovod backend: unchanged Horovod scripts through sparkdl.run, and sparkdl.fit over Horovod's collectives.

Runs in the Horovod stack's environment (conf/horovod/install.sh; CI's second pass, with
SPARKDL_EXPECT_HOROVOD=1 so that a broken install fails instead of skipping).
"""

import json
import os
import re

import numpy as np
import pytest

if os.environ.get("SPARKDL_EXPECT_HOROVOD"):
    import horovod.tensorflow  # noqa: F401  (must be importable: fail, don't skip)
else:
    pytest.importorskip("horovod.tensorflow", reason="the Horovod stack is not installed (conf/horovod/install.sh)")

import tensorflow as tf
from frames import digits_frame
from horovod_script import train
from models import make_mlp
from worker_callbacks import RecordHorovod

import sparkdl

pytestmark = pytest.mark.horovod


def test_an_unchanged_horovod_script_runs_on_two_spark_tasks(spark, capsys):
    result = sparkdl.run(train, num_workers=2, backend="horovod", kwargs={"epochs": 8})

    assert result["rank"] == 0 and result["size"] == 2
    assert result["accuracy"] >= 0.93, result
    assert result["loss"][-1] < result["loss"][0] / 3
    out = capsys.readouterr().out
    digests = dict(re.findall(r"\[rank (\d)\] weights (\w+) on rank \d of 2", out))
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"], out[-2000:]  # replicas stayed identical
    assert re.search(r"\[rank 0\] Epoch 8/8", out)  # Keras's own progress lines, streamed from rank 0


def test_fit_with_the_horovod_backend_runs_horovod_on_every_rank_and_matches_sparkdls_communicator(
    spark, digits, tmp_path
):
    """Same weights as sparkdl's communicator, and Horovod, asked from inside each rank during training, is initialised there
    with that rank and size 2 (sparkdl's run shows it is not otherwise: a backend that silently fell back fails)."""
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:256], y_train[:256])
    weights, horovod_state = {}, {}
    for backend in ("sparkdl", "horovod"):
        directory = tmp_path / backend
        directory.mkdir()
        model = make_mlp(hidden=(32,), optimizer=tf.keras.optimizers.SGD(0.1, momentum=0.9), seed=3)
        result = sparkdl.fit(
            df,
            model,
            num_workers=2,
            epochs=3,
            batch_size=16,
            seed=5,
            backend=backend,
            callbacks=[RecordHorovod(str(directory))],
        )
        weights[backend] = result.model.get_weights()
        horovod_state[backend] = {
            rank: json.loads((directory / f"horovod-rank{rank}.json").read_text()) for rank in (0, 1)
        }
        assert result.history["loss"][-1] < result.history["loss"][0]
    assert horovod_state["sparkdl"] == {rank: {"initialized": False, "epoch": 2} for rank in (0, 1)}
    assert horovod_state["horovod"] == {
        rank: {"initialized": True, "epoch": 2, "rank": rank, "size": 2} for rank in (0, 1)
    }
    initial = make_mlp(hidden=(32,), seed=3).get_weights()
    for own, horovod, start in zip(weights["sparkdl"], weights["horovod"], initial):
        assert not np.allclose(own, start)  # it trained...
        np.testing.assert_allclose(horovod, own, rtol=1e-5, atol=1e-6)  # ...to the same weights


def test_the_horovod_communicator_offers_the_protocol_without_point_to_point():
    """Checked on the driver, without ``hvd.init()``: every protocol method is there, send/recv are not offered."""
    from sparkdl.collective.api import OPERATION_NAMES, Communicator
    from sparkdl.collective.base import BaseCommunicator
    from sparkdl.collective.horovod import HorovodCommunicator

    capabilities = HorovodCommunicator.capabilities
    assert issubclass(HorovodCommunicator, BaseCommunicator)
    assert capabilities.backend == "horovod" and capabilities.algorithms == {"horovod"}
    assert capabilities.operations == set(OPERATION_NAMES) - {"send", "recv"}
    assert capabilities.in_graph_allreduce and callable(HorovodCommunicator.allreduce_tensors)
    protocol = [
        name for name in dir(Communicator) if not name.startswith("_") and callable(getattr(Communicator, name))
    ]
    assert [name for name in protocol if not callable(getattr(HorovodCommunicator, name, None))] == []


def fail_after_init_on_rank_1():
    import horovod.tensorflow as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("missing shard on rank 1")
    hvd.allreduce(np.ones(4), name="waits_for_rank_1")  # rank 0 blocks here: the job must not
    return "unreachable"


def test_a_raising_rank_surfaces_with_its_traceback_and_the_next_job_runs(spark):
    with pytest.raises(KeyError) as caught:
        sparkdl.run(fail_after_init_on_rank_1, num_workers=2, backend="horovod", timeout=300)
    assert isinstance(caught.value, sparkdl.WorkerError) and caught.value.rank == 1
    assert "missing shard on rank 1" in str(caught.value)
    assert "in fail_after_init_on_rank_1" in caught.value.remote_traceback

    result = sparkdl.run(train, num_workers=2, backend="horovod", kwargs={"epochs": 1})
    assert result["size"] == 2
