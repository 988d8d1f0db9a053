"""Saving and loading KerasEstimator and KerasModel with Spark ML's MLWriter/MLReader.

A stage's directory holds Spark's usual ``metadata`` (JSON Params, as
DefaultParamsWriter writes them, through Spark) and the Keras model as
``model.keras``. On a classic session that file is written through the Hadoop
FileSystem API in the driver's JVM, so that any path Spark can write to works
(local, HDFS, S3, ...). Spark Connect has no JVM in this process: there the
client writes and reads it through ``pyarrow.fs`` (local paths, ``file://``,
``s3://``/``s3a://``, ``gs://``, ``hdfs://``, ``abfs://``), and a local path is
accepted only when the Connect server runs on this machine (otherwise the
metadata and the model would land on different machines). Both write the same
layout, so a stage saved with one kind of session loads with the other.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import SparkSession

from sparkdl.launch import session
from sparkdl.ml import custom_objects

MODEL_FILE = "model.keras"
_ARROW_SCHEMES = {"s3a": "s3", "s3n": "s3"}  # Hadoop's names for what pyarrow calls s3


def connect_path(spark: SparkSession, path: str) -> str:
    """Under Connect: ``path`` as both the server and this client read it (a local path made absolute).

    Checked before anything is written: a local path needs the Connect server on this machine.
    """
    if urlparse(path).scheme not in ("", "file"):
        return path
    if not session.server_is_on_this_machine(spark):
        raise ValueError(
            f"Expected a path on storage that both this client and the Spark Connect server at "
            f"{session.server_host(spark)!r} reach (s3://, gs://, hdfs://, abfs://). Received the local path "
            f"{path!r}: over Spark Connect the metadata is written by the server and model.keras by this client, "
            "so a local path works only with a server on this machine."
        )
    return os.path.abspath(path) if urlparse(path).scheme == "" else path


def _arrow_filesystem(path: str):
    from pyarrow import fs

    parsed = urlparse(path)
    if parsed.scheme in _ARROW_SCHEMES:
        path = parsed._replace(scheme=_ARROW_SCHEMES[parsed.scheme]).geturl()
    try:
        return fs.FileSystem.from_uri(path if parsed.scheme else os.path.abspath(path))
    except Exception as exc:  # pyarrow raises ArrowInvalid, ArrowNotImplementedError, OSError, ...
        raise ValueError(
            f"Over Spark Connect, {MODEL_FILE} is read and written by this client through pyarrow.fs, which cannot "
            f"open {path!r}: {exc}. Use a local path, file://, s3://, gs://, hdfs:// or abfs:// storage, or a "
            "classic SparkSession."
        ) from exc


def write_file(spark: SparkSession, path: str, data: bytes) -> None:
    if session.is_connect(spark):
        filesystem, file_path = _arrow_filesystem(path)
        filesystem.create_dir(os.path.dirname(file_path), recursive=True)
        with filesystem.open_output_stream(file_path) as stream:
            stream.write(data)
        return
    jvm = spark.sparkContext._jvm
    assert jvm is not None, "a classic session has a JVM gateway"
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    stream = hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).create(hadoop_path, True)
    try:
        stream.write(bytearray(data))
    finally:
        stream.close()


def read_file(spark: SparkSession, path: str) -> bytes:
    if session.is_connect(spark):
        filesystem, file_path = _arrow_filesystem(path)
        with filesystem.open_input_stream(file_path) as stream:
            return stream.read()
    jvm = spark.sparkContext._jvm
    assert jvm is not None, "a classic session has a JVM gateway"
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    stream = hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).open(hadoop_path)
    try:
        return bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


class KerasStageWriter(MLWriter):
    """Writes a stage's JSON Params (all but the Keras model) and its ``.keras`` file."""

    def __init__(self, instance) -> None:
        super().__init__()
        self.instance = instance

    def save(self, path: str) -> None:
        """Classic: MLWriter's own ``save`` (which clears the directory first for ``overwrite()``, in the JVM).
        Connect: ``overwrite()`` replaces the metadata and the model file."""
        if not session.is_connect(self.sparkSession):
            super().save(path)
            return
        self._save(connect_path(self.sparkSession, path), mode="overwrite" if self.shouldOverwrite else "error")

    def saveImpl(self, path: str) -> None:
        self._save(path, mode="error")

    def _save(self, path: str, mode: str) -> None:
        """Writes what ``DefaultParamsWriter.saveMetadata`` would, with a save mode, then ``model.keras``."""
        params = {p.name: v for p, v in self.instance._paramMap.items() if p.name != "model"}
        if params.get("customObjects") is not None:
            params["customObjects"] = custom_objects.to_json(params["customObjects"])
        metadata = DefaultParamsWriter._get_metadata_to_save(
            self.instance, self.sparkSession, extraMetadata=self.instance._extra_metadata(), paramMap=params
        )
        self.sparkSession.createDataFrame([(metadata,)], "value string").coalesce(1).write.mode(mode).text(
            os.path.join(path, "metadata")
        )
        write_file(self.sparkSession, os.path.join(path, MODEL_FILE), self.instance._keras_bytes())


class KerasStageReader(MLReader):
    """Reads what :class:`KerasStageWriter` wrote back into a new stage of ``cls``."""

    def __init__(self, cls) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        if session.is_connect(self.sparkSession):
            path = connect_path(self.sparkSession, path)
        metadata = DefaultParamsReader.loadMetadata(
            path, self.sparkSession, expectedClassName=f"{self.cls.__module__}.{self.cls.__name__}"
        )
        for old, new in getattr(self.cls, "RENAMED_PARAMS", {}).items():  # saved by an older sparkdl
            if old in metadata["paramMap"]:
                metadata["paramMap"][new] = metadata["paramMap"].pop(old)
        instance = self.cls._from_saved(read_file(self.sparkSession, os.path.join(path, MODEL_FILE)), metadata)
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata, skipParams=["model"])
        return instance


class KerasStagePersistence(MLWritable, MLReadable):
    """``write()``/``read()`` for a stage that provides ``_keras_bytes``, ``_extra_metadata`` and ``_from_saved``."""

    def write(self) -> KerasStageWriter:
        return KerasStageWriter(self)

    @classmethod
    def read(cls) -> KerasStageReader:
        return KerasStageReader(cls)
