"""Small real Keras models shared by the tests."""

import keras


def make_mlp(width=64, hidden=(128, 64), classes=10, optimizer=None, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(h, activation="relu") for h in hidden]
        + [keras.layers.Dense(classes, activation="softmax")]
    )
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model
