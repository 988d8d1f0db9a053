"""Small real DataFrames shared by the tests."""


def digits_frame(spark, x, y):
    """Rows of ``features array<float>, label long``: one per row of ``x`` with its label from ``y``."""
    return spark.createDataFrame(
        [(row.tolist(), int(label)) for row, label in zip(x, y)], "features array<float>, label long"
    )
