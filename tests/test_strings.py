"""String columns feed string inputs (TextVectorization, StringLookup, pre-tokenised text) exactly, in ``transform``
and in the ML stages; a string where a number is expected, or the reverse, is refused on the driver. (That every mode
trains on exactly the strings Spark holds is tests/test_every_mode.py's.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from pyspark.errors import PythonException
from pyspark.ml import Pipeline
from spark_jobs import no_spark_job

import sparkdl
from sparkdl.ml import KerasEstimator, KerasModel


def digit_words(x: np.ndarray) -> list[str]:
    """Each digit image as a sentence of pixel words: ``π<row><col>`` repeated once per quarter of its intensity."""
    levels = np.rint(x * 3).astype(int)
    return [" ".join(f"π{p // 8}{p % 8}" for p in range(64) for _ in range(level[p])) for level in levels]


def text_classifier(vocabulary: list[str], seed: int = 0):
    """A bag-of-words classifier on a string input: TextVectorization's word counts, then a small MLP."""
    keras.utils.set_random_seed(seed)
    text = keras.Input(shape=(1,), dtype="string", name="text")
    counts = keras.layers.TextVectorization(vocabulary=vocabulary, standardize=None, output_mode="count")(text)
    counts = keras.layers.Reshape((len(vocabulary) + 1,))(counts)  # one row of counts (the unknown word's first)
    hidden = keras.layers.Dense(64, activation="relu")(counts)
    model = keras.Model(text, keras.layers.Dense(10, activation="softmax")(hidden))
    model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.fixture(scope="module")
def digit_texts(digits):
    x_train, x_test, y_train, y_test = digits
    return digit_words(x_train), digit_words(x_test), y_train, y_test


@pytest.fixture(scope="module")
def text_df(spark, digit_texts):
    train, _, y_train, _ = digit_texts
    return spark.createDataFrame(list(zip(train, y_train.tolist())), "text string, label long").cache()


VOCABULARY = [f"π{p // 8}{p % 8}" for p in range(64)]


def test_a_textvectorization_classifier_reaches_the_single_process_accuracy(text_df, digit_texts):
    train, test, y_train, y_test = digit_texts
    epochs = 10
    alone = text_classifier(VOCABULARY)
    alone.fit(tf.constant([[t] for t in train]), y_train, batch_size=32, epochs=epochs, verbose=0)
    _, single = alone.evaluate(tf.constant([[t] for t in test]), y_test, verbose=0)

    result = sparkdl.fit(
        text_df, text_classifier(VOCABULARY), features_col="text", num_workers=2, epochs=epochs, batch_size=16, seed=0
    )
    _, distributed = result.model.evaluate(tf.constant([[t] for t in test]), y_test, verbose=0)
    assert single > 0.93, single  # the task is learnable from the words alone
    assert distributed >= single - 0.01, (distributed, single)

    # transform feeds the same strings: its probabilities are the in-process ones
    test_df = text_df.sparkSession.createDataFrame([(t,) for t in test], "text string")
    scored = KerasModel.from_keras(result.model, featuresCol="text").transform(test_df).toPandas()
    expected = result.model.predict(tf.constant([[t] for t in test]), verbose=0)
    assert np.abs(np.stack(scored["probability"].map(lambda v: v.toArray())) - expected).max() < 1e-6


def test_non_ascii_text_gives_the_in_process_token_ids_in_transform(spark):
    texts = ["Straße grüße ÄÖÜ", "日本語 テキスト 日本語", "emoji 🎉 🎉 🚀", "naïve café naïve", "nul\x00byte x"]
    vectorize = keras.layers.TextVectorization(output_mode="int", output_sequence_length=6)
    vectorize.adapt(tf.constant(texts))
    text = keras.Input(shape=(1,), dtype="string")
    model = keras.Model(text, vectorize(text))  # the token ids themselves
    model.compile("adam", "mse")
    scored = (
        KerasModel.from_keras(model, featuresCol="text")
        .transform(spark.createDataFrame([(t,) for t in texts], "text string"))
        .toPandas()
    )
    expected = vectorize(tf.constant([[t] for t in texts])).numpy().reshape(len(texts), -1)
    assert np.array_equal(np.stack(scored["prediction"].map(np.asarray)), expected)
    assert (expected > 1).sum() > 10  # the words are in the vocabulary, not all out-of-vocabulary or padding


