"""A fit reads its input once: the rows' checks are reduced where the training stage reads them, in no job of their
own, and still stop the fit, naming the column, before any rank's first step."""

import keras
import pytest
from models import make_mlp

import sparkdl
from sparkdl.data.rules import RowCheckError


def _counted(spark, df):
    """``df`` computed through a function that counts every row it hands on (an accumulator: every task's count
    reaches the driver), and the accumulator."""
    computed = spark.sparkContext.accumulator(0)

    def count(batches):
        for batch in batches:
            computed.add(batch.num_rows)
            yield batch

    return df.mapInArrow(count, df.schema), computed


@pytest.mark.parametrize("mode, options", [("sync", {}), ("async", {}), ("average", {"sync_every": 4})])
def test_a_fit_computes_each_input_row_once(spark, digits_df, mode, options):
    df, computed = _counted(spark, digits_df)
    rows = digits_df.count()
    sparkdl.fit(df, make_mlp(), num_workers=2, mode=mode, epochs=2, batch_size=64, seed=0, progress=False, **options)
    assert computed.value == rows  # was 2x: a checks job over all rows, then the training stage's read


def test_a_bad_row_stops_the_fit_before_any_rank_trains(spark, tmp_path):
    marker = tmp_path / "trained"
    callback = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: marker.touch())
    model = make_mlp(width=2, hidden=(4,), classes=2)
    clean = [([0.1 * (i % 7), 0.2], i % 2) for i in range(40)]
    df = spark.createDataFrame(clean, "f array<double>, label int")
    sparkdl.fit(df, model, features_col="f", num_workers=2, epochs=1, callbacks=[callback], progress=False)
    assert marker.exists()  # the callback runs in the ranks: it would see a step
    marker.unlink()

    bad = spark.createDataFrame(clean + [([0.1, float("nan")], 0)], "f array<double>, label int")
    with pytest.raises(RowCheckError, match=r"^Column 'f' has 1 rows containing NaN"):
        sparkdl.fit(bad, model, features_col="f", num_workers=2, epochs=1, callbacks=[callback], progress=False)
    assert not marker.exists()
