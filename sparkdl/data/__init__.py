"""The data path: from a Spark DataFrame to the arrays each worker's Keras model trains on.

| module       | side   | what it does                                                                  |
|--------------|--------|-------------------------------------------------------------------------------|
| ``model_io`` | driver | the model's inputs and outputs by name, with shapes and dtypes                |
| ``columns``  | driver | what a column holds (number, Vector, nested array, image) and its flat values |
| ``plan``     | driver | the user's settings matched to the model, checked, as the frame to train on  |
| ``checks``   | driver | each row's values to check (nulls, finiteness, widths, ranges), one column    |
| ``row_stats``| worker | those values reduced over a partition's rows, and combined across tasks       |
| ``rules``    | both   | the statistics judged: an error naming the column, or each field's shape      |
| ``shapes``   | both   | the one rule fitting a column's rows to an input's shape and dtype            |
| ``fields``   | worker | the resolved fields, and one Arrow batch to numpy arrays                      |
| ``rows``     | worker | a partition's training and validation rows, and the batches Keras takes       |
"""

from sparkdl.data.columns import features_array, features_column
from sparkdl.data.plan import ColumnSpec, TrainingData, TrainingPlan, plan, validation_split_mask
from sparkdl.data.row_stats import RowStats
from sparkdl.data.rows import ROW_KEY, VALIDATION, Partition, Rows, read_partition
from sparkdl.data.rules import Checked, RowRules

__all__ = [
    "ROW_KEY",
    "VALIDATION",
    "Checked",
    "ColumnSpec",
    "Partition",
    "RowRules",
    "RowStats",
    "Rows",
    "TrainingData",
    "TrainingPlan",
    "features_array",
    "features_column",
    "plan",
    "prepare",
    "read_partition",
    "validation_split_mask",
]


def prepare(df, model, features_col, label_col, num_workers: int, **options) -> TrainingData:
    """Validates ``df`` against ``model`` and returns the columns to train on, its rows checked on the driver by one
    Spark job: :func:`plan`, then its ``check``."""
    return plan(df, model, features_col, label_col, **options).check(num_workers)
