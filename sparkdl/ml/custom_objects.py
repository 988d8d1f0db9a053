"""The ``customObjects`` Param: Keras custom objects as Python classes in memory and ``module.qualname`` in JSON.

A dict of classes is not JSON, so a saved stage stores each object's import path
(``{"MyLayer": "mypackage.layers.MyLayer"}``) and loading imports it again. Objects defined inside a
function have no import path and are refused when the stage is saved; objects registered with
``keras.saving.register_keras_serializable`` need no entry at all (Keras finds them by their
registered name).
"""

from __future__ import annotations

import importlib


def import_path(obj) -> str:
    """``module.qualname`` of ``obj``."""
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def resolve(name: str, path: str):
    """The object that the import path ``path`` (``module.qualname``) names; ``name`` is its customObjects key."""
    module_name, _, qualname = path.rpartition(".")
    error: Exception | None = None
    while module_name:
        try:
            obj = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            return obj
        except ImportError as e:  # the module part may be shorter: "package.module.Outer.Inner"
            error = e
        except AttributeError as e:
            error = e
            break
        module_name, _, head = module_name.rpartition(".")
        qualname = f"{head}.{qualname}"
    raise ValueError(
        f"Expected customObjects[{name!r}] = {path!r} to name an importable class or function, but it could not be "
        f"imported ({type(error).__name__}: {error}). Import or define it where this process can import it first, "
        f"or set customObjects with the object itself."
    )


def to_objects(value) -> dict:
    """The customObjects Param's type converter: a dict of name -> object, or name -> ``module.qualname``."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(
            f"Expected `customObjects` to be a dict of name -> class or function (or its "
            f"'module.qualname'). Received: {type(value).__name__}"
        )
    return {name: resolve(name, obj) if isinstance(obj, str) else obj for name, obj in value.items()}


def to_json(objects: dict) -> dict:
    """``{name: "module.qualname"}``, checked to import back to the same objects."""
    paths = {}
    for name, obj in objects.items():
        path = import_path(obj)
        try:
            same = resolve(name, path) is obj
        except ValueError:
            same = False
        if not same:
            raise ValueError(
                f"Cannot save customObjects[{name!r}] = {path!r}: a saved stage stores custom objects by import path, "
                "and this one cannot be imported back (defined inside a function?). Define it at the top level of a "
                "module, or register it with keras.saving.register_keras_serializable and leave it out of "
                "customObjects."
            )
        paths[name] = path
    return paths
