"""Real models fed from real tables: inputs and outputs by name, shapes, exact integer ids, sample weights, images."""

from collections import Counter

import keras
import numpy as np
import pytest
from models import RecordBatches, RecordScoredIds, make_mlp, recorded_batches, recorded_ids
from pyspark.sql import functions as F
from spark_jobs import no_spark_job

import sparkdl
from sparkdl.data.rules import RowCheckError
from sparkdl.keras.serialization import model_to_bytes
from sparkdl.launch.errors import WorkerError
from sparkdl.ml.inference import predict

BASE = 2**53 - 1000  # ids above 2^24 and up to 2^53: float32 would merge them, float64 barely holds them
IDS = 40


def _ids_frame(spark, rows=400, seed=0):
    """A wide-and-deep table: three numeric features next to an id whose parity alone decides the label."""
    rng = np.random.default_rng(seed)
    ids = BASE + rng.integers(0, IDS, rows)
    numeric = rng.normal(size=(rows, 3))
    return spark.createDataFrame(
        [(int(i), n.tolist(), int((i - BASE) % 2)) for i, n in zip(ids, numeric)],
        "id long, numeric array<double>, label int",
    )


def _wide_and_deep(id_dtype="int64", seed=0):
    keras.utils.set_random_seed(seed)
    numeric = keras.Input((3,), name="numeric")
    ids = keras.Input((1,), name="id", dtype=id_dtype)
    index = keras.layers.IntegerLookup(vocabulary=np.arange(BASE, BASE + IDS, dtype=np.int64))(ids)
    embedded = keras.layers.Flatten()(keras.layers.Embedding(IDS + 1, 4)(index))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([numeric, embedded]))
    model = keras.Model({"numeric": numeric, "id": ids}, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(keras.optimizers.Adam(0.05), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_wide_and_deep_with_ids_near_2_to_the_53(spark, mode):
    """Ids that float32 would merge (and float64 would round past 2^53) reach the Embedding exactly."""
    df = _ids_frame(spark)
    features = {"numeric": "numeric", "id": "id"}
    result = sparkdl.fit(
        df, _wide_and_deep(), features_col=features, num_workers=2, mode=mode, epochs=8, batch_size=16, seed=1
    )
    assert result.history["accuracy"][-1] == 1.0  # parity of an id is learnable only if every id arrives intact

    scored = predict(df, model_to_bytes(result.model), features_col=features, prediction_col="p").toPandas()
    assert (scored["p"] == scored["label"]).mean() == 1.0  # scoring feeds the ids as integers too
    assert len(np.unique(np.float32(scored["id"]))) < IDS // 2  # what float32 would have made of them


def _ids_beyond_float64(size=64, seed=0) -> list[int]:
    """``size`` distinct ids spread over [2^53, 2^63 - 1]: 2^53, 2^53 + 1, 2^63 - 1, and odd ids of every magnitude
    between. float64 holds 2^53 only (its spacing there is 2 and more), so a path through it changes all the others."""
    rng = np.random.default_rng(seed)
    exponents = rng.integers(53, 63, size - 3)
    spread = (2**exponents + rng.integers(0, 2**exponents, dtype=np.int64)) | 1
    ids = [2**53, 2**53 + 1, 2**63 - 1, *map(int, spread)]
    assert len(set(ids)) == size and [i for i in ids if int(float(i)) == i] == [2**53]
    return ids


@pytest.mark.parametrize("path", ["sync", "async", "transform"])
def test_ids_up_to_2_to_the_63_reach_the_model_to_the_last_bit(spark, tmp_path, path):
    """The ids a model's int64 input receives, recorded inside the model (in the workers' train steps, or where
    ``KerasModel.transform`` scores), are the DataFrame's to the last bit."""
    from sparkdl.ml import KerasModel

    ids = _ids_beyond_float64()
    df = spark.createDataFrame(
        [(i, [float(k % 7), 1.0], float(k % 3)) for k, i in enumerate(ids)], "id long, x array<float>, y double"
    )
    keras.utils.set_random_seed(0)
    id_input, x = keras.Input((1,), name="id", dtype="int64"), keras.Input((2,), name="x")
    output = keras.layers.Dense(1)(RecordScoredIds(str(tmp_path))([id_input, x]))
    model = keras.Model({"id": id_input, "x": x}, output)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    features = {"id": "id", "x": "x"}

    if path == "transform":
        scorer = KerasModel.from_keras(model, featuresCol=features, customObjects={"RecordScoredIds": RecordScoredIds})
        assert len(scorer.transform(df).select("prediction").collect()) == len(ids)
    else:
        sparkdl.fit(
            df,
            model,
            features_col=features,
            label_col="y",
            num_workers=2,
            mode=path,
            epochs=1,
            batch_size=16,
            custom_objects={"RecordScoredIds": RecordScoredIds},
        )

    recorded = recorded_ids(tmp_path)
    if path != "transform":
        assert sorted(recorded) == [0, 1]  # both workers trained, in the Spark tasks
    assert sorted(i for part in recorded.values() for i in part) == sorted(ids)


def test_two_outputs_and_sample_weights_by_name(spark):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(256, 4))
    df = spark.createDataFrame(
        [(r.tolist(), float(r.sum()), int(r[0] > 0), 1.0 + float(r[1] > 0)) for r in x],
        "x array<float>, total double, sign int, w double",
    )
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), name="x")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(
        inputs,
        {
            "total": keras.layers.Dense(1, name="total")(hidden),
            "sign": keras.layers.Dense(2, "softmax", name="sign")(hidden),
        },
    )
    model.compile(
        keras.optimizers.Adam(0.02),
        loss={"total": "mse", "sign": "sparse_categorical_crossentropy"},
        metrics={"sign": ["accuracy"]},
    )
    labels = {"total": "total", "sign": "sign"}
    result = sparkdl.fit(
        df,
        model,
        features_col="x",
        label_col=labels,
        sample_weight_col="w",
        num_workers=2,
        epochs=10,
        batch_size=16,
        seed=0,
    )
    history = result.history
    assert {"total_loss", "sign_loss", "sign_accuracy"} <= set(history)
    assert history["total_loss"][-1] < 0.2 * history["total_loss"][0]
    assert history["sign_accuracy"][-1] > 0.9


