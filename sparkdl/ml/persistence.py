"""Saving and loading KerasEstimator and KerasModel with Spark ML's MLWriter/MLReader.

A stage's directory holds Spark's usual ``metadata`` (JSON Params, written by
DefaultParamsWriter) and the Keras model as ``model.keras``, written through
the Hadoop FileSystem API so that any path Spark can write to works (local,
HDFS, S3, ...).
"""

from __future__ import annotations

import os

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import SparkSession

MODEL_FILE = "model.keras"


def write_file(spark: SparkSession, path: str, data: bytes) -> None:
    jvm = spark.sparkContext._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    stream = hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).create(hadoop_path, True)
    try:
        stream.write(bytearray(data))
    finally:
        stream.close()


def read_file(spark: SparkSession, path: str) -> bytes:
    jvm = spark.sparkContext._jvm
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

    def saveImpl(self, path: str) -> None:
        params = {p.name: v for p, v in self.instance._paramMap.items() if p.name != "model"}
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession,
                                         extraMetadata=self.instance._extra_metadata(), paramMap=params)
        write_file(self.sparkSession, os.path.join(path, MODEL_FILE), self.instance._keras_bytes())


class KerasStageReader(MLReader):
    """Reads what :class:`KerasStageWriter` wrote back into a new stage of ``cls``."""

    def __init__(self, cls) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession,
                                                    expectedClassName=f"{self.cls.__module__}.{self.cls.__name__}")
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
