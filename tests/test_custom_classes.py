"""Custom layers, losses and functions train and score without ``custom_objects``: defined in the driver's script or
notebook (``__main__``), registered there at run time, defined inside a function, or in a module beside the script
that the executors cannot import. What sparkdl cannot find is refused on the driver, before any Spark job."""

import os
import sys
import textwrap
import types
import uuid

import keras
import numpy as np
import pytest
from spark_jobs import no_spark_job

import sparkdl
from sparkdl.ml import KerasEstimator, KerasModel

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "jobs"))
import train  # noqa: E402  (jobs/train.py, as spark-submit runs it)

# What a driver's script or notebook cell defines, run in ``__main__`` as Python (or IPython) runs it: the layer writes
# its process's pid to ``<log_dir>/loads`` when built from its config, so a test sees which processes loaded it.
SCRIPT = """
import os

import keras


class MainScale(keras.layers.Layer):
    def __init__(self, factor=1.0, log_dir=None, **kwargs):
        super().__init__(**kwargs)
        self.factor, self.log_dir = factor, log_dir
        if log_dir is not None:
            with open(os.path.join(log_dir, "loads"), "a") as f:
                f.write(f"{os.getpid()}\\n")

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor, "log_dir": self.log_dir}


@keras.saving.register_keras_serializable(package=PACKAGE)
class MainShift(keras.layers.Layer):
    def __init__(self, shift=0.0, **kwargs):
        super().__init__(**kwargs)
        self.shift = shift

    def call(self, x):
        return x + self.shift

    def get_config(self):
        return {**super().get_config(), "shift": self.shift}


def main_loss(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred)
"""
DEFINED = ("MainScale", "MainShift", "main_loss")


def local_layer_classes(package):
    """Two layer classes defined inside a function (no import path at all): ``Halve``, and ``Triple``, registered with
    Keras under ``package``."""

    class Halve(keras.layers.Layer):
        def call(self, x):
            return x * 0.5

    @keras.saving.register_keras_serializable(package=package)
    class Triple(keras.layers.Layer):
        def call(self, x):
            return x * 3.0

    return Halve, Triple


@pytest.fixture
def in_main(monkeypatch):
    """Runs SCRIPT in ``__main__`` (MainShift registered with Keras at run time, under a fresh package name) and gives
    its namespace and that package; undone after the test, with what the test registered under the package."""
    main = sys.modules["__main__"]
    package = f"sparkdl_main_{uuid.uuid4().hex[:8]}"
    for name in (*DEFINED, "PACKAGE"):
        monkeypatch.setattr(main, name, None, raising=False)
    main.PACKAGE = package
    exec(SCRIPT, vars(main))
    yield types.SimpleNamespace(package=package, **{name: getattr(main, name) for name in DEFINED})
    registered = keras.saving.get_custom_objects()
    for key in [key for key in registered if key.startswith(f"{package}>")]:
        del registered[key]


def _model(script, log_dir, extra_layers=(), loss=None, width=4, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((width,)),
            script.MainScale(0.5, str(log_dir)),
            script.MainShift(0.25),
            *extra_layers,
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.05), loss=loss or script.main_loss, metrics=["accuracy"])
    return model


@pytest.fixture(scope="module")
def small_df(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 4))
    return spark.createDataFrame(
        [(r.tolist(), int(r[0] > 0) + int(r[1] > 0)) for r in x], "features array<double>, label int"
    )


def _loaded_in(log_dir) -> set[int]:
    with open(os.path.join(log_dir, "loads")) as f:
        return {int(line) for line in f.read().split()}


@pytest.mark.parametrize("mode", ["sync", "async", "average"])
def test_classes_and_functions_of_the_drivers_script_train_without_custom_objects(in_main, small_df, tmp_path, mode):
    """No custom_objects: the __main__ layer, the run-time registration, classes defined in a function (one registered
    with Keras) and a custom loss reach the workers (which load the model: their pids are in the log) and come back in
    the trained model."""
    halve, triple = local_layer_classes(in_main.package)
    model = _model(in_main, tmp_path, extra_layers=[halve(), triple()])
    result = sparkdl.fit(small_df, model, num_workers=2, mode=mode, epochs=2, batch_size=8, seed=0)
    workers = _loaded_in(tmp_path) - {os.getpid()}
    assert workers, "no worker process loaded the model"
    names = [type(layer).__name__ for layer in result.model.layers]
    assert names[:4] == ["MainScale", "MainShift", "Halve", "Triple"] and result.model.layers[1].shift == 0.25, names
    assert type(result.model.layers[3]) is triple  # the driver's class, found under the name it was registered with
    assert np.array_equal(keras.ops.convert_to_numpy(result.model.layers[3](np.ones((1, 4)))), np.full((1, 4), 3.0))
    assert result.model.loss is in_main.main_loss and np.isfinite(result.history["loss"]).all()