CITIES = ["Zürich", "Genève", "Москва", "東京", "São Paulo", "Kraków", "Reykjavík", "القاهرة"]


def _cities_frame(spark, rows=480, seed=0):
    """A wide-and-deep table: a city name and three numbers; the label is the city's parity XOR the first number's sign."""
    rng = np.random.default_rng(seed)
    city = rng.integers(0, len(CITIES), rows)
    numeric = rng.normal(size=(rows, 3))
    label = (city % 2) ^ (numeric[:, 0] > 0)
    return spark.createDataFrame(
        [(CITIES[c], n.tolist(), int(y)) for c, n, y in zip(city, numeric, label)],
        "city string, numeric array<double>, label int",
    )


def _city_model(seed=0):
    keras.utils.set_random_seed(seed)
    city = keras.Input((1,), name="city", dtype="string")
    numeric = keras.Input((3,), name="numeric")
    embedded = keras.layers.Flatten()(
        keras.layers.Embedding(len(CITIES) + 1, 4)(keras.layers.StringLookup(vocabulary=CITIES)(city))
    )
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([numeric, embedded]))
    model = keras.Model({"city": city, "numeric": numeric}, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_wide_and_deep_with_a_stringlookup_category_by_input_name(spark, mode):
    df = _cities_frame(spark)
    features = {"city": "city", "numeric": "numeric"}
    result = sparkdl.fit(
        df, _city_model(), features_col=features, num_workers=2, mode=mode, epochs=12, batch_size=16, seed=1
    )
    assert result.history["accuracy"][-1] > 0.95, result.history  # the city decides half the label: it must arrive

    scored = KerasModel.from_keras(result.model, featuresCol=features).transform(df).toPandas()
    rows = df.toPandas()
    expected = result.model.predict(
        {"city": tf.constant([[c] for c in rows["city"]]), "numeric": np.stack(rows["numeric"])}, verbose=0
    )
    assert np.abs(np.stack(scored["probability"].map(lambda v: v.toArray())) - expected).max() < 1e-6


def test_pre_tokenised_text_as_an_array_of_strings_in_a_pipeline(spark):
    """``array<string>`` feeds a ``(4,)`` string input; KerasEstimator trains it in a Pipeline and scores it."""
    rng = np.random.default_rng(3)
    words = ["gut", "schlecht", "très", "bien", "ошибка", "好", "ok", "nicht"]
    rows = [[str(w) for w in rng.choice(words, 4)] for _ in range(400)]
    df = spark.createDataFrame([(r, int("gut" in r)) for r in rows], "tokens array<string>, label int")
    keras.utils.set_random_seed(0)
    tokens = keras.Input((4,), dtype="string")
    ids = keras.layers.StringLookup(vocabulary=words)(tokens)
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(len(words) + 1, 8)(ids))
    model = keras.Model(
        tokens, keras.layers.Dense(2, activation="softmax")(keras.layers.Dense(16, activation="relu")(hidden))
    )
    model.compile(keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy", metrics=["accuracy"])
    estimator = KerasEstimator(model=model, featuresCol="tokens", numWorkers=2, epochs=10, batchSize=16, seed=0)
    fitted = Pipeline(stages=[estimator]).fit(df)
    scored = fitted.transform(df).toPandas()
    assert (scored["prediction"] == scored["label"]).mean() > 0.95
    expected = fitted.stages[0].keras_model.predict(tf.constant(rows), verbose=0)
    assert np.abs(np.stack(scored["probability"].map(lambda v: v.toArray())) - expected).max() < 1e-6


# Refused on the driver --------------------------------------------------------------------------------------


def _string_model():
    text = keras.Input((1,), dtype="string", name="text")
    ids = keras.layers.StringLookup(vocabulary=["a", "b"])(text)
    model = keras.Model(text, keras.layers.Dense(2, activation="softmax")(keras.ops.cast(ids, "float32")))
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def _number_model():
    x = keras.Input((1,), name="x")
    model = keras.Model(x, keras.layers.Dense(2, activation="softmax")(x))
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


@pytest.fixture(scope="module")
def mixed_df(spark):
    return spark.createDataFrame(
        [("a", 1.0, 0, "x"), ("b", 2.0, 1, "y")] * 4, "text string, number double, label int, word string"
    )


@pytest.mark.parametrize(
    "model, settings, message",
    [
        (
            _number_model,
            {"features_col": "text"},
            r"Column 'text' \(`features_col`\) holds strings \(string\), but the model's input 'x' .* takes numbers",
        ),
        (
            _string_model,
            {"features_col": "number"},
            r"Column 'number' \(`features_col`\) holds floats \(double\), but the model's input 'text' .*dtype string.* takes strings",
        ),
        (
            _string_model,
            {"features_col": "label"},
            r"Column 'label' \(`features_col`\) holds integers \(int\), but the model's input 'text'",
        ),
        (
            _string_model,
            {"features_col": "text", "label_col": "word"},
            r"Column 'word' \(`label_col`\) holds strings .*StringIndexer",
        ),
        (
            _string_model,
            {"features_col": "text", "sample_weight_col": "word"},
            r"column 'word' \(`sample_weight_col`\) to hold one number",
        ),
        (_string_model, {"features_col": ["text", "number"]}, r"all numbers or all strings"),
    ],
    ids=[
        "string-into-number",
        "number-into-string",
        "integer-into-string",
        "string-label",
        "string-weight",
        "mixed-list",
    ],
)
def test_a_string_where_a_number_is_expected_or_the_reverse_is_refused_before_any_job(
    spark, mixed_df, model, settings, message
):
    with no_spark_job(spark), pytest.raises(ValueError, match=message):
        sparkdl.fit(mixed_df, model(), **{"label_col": "label", **settings})
    if "label_col" not in settings and "sample_weight_col" not in settings:  # scoring matches columns to inputs alike
        with no_spark_job(spark), pytest.raises(ValueError, match=message):
            KerasModel.from_keras(model(), featuresCol=settings["features_col"]).transform(mixed_df)


def test_features_column_refuses_strings_naming_the_column(spark, mixed_df):
    with pytest.raises(ValueError, match=r"Column 'text' \(`features_col`\) holds strings .*StringIndexer"):
        sparkdl.features_column(mixed_df, "text")


@pytest.mark.parametrize(
    "rows, schema, message",
    [
        ([("a", 0), (None, 1)], "text string, label int", r"Column 'text' has 2 null rows"),
        (
            [(["a"], 0), ([None], 1)],
            "text array<string>, label int",
            r"Column 'text' has 2 rows containing null strings",
        ),
    ],
)
def test_a_null_string_is_refused_on_the_driver_naming_the_column(spark, rows, schema, message):
    text = keras.Input((1,), dtype="string")
    model = keras.Model(
        text,
        keras.layers.Dense(2, activation="softmax")(
            keras.ops.cast(keras.layers.StringLookup(vocabulary=["a"])(text), "float32")
        ),
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=message):  # the checks job's error, raised on the driver before training
        sparkdl.fit(spark.createDataFrame(rows * 2, schema), model, features_col="text", num_workers=2)
    scored = KerasModel.from_keras(model, featuresCol="text").transform(spark.createDataFrame(rows, schema).coalesce(1))
    with pytest.raises(PythonException, match=r"Column 'text' \(`features_col`\) has (null rows|rows containing null)"):
        scored.write.format("noop").mode("overwrite").save()  # transform's tasks check each batch they read


def test_a_model_with_a_string_output_is_refused_by_transform(spark):
    text = keras.Input((1,), dtype="string")
    echo = keras.Model(text, keras.layers.Identity()(text))  # declares a string output: refused on the driver
    echo.compile("adam", "mse")
    df = spark.createDataFrame([("a",), ("b",)], "text string").coalesce(1)
    with no_spark_job(spark), pytest.raises(ValueError, match=r"output\(s\) .* give strings.*IndexToString"):
        KerasModel.from_keras(echo, featuresCol="text").transform(df)

    index = keras.Input((1,), dtype="int64")  # Keras declares StringLookup(invert=True)'s strings as int64: the task
    names = keras.Model(index, keras.layers.StringLookup(vocabulary=["a", "b"], invert=True)(index))  # refuses them
    names.compile("adam", "mse")
    scored = KerasModel.from_keras(names, featuresCol="i").transform(spark.createDataFrame([(1,)], "i long"))
    with pytest.raises(PythonException, match=r"give strings.*IndexToString"):
        scored.write.format("noop").mode("overwrite").save()
