"""The estimator's Params for the options the modes declare, made from the declarations themselves.

Each option a mode declares (``sparkdl.modes.base.Option``, e.g. ``push_every``) becomes a Param of
its camelCase name (``pushEvery``) with a getter and a setter (``getPushEvery``, ``setPushEvery``), so a
new option of a mode, or a mode registered by another package, needs no edit here. A Param left unset
means the option is left out: its getter answers the option's default.
"""

from __future__ import annotations

from pyspark.ml.param import Param, Params, TypeConverters

from sparkdl.modes.base import Option
from sparkdl.modes.registry import declared_options

_CONVERTERS = {
    int: TypeConverters.toInt,
    float: TypeConverters.toFloat,
    bool: TypeConverters.toBoolean,
    str: TypeConverters.toString,
    list: TypeConverters.toListString,
}


def install(cls: type) -> None:
    """Adds to ``cls`` the Param, getter and setter of every declared option it lacks (cheap when none is new)."""
    for entry in declared_options().values():
        option = entry.option
        name = option.camel_name
        if isinstance(getattr(cls, name, None), Param):
            continue
        setattr(cls, name, Param(Params._dummy(), name, entry.described(), typeConverter=_CONVERTERS[option.kind]))
        title = name[0].upper() + name[1:]
        setattr(cls, f"get{title}", _getter(option))
        setattr(cls, f"set{title}", _setter(option))


def fit_arguments(params: Params) -> dict:
    """The mode options ``params`` holds, as ``sparkdl.fit`` keywords: those defined with a value other than the
    option's default (a default is what leaving the option out means already)."""
    arguments = {}
    for entry in declared_options().values():
        option = entry.option
        if params.hasParam(option.camel_name) and params.isDefined(option.camel_name):
            value = params.getOrDefault(option.camel_name)
            if value is not None and value != option.default:
                arguments[option.name] = value
    return arguments


def _getter(option: Option):
    def get(self):
        return self.getOrDefault(option.camel_name) if self.isDefined(option.camel_name) else option.default

    get.__name__ = f"get{option.camel_name[0].upper()}{option.camel_name[1:]}"
    get.__doc__ = f"Gets the value of {option.camel_name}: {option.meaning} (default: {option.default!r})."
    return get


def _setter(option: Option):
    def set_value(self, value):
        return self._set(**{option.camel_name: value})

    set_value.__name__ = f"set{option.camel_name[0].upper()}{option.camel_name[1:]}"
    set_value.__doc__ = f"Sets the value of {option.camel_name}: {option.meaning}."
    return set_value
