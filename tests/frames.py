"""Small real DataFrames shared by the tests."""

import numpy as np
import pyarrow as pa
import pyspark

# PySpark 4 builds a DataFrame from an Arrow table in one step (about a tenth of the time of a list of Row tuples,
# which the suite does some 150 times); the Horovod stack's PySpark 3.5 takes only rows.
_TAKES_ARROW = int(pyspark.__version__.split(".")[0]) >= 4


def digits_frame(spark, x, y):
    """Rows of ``features array<float>, label long``: one per row of ``x`` with its label from ``y``."""
    if not _TAKES_ARROW:
        return spark.createDataFrame(
            [(row.tolist(), int(label)) for row, label in zip(x, y)], "features array<float>, label long"
        )
    features = pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(x, np.float32).ravel()), len(x[0]))
    table = pa.table({"features": features.cast(pa.list_(pa.float32())), "label": pa.array(np.asarray(y, np.int64))})
    return spark.createDataFrame(table)
