"""Opt-in experiment tracking on the driver: TensorBoard logs and MLflow runs, fed once per epoch.

Both are ``progress.EpochListener``s: they get each epoch's metrics combined
over the workers, the same values ``FitResult.history`` ends up with, and write
nothing from the workers.
"""

from __future__ import annotations

import importlib.util
import os
import time


def check_available(tensorboard_dir, log_to_mlflow: bool) -> None:
    """On the driver, before any job: the opted-in tracker is installed."""
    if tensorboard_dir is not None:
        if not isinstance(tensorboard_dir, str) or not tensorboard_dir:
            raise ValueError(f"Expected `tensorboard_dir` to be a directory path. Received: {tensorboard_dir!r}")
        if importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                "`tensorboard_dir` needs the tensorboard package, which is not installed: "
                "pip install tensorboard (or sparkdl[tracking])."
            )
    if not isinstance(log_to_mlflow, bool):
        raise ValueError(f"Expected `log_to_mlflow` to be True or False. Received: {log_to_mlflow!r}")
    if log_to_mlflow and importlib.util.find_spec("mlflow") is None:
        raise ValueError(
            "`log_to_mlflow=True` needs MLflow, which is not installed: pip install mlflow-skinny "
            "(or sparkdl[tracking])."
        )


class TensorBoardLogger:
    """Epoch scalars laid out as Keras's TensorBoard callback writes them.

    ``<dir>/train`` holds ``epoch_<metric>`` and ``epoch_samples_per_second``,
    ``<dir>/validation`` the ``val_*`` metrics under the same names, so that
    TensorBoard draws training and validation curves on one chart.
    """

    def __init__(self, log_dir: str):
        import tensorflow as tf

        self._tf = tf
        self._train = tf.summary.create_file_writer(os.path.join(log_dir, "train"))
        self._validation = tf.summary.create_file_writer(os.path.join(log_dir, "validation"))

    def on_epoch(self, epoch: int, logs: dict[str, float], samples_per_second: float) -> None:
        with self._train.as_default(step=epoch):
            for name, value in logs.items():
                if not name.startswith("val_"):
                    self._tf.summary.scalar(f"epoch_{name}", value)
            self._tf.summary.scalar("epoch_samples_per_second", samples_per_second)
        with self._validation.as_default(step=epoch):
            for name, value in logs.items():
                if name.startswith("val_"):
                    self._tf.summary.scalar(f"epoch_{name[len('val_') :]}", value)
        self._train.flush()
        self._validation.flush()

    def close(self) -> None:
        self._train.close()
        self._validation.close()


class MLflowLogger:
    """Logs the fit's settings as params and every epoch's metrics to an MLflow run.

    Uses the active run if there is one (and leaves it open), else starts one
    and ends it with the fit. Metrics are logged through the client with the
    run's id, because epochs end on a relay thread and MLflow's active run is
    per thread.
    """

    def __init__(self, params: dict):
        import mlflow

        active = mlflow.active_run()
        self._owns_run = active is None
        run = active or mlflow.start_run(run_name="sparkdl.fit")
        self.run_id = run.info.run_id
        self._client = mlflow.MlflowClient()
        self._client.log_batch(self.run_id, params=[mlflow.entities.Param(k, str(v)) for k, v in params.items()])

    def on_epoch(self, epoch: int, logs: dict[str, float], samples_per_second: float) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = {**logs, "samples_per_second": samples_per_second}
        self._client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, epoch) for k, v in values.items()])

    def close(self) -> None:
        if self._owns_run:
            import mlflow

            mlflow.end_run()
