"""The learningRate and optimizerOptions Params: the optimizer's settings, tuned like any other Param.

Set, they make ``KerasEstimator`` train a copy of its model whose optimizer is rebuilt from the
model's own optimizer config with these values changed (``Optimizer.get_config``/``from_config``),
then compiled into the copy with ``Model.compile_from_config``, so that the loss and the metrics stay
as they were. The user's model is never modified. The copy's optimizer starts afresh: no slot state,
``iterations`` at 0. Both Params are plain JSON values, so they save with the estimator and vary in a
``ParamGridBuilder`` grid.
"""

from __future__ import annotations

import json

from pyspark.ml.param import Param, Params, TypeConverters

from sparkdl.keras import serialization, shipped_objects


def _to_options(value) -> dict:
    """The optimizerOptions Param's type converter: a dict of config key -> JSON value."""
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise TypeError(
            "Expected `optimizerOptions` to be a dict of the optimizer's config keys -> values, such as "
            f"{{'beta_1': 0.8, 'weight_decay': 1e-4}}. Received: {type(value).__name__}"
        )
    try:
        json.dumps(value)
    except TypeError as exc:
        raise TypeError(
            f"Expected the values of `optimizerOptions` to be numbers, booleans, strings or None (they are saved "
            f"as JSON with the stage). Received optimizerOptions={value!r}: {exc}"
        ) from None
    return dict(value)


class HasOptimizerSettings(Params):
    """``learningRate`` and ``optimizerOptions``: settings of the model's optimizer for this fit."""

    learningRate = Param(
        Params._dummy(),
        "learningRate",
        "the optimizer's learning rate for this fit (replaces the model's, or its schedule)",
        typeConverter=TypeConverters.toFloat,
    )
    optimizerOptions = Param(
        Params._dummy(),
        "optimizerOptions",
        "the optimizer's config keys -> values for this fit, e.g. {'beta_1': 0.8, 'weight_decay': 1e-4}",
        typeConverter=_to_options,
    )

    def getLearningRate(self) -> float:
        """Gets the optimizer's learning rate for this fit (the value of learningRate)."""
        return self.getOrDefault(self.learningRate)

    def setLearningRate(self, value: float):
        """Sets the optimizer's learning rate for this fit (the value of learningRate)."""
        return self._set(learningRate=value)

    def getOptimizerOptions(self) -> dict:
        """Gets the optimizer's config keys -> values for this fit (the value of optimizerOptions)."""
        return self.getOrDefault(self.optimizerOptions)

    def setOptimizerOptions(self, value: dict):
        """Sets the optimizer's config keys -> values for this fit (the value of optimizerOptions)."""
        return self._set(optimizerOptions=value)

    def with_optimizer_settings(self, model, custom_objects: dict | None):
        """``model`` itself when neither Param is set; otherwise a copy whose optimizer has these settings.

        The settings are checked against the optimizer's config first: an unknown key or a value its
        class refuses is a ``ValueError`` naming the Param, before the model is copied.
        """
        learning_rate = self.getOrDefault(self.learningRate) if self.isDefined(self.learningRate) else None
        options = self.getOrDefault(self.optimizerOptions) if self.isDefined(self.optimizerOptions) else None
        if learning_rate is None and not options:
            return model
        import keras

        optimizer = rebuilt_optimizer(model.optimizer, learning_rate, options or {})
        objects = shipped_objects.for_model(model, custom_objects, setting="customObjects")
        copy = serialization.model_from_bytes(serialization.model_to_bytes(model), objects, setting="customObjects")
        config = copy.get_compile_config()
        config["optimizer"] = keras.optimizers.serialize(optimizer)
        with keras.saving.custom_object_scope(objects):  # the loss and metrics may be custom too
            copy.compile_from_config(config)
        return copy


def rebuilt_optimizer(optimizer, learning_rate: float | None, options: dict):
    """A new optimizer of ``optimizer``'s class from its config, with ``options`` and ``learning_rate`` changed."""
    config = optimizer.get_config()
    valid = sorted(set(config) - {"name"})
    unknown = [key for key in options if key not in valid]
    if unknown:
        raise ValueError(
            f"Expected the keys of `optimizerOptions` to be settings of the model's optimizer "
            f"({type(optimizer).__name__}): {', '.join(valid)}. Received the unknown key(s) "
            f"{', '.join(map(repr, unknown))} in optimizerOptions={options!r}."
        )
    if learning_rate is not None and "learning_rate" in options:
        raise ValueError(
            "Expected the learning rate in one Param. Received both learningRate="
            f"{learning_rate!r} and optimizerOptions['learning_rate']={options['learning_rate']!r}."
        )
    changes = {**options, **({} if learning_rate is None else {"learning_rate": learning_rate})}
    try:
        return type(optimizer).from_config({**config, **changes})
    except Exception as exc:  # each optimizer class checks its own settings, with its own exceptions
        raise ValueError(
            f"Expected learningRate/optimizerOptions to be settings that {type(optimizer).__name__} accepts. "
            f"Received {changes!r}, which it refused: {type(exc).__name__}: {exc}"
        ) from None