@pytest.mark.parametrize("mode", ["sync", "async", "average"])
def test_sample_weights_weigh_the_loss_as_keras_does(spark, digits, mode):
    """One worker, plain SGD, every epoch one batch of all the rows: the trained weights are Keras's own
    ``fit(sample_weight=...)``'s on the rows as collected from the DataFrame. The order Spark delivers the rows in
    cannot matter, but the worker shuffles them each epoch, so a weight that left its row would change the step."""
    x_train, _, y_train, _ = digits
    rows, epochs = 96, 3
    weights = np.random.default_rng(0).uniform(0.0, 3.0, rows)
    df = spark.createDataFrame(
        [(r.tolist(), int(label), float(w)) for r, label, w in zip(x_train[:rows], y_train[:rows], weights)],
        "features array<float>, label long, w double",
    )

    def make():
        model = make_mlp(hidden=(16,), optimizer=keras.optimizers.SGD(0.5), seed=3)
        model.compile(model.optimizer, model.loss, weighted_metrics=["accuracy"])  # accuracy weighted as the loss
        return model

    options = {"sync_every": 2} if mode == "average" else {}
    result = sparkdl.fit(
        df, make(), sample_weight_col="w", num_workers=1, mode=mode, epochs=epochs, batch_size=rows, seed=1, **options
    )
    collected = df.collect()
    x = np.array([row.features for row in collected], np.float32)
    y = np.array([row.label for row in collected], np.int64)
    w = np.array([row.w for row in collected], np.float32)
    reference = make()
    expected = reference.fit(x, y, sample_weight=w, batch_size=rows, epochs=epochs, shuffle=False, verbose=0).history
    if mode != "average":  # a worker's own Keras fit reports the epoch: its weighted loss and metrics are Keras's
        for name in ("loss", "accuracy"):
            np.testing.assert_allclose(result.history[name], expected[name], rtol=1e-4, err_msg=name)
    unweighted = make()
    unweighted.fit(x, y, batch_size=rows, epochs=epochs, shuffle=False, verbose=0)
    for got, want in zip(result.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert any(not np.allclose(p, w_, atol=1e-4) for p, w_ in zip(unweighted.get_weights(), reference.get_weights()))


def _cnn(shape, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input(shape),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_cnn_on_digits_from_flat_and_nested_rows(spark, digits):
    """64 flat values and 8x8 nested arrays both feed an (8, 8, 1) input, value for value: the same seeded fit on
    either column trains the same weights; scoring reshapes by the same rule, and predicts what Keras predicts."""
    x_train, _, y_train, _ = digits
    rows = 192
    flat = spark.createDataFrame(
        [(i, r.tolist(), r.reshape(8, 8).tolist(), int(label)) for i, (r, label) in enumerate(zip(x_train, y_train))][
            :rows
        ],
        "id int, pixels array<float>, image array<array<float>>, label long",
    )
    trained = {
        column: sparkdl.fit(flat, _cnn((8, 8, 1)), features_col=column, num_workers=2, epochs=1, batch_size=16, seed=0)
        for column in ("pixels", "image")
    }
    assert _cnn((8, 8, 1)).get_weights()[0].tolist() != trained["pixels"].model.get_weights()[0].tolist()  # trained
    for got, want in zip(trained["image"].model.get_weights(), trained["pixels"].model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    model = trained["pixels"].model
    scored = (
        predict(flat, model_to_bytes(model), features_col="pixels", prediction_col="p").toPandas().sort_values("id")
    )
    expected = model.predict(x_train[:rows].reshape(-1, 8, 8, 1), verbose=0).argmax(axis=1)
    np.testing.assert_array_equal(scored["p"].to_numpy(), expected)


def test_text_model_over_token_ids(spark):
    """``array<int>`` token ids of one length feed an Embedding whose input has a free length (None,)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 50, size=(400, 12))
    label = (tokens == 7).any(axis=1)
    tokens[label, 0] = 7
    df = spark.createDataFrame([(t.tolist(), int(y)) for t, y in zip(tokens, label)], "tokens array<int>, label int")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((None,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalMaxPooling1D(),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy", metrics=["accuracy"])
    result = sparkdl.fit(df, model, features_col="tokens", num_workers=2, mode="async", epochs=6, batch_size=16, seed=0)
    assert result.history["accuracy"][-1] > 0.95


def _distinct_pixels(rng, bright_channel):
    """6 x 5 RGB pixels whose 90 values all differ: channel ``bright_channel`` in 166..255, the other two in 0..59."""
    dark = rng.choice(60, 60, replace=False)
    pixels = np.empty((6, 5, 3), np.uint8)
    pixels[..., bright_channel] = rng.choice(np.arange(166, 256), 30, replace=False).reshape(6, 5)
    pixels[..., [c for c in range(3) if c != bright_channel]] = dark.reshape(6, 5, 2)
    return pixels


def test_image_source_feeds_a_cnn_each_pixel_in_bgr_order(spark, tmp_path):
    """PNGs read with Spark's image source (its struct column) train a CNN directly, and score. The tensor the
    workers' model receives is each PNG's pixels in the source's OpenCV channel order (docs/data.md: BGR), channel
    by channel: every value of an image differs from the others, so a swapped channel order or moved pixel matches
    no image."""
    from PIL import Image

    rng = np.random.default_rng(0)
    folder, seen = tmp_path / "png", tmp_path / "seen"
    folder.mkdir(), seen.mkdir()
    expected = {}  # what the model should receive for each PNG: its (height, width, RGB) pixels as BGR
    for i in range(24):
        red = i % 2 == 0
        pixels = _distinct_pixels(rng, 0 if red else 2)
        path = folder / f"{'red' if red else 'blue'}-{i}.png"
        Image.fromarray(pixels).save(path)
        expected[path.name] = pixels[..., ::-1].astype(np.float32)
    images = spark.read.format("image").load(str(folder))
    df = images.withColumn("label", F.col("image.origin").contains("/red-").cast("int"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6, 5, 3)),
            RecordBatches(str(seen)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy", metrics=["accuracy"])
    custom_objects = {"RecordBatches": RecordBatches}
    epochs, b = 15, 4
    result = sparkdl.fit(
        df,
        model,
        features_col="image",
        num_workers=2,
        epochs=epochs,
        batch_size=b,
        seed=0,
        custom_objects=custom_objects,
    )
    assert result.history["accuracy"][-1] == 1.0
    scored = predict(
        df, model_to_bytes(result.model), features_col="image", prediction_col="p", custom_objects=custom_objects
    ).toPandas()
    assert (scored["p"] == scored["label"]).all()

    received = [image for rank in (0, 1) for batch in recorded_batches(seen, rank) for image in batch]
    assert len(received) == epochs * len(expected)
    names = {image.tobytes(): name for name, image in expected.items()}
    assert Counter(names.get(image.tobytes(), "no PNG") for image in received) == {name: epochs for name in expected}
    name = "red-0.png"  # and what tells them apart, for one image: BGR is its PNG's channels reversed
    first = next(image for image in received if names.get(image.tobytes()) == name)
    rgb = np.asarray(Image.open(folder / name), np.float32)
    for channel in range(3):
        np.testing.assert_array_equal(first[..., channel], rgb[..., 2 - channel])
    assert not np.array_equal(first, rgb)


# Bad input: refused on the driver, before the training stage, naming the column and what was expected.


def _refused_before_any_job(spark, df, model, match, **kwargs):
    with no_spark_job(spark), pytest.raises(ValueError, match=match) as info:
        sparkdl.fit(df, model, num_workers=2, **kwargs)
    assert not isinstance(info.value, WorkerError)


def test_a_vector_whose_ml_attributes_give_its_size_is_checked_before_any_job_in_fit_and_transform(spark):
    """VectorAssembler writes a Vector's size into the schema: a model input of another size is refused at once."""
    from pyspark.ml.feature import VectorAssembler

    rows = spark.createDataFrame(
        [(float(i), 1.0, 2.0, i % 2) for i in range(8)], "a double, b double, c double, label int"
    )
    df = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(rows)
    assert df.schema["features"].metadata["ml_attr"]["num_attrs"] == 3
    model = make_mlp(width=4, hidden=(), classes=2)
    message = r"Column 'features' \(`features_col`\) holds rows of 3 values; the model's input .* takes 4 values"
    _refused_before_any_job(spark, df, model, message)
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        predict(df, model_to_bytes(model), features_col="features", prediction_col="p")
    right = make_mlp(width=3, hidden=(), classes=2)  # the size the attributes give trains
    assert sparkdl.fit(df, right, num_workers=2, epochs=1, batch_size=4, progress=False).history["loss"]


def test_schema_errors_name_inputs_and_columns(spark):
    df = _ids_frame(spark, rows=40)
    model = _wide_and_deep()
    _refused_before_any_job(
        spark,
        df,
        model,
        r"The model has 2 inputs \['numeric', 'id'\]: pass `features_col` as a mapping",
        features_col="numeric",
    )
    _refused_before_any_job(
        spark,
        df,
        model,
        r"`features_col` names input\(s\) \['wide'\] that the model does not have: its inputs are",
        features_col={"wide": "numeric", "id": "id", "numeric": "numeric"},
    )
    _refused_before_any_job(
        spark, df, model, r"gives no column for the model's input\(s\) \['id'\]", features_col={"numeric": "numeric"}
    )
    floats = df.withColumn("id", F.col("id").cast("double"))
    _refused_before_any_job(
        spark,
        floats,
        model,
        r"Column 'id' \(`features_col\['id'\]`\) holds floats \(double\), but the model's input 'id'.*takes integers",
        features_col={"numeric": "numeric", "id": "id"},
    )
    two = keras.Model(model.inputs, [model.outputs[0], model.outputs[0]])
    two.compile("adam", ["sparse_categorical_crossentropy"] * 2)
    _refused_before_any_job(
        spark, df, two, r"pass `label_col` as a mapping", features_col={"numeric": "numeric", "id": "id"}
    )
    _refused_before_any_job(
        spark,
        df,
        make_mlp(width=3),
        r"Expected column 'numeric' \(`sample_weight_col`\) to hold one number",
        features_col="numeric",
        sample_weight_col="numeric",
    )


def _refused_before_training(df, model, match, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        sparkdl.fit(df, model, num_workers=2, **kwargs)
    assert info.type is RowCheckError  # the rows' checks, raised by every rank before its first step


def test_data_errors_are_refused_before_training(spark):
    df = _ids_frame(spark, rows=40)
    features = {"numeric": "numeric", "id": "id"}
    _refused_before_training(
        df,
        _wide_and_deep(id_dtype="float32"),
        r"Column 'id' .* holds integers up to .* exactly only up to 16777216",
        features_col=features,
    )
    _refused_before_training(
        df,
        _wide_and_deep(id_dtype="int32"),
        r"Column 'id' .* outside what the model's input 'id'.*int32",
        features_col=features,
    )
    pixels = df.withColumn("pixels", F.array_repeat(F.lit(1.0), 63))
    _refused_before_training(
        pixels,
        _cnn((8, 8, 1)),
        r"Column 'pixels' \(`features_col`\) holds rows of 63 values; the model's input .*\(None, 8, 8, 1\)",
        features_col="pixels",
    )
    nested = df.withColumn("image", F.array_repeat(F.array_repeat(F.lit(1.0), 4), 16))
    _refused_before_training(
        nested, _cnn((8, 8, 1)), r"Column 'image' .* holds rows of shape \(16, 4\)", features_col="image"
    )
    holes = nested.withColumn(
        "image", F.when(F.col("label") == 1, F.array(F.lit(None).cast("array<double>"))).otherwise(F.col("image"))
    )
    _refused_before_training(
        holes,
        _cnn((8, 8, 1)),
        r"Column 'image' has \d+ rows with a null array at nesting level 2",
        features_col="image",
    )
    negative = df.withColumn("w", F.lit(-1.0))
    _refused_before_training(
        negative,
        make_mlp(width=3, classes=2),
        r"Column 'w' \(`sample_weight_col`\) has 40 negative weights",
        features_col="numeric",
        sample_weight_col="w",
    )


def test_estimator_takes_inputs_by_name_and_a_weight_column(spark, tmp_path):
    """KerasEstimator and KerasModel read the same mappings as fit, and keep them through save and load."""
    from sparkdl.ml import KerasEstimator, KerasModel

    df = _ids_frame(spark).withColumn("w", F.lit(1.0))
    features = {"numeric": "numeric", "id": "id"}
    estimator = KerasEstimator(
        model=_wide_and_deep(), featuresCol=features, weightCol="w", numWorkers=2, epochs=8, batchSize=16, seed=1
    )
    fitted = estimator.fit(df)
    assert fitted.getFeaturesCol() == features
    fitted.write().save(str(tmp_path / "model"))
    loaded = KerasModel.load(str(tmp_path / "model"))
    assert loaded.getFeaturesCol() == features
    scored = loaded.transform(df).select("prediction", "label").toPandas()
    assert (scored["prediction"] == scored["label"]).mean() == 1.0
