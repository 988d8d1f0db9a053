"""The mode protocol: options declared once reach fit, the estimator and the jobs; a mode's task layout decides
the slots and which task reads which rows; a mode registered from outside runs through all three."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from models import make_mlp
from tally_mode import TallyMode

import sparkdl
from sparkdl.launch import run_tasks
from sparkdl.launch.layout import Task, TaskLayout
from sparkdl.ml import KerasEstimator, mode_option_params
from sparkdl.modes import registry
from sparkdl.modes.base import Option

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
import _config  # noqa: E402
import train  # noqa: E402


@pytest.fixture
def tally():
    mode = registry.register(TallyMode())
    yield mode
    registry.unregister(mode)


def test_every_declared_option_is_a_fit_keyword_an_estimator_param_and_a_job_flag():
    declared = registry.declared_options()
    assert set(declared) == {
        "backend",
        "compression",
        "overlap",
        "profile",
        "push_every",
        "num_servers",
        "max_staleness",
        "sync_every",
        "num_stages",
        "micro_batches",
        "schedule",
        "cut_points",
        "gossip_every",
        "peers",
        "shard_weights",
        "reshard_after_forward",
        "server_placement",
    }
    keywords = inspect.signature(sparkdl.fit).parameters
    estimator = KerasEstimator()
    flags = {action.dest: action for action in train.build_parser()._actions}
    for name, entry in declared.items():
        option = entry.option
        assert keywords[name].kind is inspect.Parameter.KEYWORD_ONLY and keywords[name].default is None
        assert f"{name} ({option.expected()}): {'/'.join(entry.modes)}:" in " ".join(sparkdl.fit.__doc__.split())
        param = estimator.getParam(option.camel_name)
        assert param.doc == entry.described()
        assert getattr(estimator, f"get{option.camel_name[0].upper()}{option.camel_name[1:]}")() == option.default
        assert flags[name].option_strings[0] == option.flag
    assert flags["compression"].choices == ("bf16", "fp16") and flags["overlap"].default is None


def test_a_list_option_is_a_list_from_python_a_param_of_strings_and_a_comma_separated_flag_or_toml_array(tmp_path):
    """``cut_points`` (``kind=list``): a list from Python (a string is refused: it would cut at single letters), a
    Param of strings, ``--cut-points a,b`` on the command line, and a TOML array or string in a job config."""
    assert registry.check_mode_options("pipeline", num_stages=3, cut_points=["a", "b"])["cut_points"] == ["a", "b"]
    with pytest.raises(
        ValueError, match=r"Expected `cut_points` to be a list of layer names.*Received: cut_points='a'"
    ):
        registry.check_mode_options("pipeline", num_stages=2, cut_points="a")
    estimator = KerasEstimator(mode="pipeline").setCutPoints(["a", "b"])
    assert mode_option_params.fit_arguments(estimator)["cut_points"] == ["a", "b"]
    parser = train.build_parser()
    flag = next(action for action in parser._actions if action.dest == "cut_points")
    assert flag.type("a, b") == ["a", "b"]
    for text in ('cut_points = ["a", "b"]', 'cut_points = "a,b"'):
        (tmp_path / "job.toml").write_text(text)
        value = _config.load_config(str(tmp_path / "job.toml"), parser)["cut_points"]
        assert (flag.type(value) if isinstance(value, str) else value) == ["a", "b"]
    (tmp_path / "job.toml").write_text("cut_points = [1]")
    with pytest.raises(ValueError, match=r"Expected 'cut_points' in .* to be a list of strings"):
        _config.load_config(str(tmp_path / "job.toml"), parser)


def test_the_shipped_job_configs_use_only_declared_keys():
    parser_keys = {action.dest for action in train.build_parser()._actions}
    for path in (ROOT / "conf" / "jobs").glob("train-*.toml"):
        with open(path, "rb") as f:
            assert set(tomllib.load(f)) <= parser_keys, path


def test_two_modes_declaring_one_option_differently_is_refused(tally):
    class Clash(TallyMode):
        names = ("clash",)

        def options(self, name):
            return (Option("copies", "something else", kind=str),)

    with pytest.raises(ValueError, match=r"Modes 'tally' and 'clash' declare the option 'copies' differently"):
        registry.register(Clash())
    assert "clash" not in registry.MODES
    with pytest.raises(ValueError, match=r"Mode name 'tally' is taken already"):
        registry.register(TallyMode())


def test_a_registered_modes_options_are_checked_and_defaulted(tally):
    assert registry.check_mode_options("tally", tally_dir="/x") == {"copies": 1, "tally_dir": "/x"}
    with pytest.raises(ValueError, match=r"Expected `copies` to be a positive integer. Received: copies=0"):
        registry.check_mode_options("tally", copies=0, tally_dir="/x")
    with pytest.raises(ValueError, match=r"mode='tally' needs `tally_dir`: where each task writes what it read"):
        registry.check_mode_options("tally", copies=2)
    with pytest.raises(ValueError, match=r"`copies` applies to mode='tally' only"):
        registry.check_mode_options("sync", copies=2)
    with pytest.raises(ValueError, match=r"Unknown mode option `copys`"):
        registry.check_mode_options("tally", copys=2)


def _reports(tally_dir):
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in Path(tally_dir).glob("task-*.json")}


def test_fit_runs_a_registered_mode_on_its_layout_and_owns_checkpoints_and_history(tally, spark, digits_df, tmp_path):
    """Two tasks read the one shard (``copies=2``): each gets every row, in the same order, in its own Python worker;
    the checkpointer fit opens saves each epoch, and a second fit resumes from it with the histories merged."""
    rows = digits_df.count()
    common = dict(mode="tally", copies=2, tally_dir=str(tmp_path), num_workers=2, progress=False)
    first = sparkdl.fit(digits_df, make_mlp(), epochs=2, checkpoint_dir=str(tmp_path / "ckpt"), **common)

    tasks = first.stats["tasks"]
    assert [t["partition"] for t in tasks] == [0, 1] and [t["rows"] for t in tasks] == [rows, rows]
    assert tasks[0]["fingerprint"] == tasks[1]["fingerprint"]  # the same rows in the same order
    assert os.getpid() not in {t["pid"] for t in tasks}  # read in the executors' Python, not here
    assert _reports(tmp_path) == {t["partition"]: t for t in tasks}
    assert first.history == {"rows": [rows, rows]} and first.initial_epoch == 0

    resumed = sparkdl.fit(digits_df, make_mlp(), epochs=3, checkpoint_dir=str(tmp_path / "ckpt"), **common)
    assert resumed.initial_epoch == 2 and resumed.history == {"rows": [rows, rows, rows]}


def test_a_layout_the_cluster_cannot_hold_is_refused_before_any_job(tally, spark, digits_df, tmp_path):
    with pytest.raises(ValueError, match=r"Expected num_workers >= copies. Received: num_workers=1, copies=2"):
        sparkdl.fit(digits_df, make_mlp(), mode="tally", copies=2, tally_dir=str(tmp_path), num_workers=1)


def test_a_task_that_reads_no_shard_gets_no_rows_and_a_shared_shard_the_same_rows(spark):
    frame = spark.range(0, 1000, numPartitions=3).selectExpr("id", "id * 2 AS twice")

    def rows(batches, reporter):
        ids = [i for batch in batches for i in batch.column("id").to_pylist()]
        return json.dumps(ids).encode()

    layout = TaskLayout((Task("reader", 0), Task("bystander", None)))
    got = run_tasks(frame, layout, rows, barrier=True, timeout=120)
    assert sorted(json.loads(bytes(got[0]))) == list(range(1000)) and json.loads(bytes(got[1])) == []

    # Five tasks (not a barrier stage: they run in waves on two slots): shards 0 and 1 read twice each.
    layout = TaskLayout((Task("a", 0), Task("b", 1), Task("none", None), Task("a again", 0), Task("b again", 1)))
    got = {t: json.loads(bytes(ids)) for t, ids in run_tasks(frame, layout, rows, barrier=False, timeout=120).items()}
    assert got[0] == got[3] and got[1] == got[4] and got[2] == []  # the same rows, in the same order
    assert sorted(got[0] + got[1]) == list(range(1000)) and abs(len(got[0]) - len(got[1])) <= 3


def test_a_layout_names_its_shards_from_zero_and_knows_its_readers():
    layout = TaskLayout((Task("b", None), Task("first", 0), Task("second", 0)))
    assert (layout.slots, layout.shards, layout.readers(0), layout.is_data_parallel) == (3, 1, [1, 2], False)
    assert TaskLayout.data_parallel(2).is_data_parallel
    for tasks in ((Task("a", 1),), (Task("a", None),), (Task("a", 0), Task("b", 2))):
        with pytest.raises(ValueError, match=r"Expected tasks that read shards 0..k-1"):
            TaskLayout(tasks)


def test_the_estimator_runs_a_registered_mode_with_its_option_as_a_param(tally, spark, digits_df, tmp_path):
    estimator = KerasEstimator(
        model=make_mlp(), mode="tally", numWorkers=2, copies=2, tallyDir=str(tmp_path), progress=False
    )
    assert (estimator.getCopies(), estimator.getTallyDir()) == (2, str(tmp_path))
    estimator.fit(digits_df)
    reports = _reports(tmp_path)
    assert sorted(reports) == [0, 1] and reports[0]["fingerprint"] == reports[1]["fingerprint"]
    with pytest.raises(ValueError, match=r"Unknown Param 'copys' of KerasEstimator"):
        KerasEstimator(copys=2)


@pytest.mark.slow
def test_jobs_train_runs_a_mode_another_package_registers_with_its_flag_and_config_key(tmp_path):
    """The mode comes from an installed package's ``sparkdl.modes`` entry point: the job knows its flags
    (``--tally-dir``) and config keys (``copies``) without an edit; three tasks on local[3]: two read the
    one shard, the third reads nothing."""
    plugin = tmp_path / "site"
    info = plugin / "tally_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tally-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[sparkdl.modes]\ntally = tally_mode:TallyMode\n")
    (tmp_path / "tally.toml").write_text("mode = 'tally'\ncopies = 2\nnum_workers = 3\nepochs = 1\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(Path(__file__).parent)])}
    env.pop("PYSPARK_PYTHON", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", str(tmp_path / "tally.toml")]
        + ["--tally-dir", str(out), "--master", "local[3]", "--output", str(tmp_path / "model.keras")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    reports = _reports(out)
    assert sorted(reports) == [0, 1, 2]
    assert reports[0]["fingerprint"] == reports[1]["fingerprint"] and reports[0]["rows"] > 1000
    assert reports[2]["rows"] == 0
    assert "(tally mode" in done.stdout
