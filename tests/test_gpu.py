"""Which GPU each task gets (sparkdl.launch.gpu), and a real Spark job with GPU scheduling on a local-cluster."""

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.resource import ResourceInformation

from sparkdl.launch import gpu

ROOT = Path(__file__).resolve().parent.parent
GPU_JOB = Path(__file__).resolve().parent / "gpu_job.py"


def gpus(*addresses):
    return {"gpu": ResourceInformation("gpu", list(addresses))}


@pytest.fixture(autouse=True)
def fresh_worker(monkeypatch):
    """Each test is a fresh Python worker: no GPUs remembered from an earlier task, CUDA_VISIBLE_DEVICES unset."""
    monkeypatch.setattr(gpu, "_unpinned_gpus", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def write_executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# --- assigned_gpus: the pure mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize("local_mode", [True, False])
@pytest.mark.parametrize("addresses", [["3"], ["1", "2"], ["GPU-5e1f2c3a"]])
def test_spark_assigned_addresses_win(local_mode, addresses):
    for partition in range(3):  # neither the partition nor the machine's GPUs matter
        assert gpu.assigned_gpus(gpus(*addresses), partition, local_mode, ["0", "1", "2", "3"]) == addresses


def test_addresses_come_back_as_strings():
    class Resource:  # anything with .addresses, as TaskContext.resources() values are
        addresses = (0, 1)

    assert gpu.assigned_gpus({"gpu": Resource()}, 0, False, []) == ["0", "1"]


def test_local_mode_maps_partition_to_gpu_mod_count():
    assert [gpu.assigned_gpus({}, p, True, ["0", "1"]) for p in range(4)] == [["0"], ["1"], ["0"], ["1"]]
    # The machine's own identifiers are kept (a CUDA_VISIBLE_DEVICES subset, UUIDs).
    assert [gpu.assigned_gpus({}, p, True, ["4", "6", "7"]) for p in range(4)] == [["4"], ["6"], ["7"], ["4"]]


def test_local_mode_without_gpus_assigns_none():
    assert gpu.assigned_gpus({}, 0, True, []) is None
    assert gpu.assigned_gpus({}, 3, True, ()) is None


def test_cluster_mode_without_resources_never_guesses():
    for partition in range(4):
        assert gpu.assigned_gpus({}, partition, False, ["0", "1"]) is None


def test_empty_gpu_resource_counts_as_none():
    assert gpu.assigned_gpus(gpus(), 0, False, ["0", "1"]) is None
    assert gpu.assigned_gpus(gpus(), 1, True, ["0", "1"]) == ["1"]  # local mode: falls back to mod count
    assert gpu.assigned_gpus(gpus(), 1, True, []) is None


def test_other_resources_are_not_gpus():
    resources = {"fpga": ResourceInformation("fpga", ["0"])}
    assert gpu.assigned_gpus(resources, 0, False, ["0"]) is None
    assert gpu.assigned_gpus(resources, 1, True, ["0", "1"]) == ["1"]


# --- machine_gpus ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "visible, expected",
    [
        ("0,1", ["0", "1"]),
        ("2", ["2"]),
        (" 1 , 3 ", ["1", "3"]),
        ("GPU-aaaa,GPU-bbbb", ["GPU-aaaa", "GPU-bbbb"]),
        ("", []),
        ("-1", []),
        ("0,-1,1", ["0"]),  # CUDA ignores the devices after an invalid entry
    ],
)
def test_machine_gpus_reads_cuda_visible_devices(monkeypatch, tmp_path, visible, expected):
    write_executable(tmp_path / "nvidia-smi", "#!/bin/sh\nprintf '0\\n1\\n2\\n3\\n'\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")  # set, it wins over nvidia-smi
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu.machine_gpus() == expected