def test_a_pipeline_trains_and_scores_with_them_and_transform_equals_predict(in_main, small_df, tmp_path):
    estimator = KerasEstimator(
        model=_model(in_main, tmp_path), numWorkers=2, epochs=2, batchSize=8, seed=0, learningRate=0.02
    )
    fitted = estimator.fit(small_df)  # learningRate: the estimator copies the model on the driver, too
    scored = fitted.transform(small_df).toPandas()
    x = np.stack(small_df.toPandas()["features"])
    expected = fitted.keras_model.predict(x, verbose=0)
    assert np.abs(np.stack(scored["probability"].map(lambda v: v.toArray())) - expected).max() < 1e-6


def test_a_module_beside_the_script_that_the_executors_cannot_import(spark, small_df, tmp_path, monkeypatch):
    """A user's own module, importable on the driver only (its folder is on the driver's sys.path alone), whose
    layer is registered when it is imported: its classes go to the executors by value."""
    name = f"user_layers_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            import keras

            @keras.saving.register_keras_serializable(package="{name}")
            class Negate(keras.layers.Layer):
                def call(self, x):
                    return -x
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), module.Negate(), keras.layers.Dense(3, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    result = sparkdl.fit(small_df, model, num_workers=2, epochs=1, batch_size=8, seed=0)
    assert type(result.model.layers[0]).__name__ == "Negate"
    scored = KerasModel.from_keras(result.model).transform(small_df).toPandas()
    assert len(scored) == 60


def test_what_sparkdl_cannot_find_is_refused_before_any_job(spark, in_main, small_df, tmp_path, monkeypatch):
    def make_loss():
        def hinge_like(y_true, y_pred):  # a closure: no module defines it, and Keras does not know it
            return keras.losses.sparse_categorical_crossentropy(y_true, y_pred)

        return hinge_like

    with no_spark_job(spark), pytest.raises(ValueError, match=r"custom function 'hinge_like'.*`custom_objects`"):
        sparkdl.fit(small_df, _model(in_main, tmp_path, loss=make_loss()), num_workers=2)

    path = tmp_path / "model.keras"
    _model(in_main, tmp_path).save(path)
    monkeypatch.delattr(sys.modules["__main__"], "MainScale")  # a later session: the class is gone
    with no_spark_job(spark), pytest.raises(ValueError, match=r"custom class 'MainScale' \(module '__main__'"):
        KerasModel.from_keras(str(path)).transform(small_df)


def test_the_train_job_finds_a_models_classes_by_import_path_or_names_the_missing_one(
    in_main, tmp_path, capsys, monkeypatch
):
    path = tmp_path / "model.keras"
    _model(in_main, tmp_path).save(path)
    for name in ("MainScale", "main_loss"):  # the job is another process: the script's objects are not in its __main__
        monkeypatch.delattr(sys.modules["__main__"], name)
    with pytest.raises(SystemExit) as stopped:
        train.parse_args(["--model", str(path), "--data", "x.parquet"])
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and "--model" in error and "'MainScale'" in error and "--custom-objects" in error

    (tmp_path / "script_objects.py").write_text(SCRIPT.replace("PACKAGE", repr("sparkdl_tests_job")))
    monkeypatch.syspath_prepend(str(tmp_path))
    args = train.parse_args(
        [
            "--model",
            str(path),
            "--data",
            "x.parquet",
            "--custom-objects",
            "script_objects.MainScale,script_objects.main_loss",
        ]
    )
    assert sorted(args.custom_objects) == ["MainScale", "main_loss"]
    assert args.custom_objects["MainScale"].__module__ == "script_objects"
