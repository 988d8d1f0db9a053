"""A custom Keras layer that is NOT registered with Keras: loading a model that uses it needs custom_objects."""

import keras


class Scale(keras.layers.Layer):
    """Multiplies its input by a constant factor (part of the saved config)."""

    def __init__(self, factor=1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def make_scaled_classifier(width=4, classes=3, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((width,)), Scale(0.5), keras.layers.Dense(classes, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