def test_machine_gpus_asks_nvidia_smi_when_unset(monkeypatch, tmp_path):
    write_executable(tmp_path / "nvidia-smi", "#!/bin/sh\nprintf '0\\n1\\n\\n2\\n'\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu.machine_gpus() == ["0", "1", "2"]


def test_machine_gpus_without_nvidia_smi_or_when_it_fails(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on PATH
    assert gpu.machine_gpus() == []
    write_executable(tmp_path / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert gpu.machine_gpus() == []


# --- pin_task_gpus ---------------------------------------------------------------------------------------------


def test_pin_sets_spark_assigned_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert gpu.pin_task_gpus(gpus("2", "3"), 0, local_mode=False) == ["2", "3"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_pin_in_local_mode_takes_partition_mod_count(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert gpu.pin_task_gpus({}, 3, local_mode=True) == ["1"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_reused_worker_maps_from_the_machine_not_the_last_task(monkeypatch):
    """A reused Python worker runs tasks one after another; the second must not take the first's pin as the machine."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert gpu.pin_task_gpus({}, 1, local_mode=True) == ["1"]
    assert gpu.pin_task_gpus({}, 0, local_mode=True) == ["0"]
    assert gpu.pin_task_gpus({}, 3, local_mode=True) == ["1"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("visible", [None, "", "-1", "5"])
@pytest.mark.parametrize("resources", [{}, gpus()])
def test_pin_leaves_env_alone_when_nothing_to_assign_on_a_cluster(monkeypatch, visible, resources):
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu.pin_task_gpus(resources, 1, local_mode=False) is None
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible


@pytest.mark.parametrize("visible", ["", "-1"])
def test_pin_leaves_env_alone_in_local_mode_without_gpus(monkeypatch, visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu.pin_task_gpus({}, 0, local_mode=True) is None
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible


def test_pin_in_local_mode_without_nvidia_smi_leaves_env_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu.pin_task_gpus({}, 0, local_mode=True) is None
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_pin_warns_when_tensorflow_came_first(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorflow", object())
    with caplog.at_level(logging.WARNING, logger=gpu.__name__):
        gpu.pin_task_gpus(gpus("1"), 0, local_mode=False)
        assert "spark.python.worker.reuse=false" in caplog.text
        caplog.clear()
        gpu.pin_task_gpus(gpus("1"), 0, local_mode=False)  # already pinned to the same GPU: nothing to say
        assert caplog.text == ""


# --- the shipped configuration -------------------------------------------------------------------------------


def spark_properties(path):
    lines = (line.strip() for line in path.read_text().splitlines())
    return dict(line.split(None, 1) for line in lines if line and not line.startswith("#"))


def test_gpu_conf_schedules_one_gpu_per_task_with_the_shipped_script():
    conf = spark_properties(ROOT / "conf" / "gpu-cluster" / "spark-defaults.conf")
    assert conf["spark.task.resource.gpu.amount"] == "1"
    assert int(conf["spark.executor.resource.gpu.amount"]) >= 1
    assert int(conf["spark.task.cpus"]) >= 1
    script = conf["spark.executor.resource.gpu.discoveryScript"]
    assert Path(script).name == "get-gpus.sh"
    assert os.access(ROOT / "conf" / "get-gpus.sh", os.X_OK)


def test_discovery_script_prints_nvidia_smi_indices_as_spark_json(tmp_path):
    write_executable(tmp_path / "nvidia-smi", "#!/bin/sh\nprintf '0\\n1\\n2\\n'\n")
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        [str(ROOT / "conf" / "get-gpus.sh")], env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout
    assert json.loads(out) == {"name": "gpu", "addresses": ["0", "1", "2"]}


# --- a real Spark job with GPU scheduling ------------------------------------------------------------------------


@pytest.mark.slow  # a local-cluster Spark of its own (tests/gpu_job.py): the slow command
def test_each_rank_sees_the_gpu_spark_assigned_it(tmp_path):
    """local-cluster with GPU scheduling from a fake discovery script: every rank's CUDA_VISIBLE_DEVICES is its GPU.

    Runs in its own process: the test session's SparkSession (local[2,2]) has no GPU scheduling.
    """
    script = write_executable(
        tmp_path / "fake-gpus.sh",
        """#!/bin/sh
echo '{"name": "gpu", "addresses": ["0", "1"]}'
""",
    )
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "CUDA_VISIBLE_DEVICES": "-1",
    }  # what the executors inherit: sparkdl must replace it
    done = subprocess.run(
        [sys.executable, str(GPU_JOB), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = [line for line in done.stdout.splitlines() if line.startswith("GPU-REPORT ")]
    assert report, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = json.loads(report[-1].split(" ", 1)[1])

    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["cuda_visible_devices"] == r["spark_gpus"], ranks
    assert {r["spark_gpus"] for r in ranks} == {"0", "1"}, ranks
